#include "examples/gpt/model.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "checkpoint/checkpoint.h"

namespace fairscale::examples::gpt {

TransformerBlockImpl::TransformerBlockImpl(int64_t width, int64_t heads) : heads_(heads) {
  TORCH_CHECK(heads > 0 && width % heads == 0, "TransformerBlock: width ", width,
              " is not divisible by heads ", heads);
  ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
  qkv_ = register_module("qkv", torch::nn::Linear(width, 3 * width));
  proj_ = register_module("proj", torch::nn::Linear(width, width));
  ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
  fc1_ = register_module("fc1", torch::nn::Linear(width, 4 * width));
  fc2_ = register_module("fc2", torch::nn::Linear(4 * width, width));
}

torch::Tensor TransformerBlockImpl::forward(torch::Tensor x) {
  const int64_t b = x.size(0), t = x.size(1), c = x.size(2), d = c / heads_;
  std::vector<at::Tensor> qkv = qkv_(ln1_(x)).chunk(3, -1);
  auto split = [&](const at::Tensor& z) { return z.view({b, t, heads_, d}).transpose(1, 2); };
  at::Tensor att = at::matmul(split(qkv[0]), split(qkv[1]).transpose(-2, -1)) /
                   std::sqrt(static_cast<double>(d));
  // Built per call rather than kept as a buffer: FSDP broadcasts buffers, and there is no
  // bool collective dtype.
  at::Tensor future = at::ones({t, t}, x.options().dtype(at::kBool)).triu(1);
  att = at::softmax(att.masked_fill(future, -INFINITY), -1);
  at::Tensor y = at::matmul(att, split(qkv[2])).transpose(1, 2).reshape({b, t, c});
  x = x + proj_(y);
  return x + fc2_(at::gelu(fc1_(ln2_(x))));
}

EmbeddingsImpl::EmbeddingsImpl(int64_t vocab, int64_t seq, int64_t width) {
  tok_ = register_module("tok", torch::nn::Embedding(vocab, width));
  pos_ = register_module("pos", torch::nn::Embedding(seq, width));
}

torch::Tensor EmbeddingsImpl::forward(torch::Tensor tokens) {
  return tok_(tokens) + pos_(at::arange(tokens.size(1), tokens.options()));
}

LmHeadImpl::LmHeadImpl(int64_t width, int64_t vocab) {
  ln_f_ = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
  head_ = register_module("head", torch::nn::Linear(width, vocab));
}

torch::Tensor LmHeadImpl::forward(torch::Tensor x) { return head_(ln_f_(x)); }

GptImpl::GptImpl(const GptConfig& config) : config_(config) {
  TORCH_CHECK(config.vocab() > 0 && config.seq() > 0 && config.blocks() >= 0,
              "Gpt: vocab, seq must be positive and blocks non-negative");
  // Construction order = initialization order: embeddings, blocks, head.
  embed_ = fsdp::wrap(Embeddings(config.vocab(), config.seq(), config.width()));
  register_module("embed", embed_.ptr());
  TORCH_CHECK(config.checkpoint_every_k() >= 0, "Gpt: checkpoint_every_k must be >= 0, got ",
              config.checkpoint_every_k());
  for (int64_t i = 0; i < config.blocks(); ++i) {
    TransformerBlock block(config.width(), config.heads());
    const int64_t k = config.checkpoint_every_k();
    blocks_.push_back(k > 0 && i % k == 0 ? fsdp::wrap(checkpoint::CheckpointWrapper(block))
                                          : fsdp::wrap(block));
    register_module("block" + std::to_string(i), blocks_.back().ptr());
  }
  lm_head_ = fsdp::wrap(LmHead(config.width(), config.vocab()));
  register_module("lm_head", lm_head_.ptr());
}

torch::Tensor GptImpl::forward(torch::Tensor tokens) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(1) <= config_.seq(), "Gpt: tokens must be [batch, t] with t <= ",
              config_.seq(), ", got ", tokens.sizes());
  at::Tensor x = embed_(tokens);
  for (auto& block : blocks_) x = block(x);
  return lm_head_(x);
}

fsdp::AutoWrapPolicy GptWrapPolicy() {
  fsdp::AutoWrapPolicy by_type =
      fsdp::module_type_auto_wrap_policy<TransformerBlockImpl, EmbeddingsImpl, LmHeadImpl>();
  return [by_type](const torch::nn::Module& module, int64_t numel) {
    if (const auto* ck = dynamic_cast<const checkpoint::CheckpointWrapperImpl*>(&module)) {
      return !ck->module().is_empty() &&
             dynamic_cast<const TransformerBlockImpl*>(ck->module().ptr().get()) != nullptr;
    }
    return by_type(module, numel);
  };
}

namespace {
// splitmix64: a tiny counter-based generator, identical on every platform and rank.
uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
}  // namespace

std::vector<int64_t> generate(const std::function<torch::Tensor(torch::Tensor)>& logits_fn,
                              const std::vector<int64_t>& prompt, int64_t new_tokens,
                              int64_t context, const SampleOptions& options) {
  TORCH_CHECK(!prompt.empty(), "generate: the prompt is empty");
  TORCH_CHECK(options.temperature() > 0, "generate: temperature must be > 0");
  TORCH_CHECK(context > 0, "generate: context must be > 0");
  torch::NoGradGuard no_grad;
  std::vector<int64_t> all = prompt, out;
  uint64_t rng = options.seed();
  for (int64_t i = 0; i < new_tokens; ++i) {
    const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(all.size()) - context);
    std::vector<int64_t> window(all.begin() + start, all.end());
    at::Tensor input = at::tensor(window, at::kLong).view({1, -1});
    at::Tensor last = logits_fn(input).select(1, -1).reshape({-1}).to(at::kDouble).contiguous();
    const double* l = last.data_ptr<double>();
    const int64_t v = last.numel();
    std::vector<int64_t> ids(v);
    std::iota(ids.begin(), ids.end(), 0);
    int64_t k = options.top_k() > 0 ? std::min(options.top_k(), v) : v;
    // Stable order (logit descending, then id) so ties break the same way everywhere.
    std::stable_sort(ids.begin(), ids.end(), [&](int64_t a, int64_t b) { return l[a] > l[b]; });
    ids.resize(k);
    std::vector<double> p(k);
    double total = 0;
    for (int64_t j = 0; j < k; ++j) {
      p[j] = std::exp((l[ids[j]] - l[ids[0]]) / options.temperature());
      total += p[j];
    }
    const double u = (SplitMix64(rng) >> 11) * (1.0 / 9007199254740992.0) * total;
    double acc = 0;
    int64_t pick = ids[k - 1];
    for (int64_t j = 0; j < k; ++j) {
      acc += p[j];
      if (u < acc) {
        pick = ids[j];
        break;
      }
    }
    all.push_back(pick);
    out.push_back(pick);
  }
  return out;
}

}  // namespace fairscale::examples::gpt
