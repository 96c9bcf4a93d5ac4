#include "model_parallel/layers.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <ostream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "autograd_comm/collectives.h"
#include "base/torch_error.h"

namespace fairscale::model_parallel {
namespace {

namespace ac = ::fairscale::autograd_comm;

// "model_parallel::ColumnParallelLinear rank 1/4"
std::string Context(absl::string_view layer, const comm::Communicator& comm) {
  return absl::StrCat("model_parallel::", layer, " rank ", comm.rank(), "/", comm.size());
}

void Fail(const std::string& context, const std::string& message) {
  base::ThrowIfError(absl::InvalidArgumentError(message), context);
}

std::string Shape(const at::Tensor& t) {
  return t.defined() ? absl::StrCat("[", absl::StrJoin(t.sizes(), ", "), "]") : "(undefined)";
}

comm::Communicator& CheckComm(const std::shared_ptr<comm::Communicator>& comm, const char* layer) {
  if (comm == nullptr) {
    Fail(absl::StrCat("model_parallel::", layer),
         "the communicator (tensor-parallel group) is null");
  }
  return *comm;
}

void CheckPositive(const std::string& context, const char* option, int64_t size) {
  if (size <= 0) Fail(context, absl::StrCat(option, " = ", size, " must be positive"));
}

void CheckDivisible(const std::string& context, const char* option, int64_t size, int world) {
  if (size % world != 0) {
    Fail(context, absl::StrCat(option, " = ", size,
                               " is not divisible by the tensor-parallel size ", world));
  }
}

void CheckShape(const std::string& context, const char* name, const at::Tensor& t,
                at::IntArrayRef want) {
  if (!t.defined() || t.sizes() != want) {
    Fail(context, absl::StrCat("full ", name, " has shape ", Shape(t), ", want [",
                               absl::StrJoin(want, ", "), "]"));
  }
}

// Copies `src` into the parameter `dst` without recording it.
void CopyInto(at::Tensor& dst, const at::Tensor& src) {
  c10::NoGradGuard no_grad;
  dst.copy_(src);
}

// Every rank's `t` concatenated along `dim` (no autograd).
at::Tensor Gather(const at::Tensor& t, int64_t dim, comm::Communicator& comm) {
  c10::NoGradGuard no_grad;
  at::Tensor full = ac::gather_from_parallel_region(t.detach(), comm, dim);
  return comm.size() == 1 ? full.clone() : full;
}

at::Generator MakeGenerator(uint64_t seed) {
  return at::make_generator<at::CPUGeneratorImpl>(seed);
}

const at::Tensor& Get(const TensorDict& full, const std::string& key, const std::string& context) {
  const at::Tensor* t = full.find(key);
  if (t == nullptr) Fail(context, absl::StrCat("full state dict has no '", key, "'"));
  return *t;
}

void CheckKeys(const TensorDict& full, const std::set<std::string>& allowed,
               const std::string& context) {
  for (const auto& item : full) {
    if (allowed.count(item.key()) == 0) {
      Fail(context, absl::StrCat("unexpected key '", item.key(), "' in the full state dict"));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// What ColumnParallelLinear and RowParallelLinear share: the full (dense-twin) weight [out, in]
// and bias [out] in and out. The two differ only in the split: the weight along `weight_dim`
// (0: the output features, column; 1: the input features, row), the bias along dim 0 with it
// (column) or replicated (row).

struct LinearShards {
  const char* layer;  // "ColumnParallelLinear", for error contexts
  int64_t weight_dim;
  int64_t in_features;
  int64_t out_features;
  bool has_bias;
  at::Tensor& weight;  // this rank's shard
  at::Tensor& bias;    // this rank's shard (column) or the whole bias (row)
  comm::Communicator& comm;

  bool bias_split() const { return weight_dim == 0; }
};

void LoadFullLinear(const LinearShards& p, const at::Tensor& full_weight,
                    const at::Tensor& full_bias) {
  const std::string context = Context(absl::StrCat(p.layer, "::load_full"), p.comm);
  CheckShape(context, "weight", full_weight, {p.out_features, p.in_features});
  if (p.has_bias) CheckShape(context, "bias", full_bias, {p.out_features});
  if (!p.has_bias && full_bias.defined()) Fail(context, "the layer has no bias");
  const int64_t n = full_weight.size(p.weight_dim) / p.comm.size();
  CopyInto(p.weight, full_weight.narrow(p.weight_dim, p.comm.rank() * n, n));
  if (!p.has_bias) return;
  const int64_t m = p.out_features / p.comm.size();
  CopyInto(p.bias, p.bias_split() ? full_bias.narrow(0, p.comm.rank() * m, m) : full_bias);
}

at::Tensor FullLinearBias(const LinearShards& p) {
  if (!p.has_bias) return at::Tensor();
  return p.bias_split() ? Gather(p.bias, 0, p.comm) : p.bias.detach().clone();
}

TensorDict FullLinearStateDict(const LinearShards& p) {
  TensorDict d;
  d.insert("weight", Gather(p.weight, p.weight_dim, p.comm));
  if (p.has_bias) d.insert("bias", FullLinearBias(p));
  return d;
}

void LoadFullLinearStateDict(const LinearShards& p, const TensorDict& full) {
  const std::string context = Context(absl::StrCat(p.layer, "::load_full_state_dict"), p.comm);
  CheckKeys(full,
            p.has_bias ? std::set<std::string>{"weight", "bias"} : std::set<std::string>{"weight"},
            context);
  LoadFullLinear(p, Get(full, "weight", context),
                 p.has_bias ? Get(full, "bias", context) : at::Tensor());
}

LinearShards Shards(ColumnParallelLinearImpl& l) {
  const ColumnParallelLinearOptions& o = l.options();
  return {"ColumnParallelLinear", 0, o.in_features(), o.out_features(), o.bias(), l.weight, l.bias,
          l.communicator()};
}

LinearShards Shards(RowParallelLinearImpl& l) {
  const RowParallelLinearOptions& o = l.options();
  return {"RowParallelLinear", 1, o.in_features(), o.out_features(), o.bias(), l.weight, l.bias,
          l.communicator()};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// ColumnParallelLinear

ColumnParallelLinearImpl::ColumnParallelLinearImpl(ColumnParallelLinearOptions options,
                                                   std::shared_ptr<comm::Communicator> comm)
    : options_(std::move(options)), comm_(std::move(comm)) {
  const comm::Communicator& c = CheckComm(comm_, "ColumnParallelLinear");
  const std::string context = Context("ColumnParallelLinear", c);
  CheckPositive(context, "in_features", options_.in_features());
  CheckPositive(context, "out_features", options_.out_features());
  CheckDivisible(context, "out_features", options_.out_features(), c.size());
  if (options_.sequence_parallel() && options_.gather_output()) {
    Fail(context,
         "sequence_parallel(true) is incompatible with gather_output(true): a sequence-parallel "
         "column layer leaves its output split along the features for a following "
         "RowParallelLinear(sequence_parallel, input_is_parallel); set gather_output(false)");
  }
  const int64_t in = options_.in_features(), out = options_.out_features();
  const int64_t rows = out / c.size(), start = c.rank() * rows;
  // The full master weight, identical on every rank and at every T (header: Initialization).
  at::Generator gen = MakeGenerator(options_.init_seed());
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  at::Tensor w = at::empty({out, in}, at::kFloat).uniform_(-bound, bound, gen);
  weight = register_parameter("weight", w.narrow(0, start, rows).clone());
  if (options_.bias()) {
    at::Tensor b = at::empty({out}, at::kFloat).uniform_(-bound, bound, gen);
    bias = register_parameter("bias", b.narrow(0, start, rows).clone());
  }
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& input) {
  // Sequence parallel: the full sequence is assembled here (the backward reduce-scatters the
  // input gradient, each rank's partial sum over its output features, back to the chunks).
  const at::Tensor x =
      options_.sequence_parallel()
          ? ac::gather_from_sequence_parallel_region(input, *comm_,
                                                     /*tensor_parallel_output_grad=*/true)
          : ac::copy_to_parallel_region(input, *comm_);
  at::Tensor y = at::linear(x, weight, bias);
  return options_.gather_output() ? ac::gather_from_parallel_region(y, *comm_, -1) : y;
}

void ColumnParallelLinearImpl::load_full(const at::Tensor& full_weight,
                                         const at::Tensor& full_bias) {
  LoadFullLinear(Shards(*this), full_weight, full_bias);
}

at::Tensor ColumnParallelLinearImpl::full_weight() { return Gather(weight, 0, *comm_); }

at::Tensor ColumnParallelLinearImpl::full_bias() { return FullLinearBias(Shards(*this)); }

TensorDict ColumnParallelLinearImpl::full_state_dict() {
  return FullLinearStateDict(Shards(*this));
}

void ColumnParallelLinearImpl::load_full_state_dict(const TensorDict& full) {
  LoadFullLinearStateDict(Shards(*this), full);
}

void ColumnParallelLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "fairscale::model_parallel::ColumnParallelLinear(in_features=" << options_.in_features()
         << ", out_features=" << options_.out_features()
         << ", bias=" << (options_.bias() ? "true" : "false")
         << ", gather_output=" << (options_.gather_output() ? "true" : "false")
         << (options_.sequence_parallel() ? ", sequence_parallel=true" : "")
         << ", tp=" << comm_->size() << ")";
}

// ---------------------------------------------------------------------------------------------
// RowParallelLinear

RowParallelLinearImpl::RowParallelLinearImpl(RowParallelLinearOptions options,
                                             std::shared_ptr<comm::Communicator> comm)
    : options_(std::move(options)), comm_(std::move(comm)) {
  const comm::Communicator& c = CheckComm(comm_, "RowParallelLinear");
  const std::string context = Context("RowParallelLinear", c);
  CheckPositive(context, "in_features", options_.in_features());
  CheckPositive(context, "out_features", options_.out_features());
  CheckDivisible(context, "in_features", options_.in_features(), c.size());
  if (options_.sequence_parallel() && !options_.input_is_parallel()) {
    Fail(context,
         "sequence_parallel(true) requires input_is_parallel(true): the input must be the "
         "feature-split output of a ColumnParallelLinear(sequence_parallel, gather_output false)");
  }
  const int64_t in = options_.in_features(), out = options_.out_features();
  const int64_t cols = in / c.size(), start = c.rank() * cols;
  at::Generator gen = MakeGenerator(options_.init_seed());
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  at::Tensor w = at::empty({out, in}, at::kFloat).uniform_(-bound, bound, gen);
  weight = register_parameter("weight", w.narrow(1, start, cols).clone());
  if (options_.bias()) {
    bias = register_parameter("bias", at::empty({out}, at::kFloat).uniform_(-bound, bound, gen));
  }
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& input) {
  const at::Tensor x =
      options_.input_is_parallel() ? input : ac::scatter_to_parallel_region(input, *comm_, -1);
  at::Tensor y;
  if (options_.sequence_parallel()) {
    // Each rank keeps the sum over the group of its chunk of the sequence (dim 0); the bias is
    // added to the chunk, so its gradient covers this rank's tokens only (sequence_parallel.h).
    if (x.dim() == 0 || x.size(0) % comm_->size() != 0) {
      Fail(Context("RowParallelLinear::forward", *comm_),
           absl::StrCat("sequence_parallel: the sequence length (dim 0 of the input ", Shape(x),
                        ") = ", x.dim() == 0 ? 0 : x.size(0),
                        " is not divisible by the tensor-parallel size ", comm_->size()));
    }
    y = ac::reduce_scatter_to_sequence_parallel_region(at::linear(x, weight), *comm_);
  } else {
    y = ac::reduce_from_parallel_region(at::linear(x, weight), *comm_);
  }
  return options_.bias() ? y + bias : y;
}

void RowParallelLinearImpl::load_full(const at::Tensor& full_weight, const at::Tensor& full_bias) {
  LoadFullLinear(Shards(*this), full_weight, full_bias);
}

at::Tensor RowParallelLinearImpl::full_weight() { return Gather(weight, 1, *comm_); }

at::Tensor RowParallelLinearImpl::full_bias() { return FullLinearBias(Shards(*this)); }

TensorDict RowParallelLinearImpl::full_state_dict() { return FullLinearStateDict(Shards(*this)); }

void RowParallelLinearImpl::load_full_state_dict(const TensorDict& full) {
  LoadFullLinearStateDict(Shards(*this), full);
}

void RowParallelLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "fairscale::model_parallel::RowParallelLinear(in_features=" << options_.in_features()
         << ", out_features=" << options_.out_features()
         << ", bias=" << (options_.bias() ? "true" : "false")
         << ", input_is_parallel=" << (options_.input_is_parallel() ? "true" : "false")
         << (options_.sequence_parallel() ? ", sequence_parallel=true" : "")
         << ", tp=" << comm_->size() << ")";
}

// ---------------------------------------------------------------------------------------------
// VocabParallelEmbedding

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(VocabParallelEmbeddingOptions options,
                                                       std::shared_ptr<comm::Communicator> comm)
    : options_(std::move(options)), comm_(std::move(comm)) {
  const comm::Communicator& c = CheckComm(comm_, "VocabParallelEmbedding");
  const std::string context = Context("VocabParallelEmbedding", c);
  CheckPositive(context, "num_embeddings", options_.num_embeddings());
  CheckPositive(context, "embedding_dim", options_.embedding_dim());
  CheckDivisible(context, "num_embeddings", options_.num_embeddings(), c.size());
  const int64_t v = options_.num_embeddings(), rows = v / c.size();
  vocab_start_ = c.rank() * rows;
  vocab_end_ = vocab_start_ + rows;
  at::Generator gen = MakeGenerator(options_.init_seed());
  at::Tensor w = at::empty({v, options_.embedding_dim()}, at::kFloat).normal_(0.0, 1.0, gen);
  weight = register_parameter("weight", w.narrow(0, vocab_start_, rows).clone());
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& tokens) {
  if (comm_->size() == 1) return at::embedding(weight, tokens);
  // Tokens another rank owns look up row 0 and are zeroed: the all-reduce then adds exactly one
  // rank's row for every token (Megatron's input_mask).
  const at::Tensor outside = at::logical_or(tokens < vocab_start_, tokens >= vocab_end_);
  const at::Tensor local = (tokens - vocab_start_).masked_fill(outside, 0);
  const at::Tensor rows = at::embedding(weight, local).masked_fill(outside.unsqueeze(-1), 0.0);
  return ac::reduce_from_parallel_region(rows, *comm_);
}

void VocabParallelEmbeddingImpl::load_full(const at::Tensor& full_weight) {
  const std::string context = Context("VocabParallelEmbedding::load_full", *comm_);
  CheckShape(context, "weight", full_weight, {options_.num_embeddings(), options_.embedding_dim()});
  CopyInto(weight, full_weight.narrow(0, vocab_start_, vocab_end_ - vocab_start_));
}

at::Tensor VocabParallelEmbeddingImpl::full_weight() { return Gather(weight, 0, *comm_); }

TensorDict VocabParallelEmbeddingImpl::full_state_dict() {
  TensorDict d;
  d.insert("weight", full_weight());
  return d;
}

void VocabParallelEmbeddingImpl::load_full_state_dict(const TensorDict& full) {
  const std::string context = Context("VocabParallelEmbedding::load_full_state_dict", *comm_);
  CheckKeys(full, {"weight"}, context);
  load_full(Get(full, "weight", context));
}

void VocabParallelEmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << "fairscale::model_parallel::VocabParallelEmbedding(num_embeddings="
         << options_.num_embeddings() << ", embedding_dim=" << options_.embedding_dim()
         << ", tp=" << comm_->size() << ")";
}

// ---------------------------------------------------------------------------------------------
// Whole-model full state dicts

namespace {

std::string Join(const std::string& prefix, const std::string& key) {
  return prefix.empty() ? key : absl::StrCat(prefix, ".", key);
}

// Every TensorParallelModule in `model` (itself included) with its name, in module order.
std::vector<std::pair<std::string, TensorParallelModule*>> ParallelModules(
    torch::nn::Module& model) {
  std::vector<std::pair<std::string, TensorParallelModule*>> found;
  if (auto* tp = dynamic_cast<TensorParallelModule*>(&model)) found.emplace_back("", tp);
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (auto* tp = dynamic_cast<TensorParallelModule*>(item.value().get())) {
      found.emplace_back(item.key(), tp);
    }
  }
  return found;
}

}  // namespace

TensorDict full_state_dict(torch::nn::Module& model) {
  TensorDict out;
  for (const auto& p : model.named_parameters(true))
    out.insert(p.key(), p.value().detach().clone());
  for (const auto& b : model.named_buffers(true)) out.insert(b.key(), b.value().detach().clone());
  for (const auto& [prefix, tp] : ParallelModules(model)) {
    for (const auto& item : tp->full_state_dict()) out[Join(prefix, item.key())] = item.value();
  }
  return out;
}

void load_full_state_dict(torch::nn::Module& model, const TensorDict& full) {
  const std::string context = "model_parallel::load_full_state_dict";
  std::set<std::string> used;
  for (const auto& [prefix, tp] : ParallelModules(model)) {
    // The keys under this layer's prefix that name its own parameters (no dots after it).
    TensorDict mine;
    const std::string dotted = prefix.empty() ? "" : prefix + ".";
    for (const auto& item : full) {
      const std::string& key = item.key();
      if (key.compare(0, dotted.size(), dotted) != 0) continue;
      const std::string rest = key.substr(dotted.size());
      if (rest.find('.') != std::string::npos) continue;
      mine.insert(rest, item.value());
      used.insert(key);
    }
    try {
      tp->load_full_state_dict(mine);
    } catch (const c10::Error& e) {
      Fail(context, absl::StrCat("layer '", prefix, "': ", e.what_without_backtrace()));
    }
  }
  auto copy_whole = [&](const std::string& key, at::Tensor& dst) {
    if (used.count(key) != 0) return;  // a tensor-parallel layer's
    const at::Tensor& src = Get(full, key, context);
    if (src.sizes() != dst.sizes()) {
      Fail(context, absl::StrCat("'", key, "' has shape ", Shape(src), ", want ", Shape(dst)));
    }
    CopyInto(dst, src);
    used.insert(key);
  };
  for (auto& p : model.named_parameters(true)) copy_whole(p.key(), p.value());
  for (auto& b : model.named_buffers(true)) copy_whole(b.key(), b.value());
  for (const auto& item : full) {
    if (used.count(item.key()) == 0) {
      Fail(context, absl::StrCat("unexpected key '", item.key(), "' in the full state dict"));
    }
  }
}

}  // namespace fairscale::model_parallel
