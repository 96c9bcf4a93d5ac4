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

#include <ATen/CPUGeneratorImpl.h>

#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "moe/gate.h"

namespace fairscale::examples::gpt {

ExpertMlpImpl::ExpertMlpImpl(int64_t width, int64_t hidden) {
  fc1_ = register_module("fc1", torch::nn::Linear(width, hidden));
  fc2_ = register_module("fc2", torch::nn::Linear(hidden, width));
}

// In the experts' own dtype: under FSDP mixed precision the (ignored) experts stay f32 while the
// tokens arrive in the compute dtype.
torch::Tensor ExpertMlpImpl::forward(torch::Tensor x) {
  const at::ScalarType dtype = x.scalar_type();
  return fc2_(at::gelu(fc1_(x.to(fc1_->weight.scalar_type())))).to(dtype);
}

std::vector<std::shared_ptr<torch::nn::Module>> GptExperts::modules() const {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (const auto& block : per_block) {
    for (const ExpertMlp& e : block) out.push_back(e.ptr());
  }
  return out;
}

GptExperts MakeGptExperts(const GptConfig& config, const comm::Communicator& expert_comm) {
  GptExperts out;
  const int64_t e = config.moe_experts(), n = expert_comm.size();
  if (e <= 0) return out;
  TORCH_CHECK(e % n == 0, "Gpt: moe_experts = ", e,
              " is not divisible by the expert-parallel size ", n,
              " (each rank holds moe_experts / size experts)");
  const int64_t local = e / n, first = expert_comm.rank() * local;
  for (int64_t i = 1; i < config.blocks(); i += 2) {
    std::vector<ExpertMlp> mine;
    for (int64_t k = 0; k < e; ++k) {
      ExpertMlp expert(config.width(), 2 * config.width());  // every rank draws all E
      if (k >= first && k < first + local) mine.push_back(expert);
    }
    out.per_block.push_back(std::move(mine));
  }
  return out;
}

TransformerBlockImpl::TransformerBlockImpl(int64_t width, int64_t heads, moe::MOELayer moe)
    : heads_(heads) {
  TORCH_CHECK(heads > 0 && width % heads == 0, "TransformerBlock: width ", width,
              " is not divisible by heads ", heads);
  ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
  qkv_ = register_module("qkv", torch::nn::Linear(width, 3 * width));
  proj_ = register_module("proj", torch::nn::Linear(width, width));
  ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
  if (!moe.is_empty()) {
    moe_ = register_module("moe", std::move(moe));
    return;
  }
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
  if (!moe_.is_empty()) return x + moe_(ln2_(x));
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

GptImpl::GptImpl(const GptConfig& config, std::shared_ptr<comm::Communicator> expert_comm,
                 GptExperts experts)
    : config_(config), moe_noise_(at::make_generator<at::CPUGeneratorImpl>(0)) {
  TORCH_CHECK(config.vocab() > 0 && config.seq() > 0 && config.blocks() >= 0,
              "Gpt: vocab, seq must be positive and blocks non-negative");
  const bool moe = config.moe_experts() > 0;
  TORCH_CHECK(config.moe_experts() >= 0, "Gpt: moe_experts must be >= 0, got ",
              config.moe_experts());
  TORCH_CHECK(!moe || expert_comm != nullptr, "Gpt: moe_experts = ", config.moe_experts(),
              " needs an expert communicator");
  if (moe && experts.per_block.empty()) experts = MakeGptExperts(config, *expert_comm);
  TORCH_CHECK(static_cast<int64_t>(experts.per_block.size()) == (moe ? config.blocks() / 2 : 0),
              "Gpt: ", experts.per_block.size(), " blocks of experts for ", config.blocks(),
              " blocks (every odd block is MoE)");
  // Construction order = initialization order: embeddings, blocks, head.
  embed_ = fsdp::wrap(Embeddings(config.vocab(), config.seq(), config.width()));
  register_module("embed", embed_.ptr());
  TORCH_CHECK(config.checkpoint_every_k() >= 0, "Gpt: checkpoint_every_k must be >= 0, got ",
              config.checkpoint_every_k());
  for (int64_t i = 0; i < config.blocks(); ++i) {
    moe::MOELayer layer{nullptr};
    if (moe && i % 2 == 1) {
      std::vector<torch::nn::AnyModule> local;
      for (const ExpertMlp& e : experts.per_block[i / 2]) local.emplace_back(e);
      // The gate is drawn before the block's own layers (the same order on every rank).
      layer = moe::MOELayer(
          moe::Top2Gate(moe::Top2GateOptions(config.width(), config.moe_experts())
                            .capacity_factor(config.moe_capacity_factor())
                            .generator(moe_noise_)),
          std::move(local), expert_comm);
      moe_layers_.push_back(layer);
    }
    TransformerBlock block(config.width(), config.heads(), layer);
    const int64_t k = config.checkpoint_every_k();
    blocks_.push_back(k > 0 && i % k == 0 ? fsdp::wrap(checkpoint::CheckpointWrapper(block))
                                          : fsdp::wrap(block));
    register_module("block" + std::to_string(i), blocks_.back().ptr());
  }
  lm_head_ = fsdp::wrap(LmHead(config.width(), config.vocab()));
  register_module("lm_head", lm_head_.ptr());
}

at::Tensor GptImpl::aux_loss() const {
  at::Tensor total;
  for (const moe::MOELayer& layer : moe_layers_) {
    if (!layer->l_aux().defined()) continue;
    total = total.defined() ? total + layer->l_aux() : layer->l_aux();
  }
  return total;
}

void GptImpl::seed_moe_noise(uint64_t seed) { moe_noise_.set_current_seed(seed); }

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
