#include "examples/gpt/tp_model.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/softmax.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "autograd_comm/collectives.h"
#include "base/torch_error.h"
#include "model_parallel/cross_entropy.h"

namespace fairscale::examples::gpt {
namespace {

namespace mp = ::fairscale::model_parallel;

std::string Context(const comm::Communicator& comm) {
  return absl::StrCat("examples::gpt::TpGpt rank ", comm.rank(), "/", comm.size());
}

void Fail(const std::string& context, const std::string& message) {
  base::ThrowIfError(absl::InvalidArgumentError(message), context);
}

// Seeds of the layers' full master weights: distinct per layer, the same on every rank.
uint64_t LayerSeed(uint64_t init_seed, int64_t index) {
  return init_seed * 1000003ULL + static_cast<uint64_t>(index);
}

bool IsQkv(const std::string& key) {
  const std::string w = ".qkv.weight", b = ".qkv.bias";
  auto ends_with = [&](const std::string& s) {
    return key.size() >= s.size() && key.compare(key.size() - s.size(), s.size(), s) == 0;
  };
  return ends_with(w) || ends_with(b);
}

}  // namespace

at::Tensor qkv_to_rank_major(const at::Tensor& dense, int64_t tp_size) {
  TORCH_CHECK(dense.dim() >= 1 && dense.size(0) % (3 * tp_size) == 0, "qkv_to_rank_major: dim 0 (",
              dense.dim() >= 1 ? dense.size(0) : 0,
              ") is not 3 * C with C divisible by T = ", tp_size);
  std::vector<int64_t> shape = {3, tp_size, dense.size(0) / (3 * tp_size)};
  for (int64_t i = 1; i < dense.dim(); ++i) shape.push_back(dense.size(i));
  return dense.reshape(shape).transpose(0, 1).reshape(dense.sizes());
}

at::Tensor qkv_to_dense(const at::Tensor& rank_major, int64_t tp_size) {
  TORCH_CHECK(rank_major.dim() >= 1 && rank_major.size(0) % (3 * tp_size) == 0,
              "qkv_to_dense: dim 0 (", rank_major.dim() >= 1 ? rank_major.size(0) : 0,
              ") is not 3 * C with C divisible by T = ", tp_size);
  std::vector<int64_t> shape = {tp_size, 3, rank_major.size(0) / (3 * tp_size)};
  for (int64_t i = 1; i < rank_major.dim(); ++i) shape.push_back(rank_major.size(i));
  return rank_major.reshape(shape).transpose(0, 1).reshape(rank_major.sizes());
}

TpTransformerBlockImpl::TpTransformerBlockImpl(int64_t width, int64_t heads,
                                               std::shared_ptr<comm::Communicator> comm,
                                               uint64_t init_seed) {
  const int64_t t = comm->size();
  local_heads_ = heads / t;
  ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
  qkv_ = register_module("qkv",
                         mp::ColumnParallelLinear(mp::ColumnParallelLinearOptions(width, 3 * width)
                                                      .gather_output(false)
                                                      .init_seed(LayerSeed(init_seed, 0)),
                                                  comm));
  proj_ = register_module("proj", mp::RowParallelLinear(mp::RowParallelLinearOptions(width, width)
                                                            .input_is_parallel(true)
                                                            .init_seed(LayerSeed(init_seed, 1)),
                                                        comm));
  ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
  fc1_ = register_module("fc1",
                         mp::ColumnParallelLinear(mp::ColumnParallelLinearOptions(width, 4 * width)
                                                      .gather_output(false)
                                                      .init_seed(LayerSeed(init_seed, 2)),
                                                  comm));
  fc2_ = register_module("fc2", mp::RowParallelLinear(mp::RowParallelLinearOptions(4 * width, width)
                                                          .input_is_parallel(true)
                                                          .init_seed(LayerSeed(init_seed, 3)),
                                                      comm));
  // The qkv master is drawn here in the dense layout (as torch::nn::Linear: uniform
  // +-1/sqrt(in), from a private generator) and reordered, so that the full model does not
  // depend on T; the layer's own seeded draw is replaced. Local: no collective.
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(LayerSeed(init_seed, 4));
  const double bound = 1.0 / std::sqrt(static_cast<double>(width));
  at::Tensor w = at::empty({3 * width, width}).uniform_(-bound, bound, gen);
  at::Tensor bias = at::empty({3 * width}).uniform_(-bound, bound, gen);
  qkv_->load_full(qkv_to_rank_major(w, t), qkv_to_rank_major(bias, t));
}

torch::Tensor TpTransformerBlockImpl::forward(torch::Tensor x) {
  const int64_t b = x.size(0), t = x.size(1);
  // Local: [b, t, 3 * C/T] = [Q of my heads; K; V] (rank-major layout).
  std::vector<at::Tensor> qkv = qkv_(ln1_(x)).chunk(3, -1);
  const int64_t local_width = qkv[0].size(-1), d = local_width / local_heads_;
  auto split = [&](const at::Tensor& z) {
    return z.reshape({b, t, local_heads_, d}).transpose(1, 2);
  };
  at::Tensor att = at::matmul(split(qkv[0]), split(qkv[1]).transpose(-2, -1)) /
                   std::sqrt(static_cast<double>(d));
  at::Tensor future = at::ones({t, t}, x.options().dtype(at::kBool)).triu(1);
  att = at::softmax(att.masked_fill(future, -INFINITY), -1);
  at::Tensor y = at::matmul(att, split(qkv[2])).transpose(1, 2).reshape({b, t, local_width});
  x = x + proj_(y);
  return x + fc2_(at::gelu(fc1_(ln2_(x))));
}

TpGptImpl::TpGptImpl(const GptConfig& config, std::shared_ptr<comm::Communicator> comm,
                     uint64_t init_seed)
    : config_(config), comm_(std::move(comm)) {
  if (comm_ == nullptr) Fail("examples::gpt::TpGpt", "the communicator is null");
  const std::string context = Context(*comm_);
  const int64_t tp = comm_->size();
  if (config.vocab() <= 0 || config.seq() <= 0 || config.blocks() < 0 || config.heads() <= 0 ||
      config.width() % config.heads() != 0) {
    Fail(context,
         absl::StrCat("bad config: vocab = ", config.vocab(), ", seq = ", config.seq(),
                      ", blocks = ", config.blocks(), ", width = ", config.width(),
                      ", heads = ", config.heads(), " (positive, width divisible by heads)"));
  }
  if (config.vocab() % tp != 0) {
    Fail(context, absl::StrCat("vocab = ", config.vocab(),
                               " is not divisible by the tensor-parallel size ", tp));
  }
  if (config.heads() % tp != 0) {
    Fail(context, absl::StrCat("heads = ", config.heads(),
                               " is not divisible by the tensor-parallel size ", tp));
  }
  if (config.checkpoint_every_k() != 0) {
    Fail(context, absl::StrCat("checkpoint_every_k = ", config.checkpoint_every_k(),
                               ": activation checkpointing is not supported by TpGpt"));
  }
  const int64_t c = config.width();
  // Seeds as before the split into modules, so a given init_seed gives the same model.
  embed_ = register_module(
      "embed", TpEmbeddings(config.vocab(), config.seq(), c, comm_, init_seed));
  for (int64_t i = 0; i < config.blocks(); ++i) {
    blocks_.push_back(fsdp::wrap(
        TpTransformerBlock(c, config.heads(), comm_, LayerSeed(init_seed, 100 * (i + 1)))));
    register_module("block" + std::to_string(i), blocks_.back().ptr());
  }
  lm_head_ = register_module("lm_head", TpLmHead(c, config.vocab(), comm_, init_seed));
}

TpEmbeddingsImpl::TpEmbeddingsImpl(int64_t vocab, int64_t seq, int64_t width,
                                   std::shared_ptr<comm::Communicator> comm, uint64_t init_seed) {
  tok_ = register_module(
      "tok", mp::VocabParallelEmbedding(
                 mp::VocabParallelEmbeddingOptions(vocab, width).init_seed(LayerSeed(init_seed, 0)),
                 std::move(comm)));
  // Replicated: drawn from a private generator (torch::nn::Embedding would use the global one).
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(LayerSeed(init_seed, 1));
  pos_ = register_module(
      "pos", torch::nn::Embedding(
                 torch::nn::EmbeddingOptions(seq, width)._weight(at::randn({seq, width}, gen))));
}

torch::Tensor TpEmbeddingsImpl::forward(torch::Tensor tokens) {
  return tok_(tokens) + pos_(at::arange(tokens.size(1), tokens.options()));
}

TpLmHeadImpl::TpLmHeadImpl(int64_t width, int64_t vocab, std::shared_ptr<comm::Communicator> comm,
                           uint64_t init_seed) {
  ln_f_ = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
  head_ = register_module(
      "head", mp::ColumnParallelLinear(mp::ColumnParallelLinearOptions(width, vocab)
                                           .gather_output(false)
                                           .init_seed(LayerSeed(init_seed, 2)),
                                       std::move(comm)));
}

torch::Tensor TpLmHeadImpl::forward(torch::Tensor x) { return head_(ln_f_(x)); }

torch::Tensor TpGptImpl::parallel_logits(torch::Tensor tokens) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(1) <= config_.seq(),
              "TpGpt: tokens must be [batch, t] with t <= ", config_.seq(), ", got ",
              tokens.sizes());
  at::Tensor x = embed_(tokens);
  for (auto& block : blocks_) x = block(x);
  return lm_head_(x);
}

torch::Tensor TpGptImpl::forward(torch::Tensor tokens) {
  return autograd_comm::gather_from_parallel_region(parallel_logits(tokens), *comm_, -1);
}

torch::Tensor TpGptImpl::loss(torch::Tensor tokens, torch::Tensor targets) {
  return mp::vocab_parallel_cross_entropy(parallel_logits(tokens), targets, *comm_);
}

bool TpGptImpl::is_split(const std::string& name) {
  static const char* const kSplit[] = {"tok.weight", "qkv.weight", "qkv.bias",  "fc1.weight",
                                       "fc1.bias",   "proj.weight", "fc2.weight", "head.weight",
                                       "head.bias"};
  for (const char* suffix : kSplit) {
    const std::string s = std::string(".") + suffix;
    if (name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0) {
      return true;
    }
  }
  return false;
}

void TpGptImpl::load_dense_state_dict(const mp::TensorDict& dense) {
  mp::TensorDict reordered;
  for (const auto& item : dense) {
    reordered.insert(item.key(), IsQkv(item.key()) ? qkv_to_rank_major(item.value(), comm_->size())
                                                   : item.value());
  }
  mp::load_full_state_dict(*this, reordered);
}

mp::TensorDict TpGptImpl::full_state_dict() {
  mp::TensorDict full = mp::full_state_dict(*this);
  for (auto& item : full) {
    if (IsQkv(item.key())) item.value() = qkv_to_dense(item.value(), comm_->size()).contiguous();
  }
  return full;
}

}  // namespace fairscale::examples::gpt
