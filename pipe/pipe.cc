#include "pipe/pipe.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/narrow.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <map>
#include <numeric>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/torch_error.h"
#include "checkpoint/checkpoint.h"
#include "comm/torch/tensor_buffer.h"
#include "deterministic/mode.h"
#include "deterministic/tree.h"
#include "pipe/internal/skip_layout.h"
#include "pipe/internal/wire.h"
#include "pipe/skip.h"

namespace fairscale::pipe {

StageImpl::StageImpl(torch::nn::Sequential layers, int64_t first_layer,
                     std::vector<SkipId> skips_in, std::vector<SkipId> skips_out)
    : torch::nn::Module("fairscale::pipe::Stage"),
      layers_(std::move(layers)),
      first_layer_(first_layer),
      skips_in_(std::move(skips_in)),
      skips_out_(std::move(skips_out)) {
  // Registered under their own names, so that parameter names are the full model's ("3.weight").
  for (const auto& item : layers_->named_children()) {
    register_module(item.key(), item.value());
    names_.push_back(item.key());
    skippables_.push_back(dynamic_cast<Skippable*>(item.value().get()));
  }
}

std::vector<at::Tensor> StageImpl::forward(std::vector<at::Tensor> inputs, bool list_input) {
  const size_t skips = skips_in_.size();
  TORCH_CHECK(inputs.size() >= skips + (list_input ? 0 : 1), "the stage of layers from ",
              first_layer_, " got ", inputs.size(), " input tensors, expected ",
              list_input ? "at least " : "", skips + (list_input ? 0 : 1), " (", skips,
              " of them skip tensors)");
  // This micro-batch's skips wait here: the incoming ones, then what the layers stash.
  SkipTracker tracker;
  const size_t boundary = inputs.size() - skips;
  for (size_t k = 0; k < skips; ++k) tracker.save(skips_in_[k], std::move(inputs[boundary + k]));
  inputs.resize(boundary);
  SkipTrackerScope scope(&tracker);
  torch::nn::AnyValue v = list_input ? torch::nn::AnyValue(std::move(inputs))
                                     : torch::nn::AnyValue(std::move(inputs.at(0)));
  for (size_t l = 0; l < layers_->size(); ++l) {
    if (skippables_[l] != nullptr) tracker.BeginLayer(*skippables_[l], names_[l]);
    v = (*(layers_->begin() + l)).any_forward(std::move(v));
    if (skippables_[l] != nullptr) tracker.EndLayer();
  }
  std::vector<at::Tensor> out;
  if (const at::Tensor* t = v.try_get<at::Tensor>()) {
    output_is_list_ = false;
    out = {*t};
  } else if (const std::vector<at::Tensor>* l = v.try_get<std::vector<at::Tensor>>()) {
    output_is_list_ = true;
    out = *l;
  } else {
    TORCH_CHECK(false, "layer ", first_layer_ + static_cast<int64_t>(layers_->size()) - 1,
                " returned a value of type ", v.type_info().name(),
                "; stages exchange at::Tensor or std::vector<at::Tensor>");
  }
  for (const SkipId& id : skips_out_) {
    TORCH_CHECK(tracker.contains(id), "skip ", DescribeSkip(id),
                " should leave the stage of layers from ", first_layer_,
                " for a later stage but nothing is stashed under it");
    out.push_back(tracker.load(id));
  }
  if (tracker.size() > 0) {
    std::vector<std::string> left;
    for (const SkipId& id : tracker.ids()) left.push_back(DescribeSkip(id));
    TORCH_CHECK(false, "the stage of layers from ", first_layer_, " stashed ",
                absl::StrJoin(left, ", "),
                " but no later layer pops it (only Skippable layers of the Sequential itself are "
                "declared to the pipe)");
  }
  return out;
}

const char* CheckpointModeName(CheckpointMode mode) {
  switch (mode) {
    case CheckpointMode::kAlways:
      return "always";
    case CheckpointMode::kExceptLast:
      return "except_last";
    case CheckpointMode::kNever:
      return "never";
  }
  return "unknown";
}

namespace internal {

struct MicroBatch {
  std::vector<at::Tensor> inputs;   // received leaves (or stage 0's rows of the batch)
  std::vector<at::Tensor> outputs;  // sent to the next stage
  at::Tensor loss;                  // last stage
};

struct StepState {
  int64_t chunks = 1;
  std::vector<Boundary> first_inputs;  // stage 0: the micro-batches of the input
  std::vector<at::Tensor> targets;     // last stage
  const LossFn* loss_fn = nullptr;
  std::vector<MicroBatch> micro;       // [chunk * chunks + micro-batch]
  // One rank with several chunks: what chunk j hands to chunk j + 1 (activations) and back
  // (gradients) without a communicator, keyed by the receiving virtual stage and micro-batch.
  std::map<std::pair<int64_t, int64_t>, Boundary> local_activations;
  std::map<std::pair<int64_t, int64_t>, std::vector<at::Tensor>> local_gradients;
  double loss_sum = 0;
  std::vector<double> losses;  // per micro-batch, on the last stage (deterministic mode)
  c10::ScalarType loss_dtype = c10::ScalarType::Float;
  bool train = true;  // false: forwards only, no graph kept (eval_step)
  explicit StepState(Orphans* orphans) : pending(orphans) {}
  PendingSends pending;
};

}  // namespace internal

// This rank's ends of the links to its neighbours: two-rank communicators on which it only
// sends (activations to the next rank, gradients to the previous) or only receives.
struct Pipe::Links {
  std::vector<std::shared_ptr<comm::Communicator>> all;  // every link communicator, for Abort
  std::optional<internal::ActivationLink> from_prev;
  std::optional<internal::ActivationLink> to_next;
  std::shared_ptr<comm::Communicator> grads_from_next;  // peer 1 in it
  std::shared_ptr<comm::Communicator> grads_to_prev;    // peer 0 in it
};

namespace {

using internal::Boundary;
using internal::Orphans;

// "pipe::Pipe::Create (rank 1/4)": the context of the c10::Error Create and CreateForStage raise.
std::string Where(const char* function, const comm::Communicator* comm) {
  return comm ? absl::StrCat(function, " (rank ", comm->rank(), "/", comm->size(), ")") : function;
}

// An exception's message without c10's backtrace (it travels to the other stages).
std::string WhatOf(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    return c10_error->what_without_backtrace();
  }
  return e.what();
}

absl::Status Annotate(const absl::Status& s, const std::string& context) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(context, ": ", s.message()));
}

// Rows [offset, offset + size) of micro-batch `i` of `m` over `n` rows (torch.tensor_split).
std::pair<int64_t, int64_t> ChunkRows(int64_t n, int64_t m, int64_t i) {
  const int64_t base = n / m;
  const int64_t extra = n % m;
  return {i * base + std::min(i, extra), base + (i < extra ? 1 : 0)};
}

absl::StatusOr<std::vector<at::Tensor>> SplitRows(const at::Tensor& t, int64_t m,
                                                  const std::string& what) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(what, " is undefined"));
  if (t.dim() == 0 || t.size(0) < m) {
    return absl::InvalidArgumentError(absl::StrCat(what, " has ", t.dim() == 0 ? 0 : t.size(0),
                                                   " rows, fewer than chunks = ", m));
  }
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < m; ++i) {
    auto [offset, size] = ChunkRows(t.size(0), m, i);
    out.push_back(t.narrow(0, offset, size).detach());
  }
  return out;
}

std::vector<at::Tensor> RequiringGrad(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : ts) {
    if (t.defined() && t.requires_grad()) out.push_back(t);
  }
  return out;
}

std::vector<internal::TensorLayout> Layouts(const std::vector<at::Tensor>& ts) {
  std::vector<internal::TensorLayout> out;
  for (const at::Tensor& t : ts) out.push_back({t.scalar_type(), true, t.sizes().vec()});
  return out;
}

// Every rank's skip declarations (each rank contributes its own chunks' Skippable layers), in
// model order: two all-gathers over `comm` (the lengths, then the padded encodings).
absl::StatusOr<std::vector<internal::LayerSkips>> GatherSkipDeclarations(
    comm::Communicator& comm, const std::vector<internal::LayerSkips>& mine,
    absl::Duration timeout) {
  const std::string encoded = internal::EncodeDeclarations(mine);
  if (static_cast<int64_t>(encoded.size()) > internal::kMaxDeclarationBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("this rank's skip declarations take ", encoded.size(), " bytes, more than ",
                     internal::kMaxDeclarationBytes));
  }
  const int64_t p = comm.size();
  comm::OpOptions op;
  op.timeout = timeout;
  auto all_gather = [&](const at::Tensor& send, const at::Tensor& recv) -> absl::Status {
    absl::StatusOr<comm::ConstBuffer> in = comm::ToConstBuffer(send);
    if (!in.ok()) return in.status();
    absl::StatusOr<comm::Buffer> out = comm::ToBuffer(recv);
    if (!out.ok()) return out.status();
    // Wait() without a deadline: the operation itself ends within `timeout` of starting (the
    // communicator's contract), and after that the backend no longer touches the buffers, which
    // a failed Create frees with the Pipe (a Wait(timeout) could return while it still ran).
    return comm.AllGather(*in, *out, op).Wait();
  };
  at::Tensor length = at::empty({1}, at::TensorOptions().dtype(at::kLong));
  length.data_ptr<int64_t>()[0] = static_cast<int64_t>(encoded.size());
  at::Tensor lengths = at::empty({p}, at::TensorOptions().dtype(at::kLong));
  absl::Status s = all_gather(length, lengths);
  if (!s.ok()) return s;
  const int64_t* len = lengths.data_ptr<int64_t>();
  // Bounded before the receive buffer (p * longest bytes) is allocated.
  for (int64_t r = 0; r < p; ++r) {
    if (len[r] < 0 || len[r] > internal::kMaxDeclarationBytes) {
      return absl::DataLossError(absl::StrCat("rank ", r, " announced skip declarations of ",
                                              len[r], " bytes (0 to ",
                                              internal::kMaxDeclarationBytes, " expected)"));
    }
  }
  const int64_t longest = *std::max_element(len, len + p);
  std::vector<internal::LayerSkips> all;
  if (longest > 0) {
    at::Tensor send = at::empty({longest}, at::TensorOptions().dtype(at::kByte));
    std::memset(send.data_ptr(), 0, static_cast<size_t>(longest));
    std::memcpy(send.data_ptr(), encoded.data(), encoded.size());
    at::Tensor recv = at::empty({p * longest}, at::TensorOptions().dtype(at::kByte));
    s = all_gather(send, recv);
    if (!s.ok()) return s;
    const char* bytes = static_cast<const char*>(recv.data_ptr());
    for (int64_t r = 0; r < p; ++r) {
      absl::StatusOr<std::vector<internal::LayerSkips>> decoded =
          internal::DecodeDeclarations(std::string(bytes + r * longest, len[r]));
      if (!decoded.ok()) {
        return absl::Status(decoded.status().code(),
                            absl::StrCat("rank ", r, ": ", decoded.status().message()));
      }
      all.insert(all.end(), decoded->begin(), decoded->end());
    }
  }
  std::sort(all.begin(), all.end(), [](const internal::LayerSkips& a, const internal::LayerSkips& b) {
    return std::make_pair(a.virtual_stage, a.position) < std::make_pair(b.virtual_stage, b.position);
  });
  return all;
}

}  // namespace

Pipe::~Pipe() = default;

std::unique_ptr<Pipe> Pipe::Create(torch::nn::Sequential model,
                                   std::shared_ptr<comm::Communicator> comm, PipeOptions options) {
  const std::string where = Where("pipe::Pipe::Create", comm.get());
  return base::ValueOrThrow(Build(std::move(model), std::move(comm), std::move(options)), where);
}

std::unique_ptr<Pipe> Pipe::CreateForStage(torch::nn::Sequential stage_layers,
                                           std::shared_ptr<comm::Communicator> comm,
                                           PipeOptions options) {
  const std::string where = Where("pipe::Pipe::CreateForStage", comm.get());
  return base::ValueOrThrow(
      BuildForStage(std::move(stage_layers), std::move(comm), std::move(options)), where);
}

absl::StatusOr<std::unique_ptr<Pipe>> Pipe::Build(torch::nn::Sequential model,
                                                  std::shared_ptr<comm::Communicator> comm,
                                                  PipeOptions options) {
  if (!comm) return absl::InvalidArgumentError("null communicator");
  if (model.is_empty() || model->size() == 0) {
    return absl::InvalidArgumentError("the model has no layers");
  }
  if (options.virtual_stages() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("virtual stages must be >= 1, got ", options.virtual_stages()));
  }
  const int64_t ranks = comm->size();
  const int64_t v = options.virtual_stages();
  const int64_t stages = ranks * v;
  const int64_t layers = static_cast<int64_t>(model->size());
  const std::string stages_text =
      v == 1 ? absl::StrCat(stages, " stages (one per rank)")
             : absl::StrCat(stages, " virtual stages (", ranks, " ranks x ", v, ")");
  if (stages > layers) {
    return absl::InvalidArgumentError(absl::StrCat(stages_text, " but the model has only ", layers,
                                                   " layers; every stage needs at least one"));
  }
  std::vector<int64_t> balance = options.balance();
  if (balance.empty()) {
    for (int64_t s = 0; s < stages; ++s) balance.push_back(layers / stages + (s < layers % stages));
  }
  if (static_cast<int64_t>(balance.size()) != stages) {
    return absl::InvalidArgumentError(absl::StrCat(
        "balance {", absl::StrJoin(balance, ", "), "} has ", balance.size(),
        " entries but the communicator has ", ranks, " ranks (",
        v == 1 ? std::string("one stage per rank") : absl::StrCat(v, " virtual stages per rank"),
        ")"));
  }
  for (size_t s = 0; s < balance.size(); ++s) {
    if (balance[s] < 1) {
      return absl::InvalidArgumentError(absl::StrCat("balance[", s, "] = ", balance[s],
                                                     "; every stage needs at least one layer"));
    }
  }
  const int64_t sum = std::accumulate(balance.begin(), balance.end(), int64_t{0});
  if (sum != layers) {
    return absl::InvalidArgumentError(absl::StrCat("balance {", absl::StrJoin(balance, ", "),
                                                   "} sums to ", sum, " but the model has ", layers,
                                                   " layers"));
  }
  const auto children = model->named_children();
  std::vector<torch::nn::Sequential> chunks;
  std::vector<int64_t> firsts;
  for (int64_t c = comm->rank(); c < stages; c += ranks) {
    const int64_t first = std::accumulate(balance.begin(), balance.begin() + c, int64_t{0});
    torch::nn::Sequential mine;
    for (int64_t l = first; l < first + balance[c]; ++l) {
      mine->push_back(children[l].key(), *(model->begin() + l));
    }
    chunks.push_back(std::move(mine));
    firsts.push_back(first);
  }
  return Make(std::move(chunks), std::move(firsts), std::move(comm), std::move(options),
              std::move(balance));
}

absl::StatusOr<std::unique_ptr<Pipe>> Pipe::BuildForStage(torch::nn::Sequential stage_layers,
                                                          std::shared_ptr<comm::Communicator> comm,
                                                          PipeOptions options) {
  if (!comm) return absl::InvalidArgumentError("null communicator");
  if (stage_layers.is_empty() || stage_layers->size() == 0) {
    return absl::InvalidArgumentError("the stage has no layers");
  }
  const std::vector<int64_t>& balance = options.balance();
  const int64_t v = options.virtual_stages();
  if (balance.empty()) {
    if (v != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("virtual stages = ", v, " needs a balance (layers per virtual stage)"));
    }
    return Make({std::move(stage_layers)}, {0}, comm, options, {});
  }
  const int64_t ranks = comm->size();
  int64_t mine = 0;
  for (int64_t c = comm->rank(); c < static_cast<int64_t>(balance.size()); c += ranks) {
    mine += balance[c];
  }
  if (v < 1 || static_cast<int64_t>(balance.size()) != ranks * v ||
      mine != static_cast<int64_t>(stage_layers->size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("balance {", absl::StrJoin(balance, ", "), "} must have one entry per rank x ",
                     "virtual stage (", ranks, " x ", v, ") and the entries of rank ", comm->rank(),
                     " must sum to this stage's layer count ", stage_layers->size()));
  }
  std::vector<torch::nn::Sequential> chunks;
  std::vector<int64_t> firsts;
  size_t next = 0;
  for (int64_t c = comm->rank(); c < ranks * v; c += ranks) {
    const int64_t first = std::accumulate(balance.begin(), balance.begin() + c, int64_t{0});
    torch::nn::Sequential renamed;
    for (int64_t l = 0; l < balance[c]; ++l) {
      renamed->push_back(std::to_string(first + l), *(stage_layers->begin() + next++));
    }
    chunks.push_back(std::move(renamed));
    firsts.push_back(first);
  }
  return Make(std::move(chunks), std::move(firsts), std::move(comm), std::move(options), balance);
}

absl::StatusOr<std::unique_ptr<Pipe>> Pipe::Make(std::vector<torch::nn::Sequential> chunks,
                                                 std::vector<int64_t> firsts,
                                                 std::shared_ptr<comm::Communicator> comm,
                                                 PipeOptions options,
                                                 std::vector<int64_t> balance) {
  if (options.chunks() < 1) {
    return absl::InvalidArgumentError(absl::StrCat("chunks must be >= 1, got ", options.chunks()));
  }
  const std::string invalid = ValidateSchedule(options.schedule(), comm->size(), options.chunks(),
                                               options.virtual_stages());
  if (!invalid.empty()) return absl::InvalidArgumentError(invalid);
  if (options.wrap_stage() && options.virtual_stages() > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "wrap_stage wraps one stage per rank; with virtual_stages = ", options.virtual_stages(),
        " a rank runs several chunks (not supported yet)"));
  }
  std::unique_ptr<Pipe> pipe(new Pipe());
  pipe->stage_ = comm->rank();
  pipe->num_stages_ = comm->size();
  pipe->balance_ = std::move(balance);
  pipe->chunk_first_ = std::move(firsts);
  // Skip connections: every rank verifies the whole model's declarations and routes each skip
  // through the virtual stages between its stash and its pop.
  const int64_t p = comm->size();
  std::vector<internal::LayerSkips> mine;
  for (size_t j = 0; j < chunks.size(); ++j) {
    std::vector<internal::LayerSkips> d =
        internal::DeclarationsOf(chunks[j], static_cast<int64_t>(j) * p + comm->rank());
    mine.insert(mine.end(), d.begin(), d.end());
  }
  absl::StatusOr<std::vector<internal::LayerSkips>> declarations = GatherSkipDeclarations(
      *comm, mine,
      options.timeout() > absl::ZeroDuration() ? options.timeout() : comm->default_timeout());
  if (!declarations.ok()) {
    return Annotate(declarations.status(), "exchanging the skip declarations");
  }
  absl::Status verified = internal::VerifyDeclarations(*declarations);
  if (!verified.ok()) return verified;
  const std::vector<internal::SkipRoute> routes = internal::RoutesOf(*declarations);
  pipe->layers_ = torch::nn::Sequential();
  for (size_t j = 0; j < chunks.size(); ++j) {
    const auto children = chunks[j]->named_children();
    for (size_t l = 0; l < chunks[j]->size(); ++l) {
      pipe->layers_->push_back(children[l].key(), *(chunks[j]->begin() + l));
    }
    const int64_t c = static_cast<int64_t>(j) * p + comm->rank();
    Stage stage(chunks[j], pipe->chunk_first_[j],
                c == 0 ? std::vector<SkipId>() : internal::InTransitAfter(routes, c - 1),
                internal::InTransitAfter(routes, c));
    pipe->chunk_stages_.push_back(stage);
    pipe->forwards_.push_back([stage](std::vector<at::Tensor> xs, bool list) mutable {
      return stage->forward(std::move(xs), list);
    });
  }
  if (chunks.size() == 1) {
    pipe->module_ = pipe->chunk_stages_[0].ptr();
  } else {
    pipe->module_ = pipe->layers_.ptr();
  }
  pipe->timeout_ =
      options.timeout() > absl::ZeroDuration() ? options.timeout() : comm->default_timeout();
  pipe->options_ = std::move(options);
  pipe->comm_ = std::move(comm);
  comm::OpOptions op;
  op.timeout = pipe->timeout_;
  absl::Status checked = pipe->SetUpDeterministic();
  if (!checked.ok()) return checked;
  absl::Status connected = pipe->Connect(op);
  if (!connected.ok()) return connected;
  if (pipe->options_.wrap_stage()) {
    try {
      WrappedStage wrapped = pipe->options_.wrap_stage()(pipe->chunk_stages_[0]);
      if (!wrapped.module || !wrapped.forward) {
        return absl::InvalidArgumentError("wrap_stage returned no module or no forward function");
      }
      pipe->module_ = std::move(wrapped.module);
      pipe->forwards_[0] = std::move(wrapped.forward);
      pipe->before_backward_ = std::move(wrapped.before_backward);
    } catch (const std::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("wrap_stage: ", WhatOf(e)));
    }
  }
  return pipe;
}

absl::Status Pipe::Connect(const comm::OpOptions& op) {
  const int rank = static_cast<int>(stage_);
  const int p = static_cast<int>(num_stages_);
  absl::StatusOr<std::shared_ptr<comm::Communicator>> ctl = comm_->Split(0, rank, op);
  if (!ctl.ok()) return Annotate(ctl.status(), "splitting the communicator");
  ctl_ = *std::move(ctl);
  links_ = std::make_unique<Links>();
  // Link l joins rank l (key 0) to rank (l + 1) % p (key 1); the wrap-around link p - 1 -> 0
  // exists only with virtual stages. Every rank takes part in every split.
  const int links = p == 1 ? 0 : (virtual_stages() > 1 ? p : p - 1);
  for (int l = 0; l < links; ++l) {
    const int to = (l + 1) % p;
    const bool in_link = rank == l || rank == to;
    std::shared_ptr<comm::Communicator> pair[2];  // activations l -> to, gradients to -> l
    for (auto& c : pair) {
      absl::StatusOr<std::shared_ptr<comm::Communicator>> split =
          comm_->Split(in_link ? 0 : comm::kNoColor, rank == l ? 0 : 1, op);
      if (!split.ok()) {
        return Annotate(split.status(), absl::StrCat("splitting link ", l, " -> ", to));
      }
      c = *std::move(split);
      if (c) links_->all.push_back(c);
    }
    if (rank == l) {
      links_->to_next.emplace(pair[0].get(), 1, timeout_, &orphans_);
      links_->grads_from_next = pair[1];
    }
    if (rank == to) {
      links_->from_prev.emplace(pair[0].get(), 0, timeout_, &orphans_);
      links_->grads_to_prev = pair[1];
    }
  }
  // Every rank has all its communicators before any uses them: a rank that failed its first
  // step at once must not tear its communicators down while a peer is still creating its own.
  absl::Status ready = ctl_->Barrier(op).Wait(timeout_);
  if (!ready.ok()) return Annotate(ready, "waiting for the other stages");
  return absl::OkStatus();
}

int64_t Pipe::num_layers() const { return static_cast<int64_t>(layers_->size()); }

std::vector<at::Tensor> Pipe::parameters() const { return module_->parameters(); }

std::string Pipe::Name() const {
  return absl::StrCat("pipe stage ", stage_, "/", num_stages_, " (rank ", stage_, ")");
}

absl::Status Pipe::Fail(absl::Status status) {
  broken_ = status;
  // Every peer's pending and later operations on the pipe's communicators fail with this
  // message, so no stage waits for this one until its timeout.
  ctl_->Abort(status);
  for (const auto& c : links_->all) c->Abort(status);
  return status;
}

at::Tensor Pipe::train_step(const at::Tensor& input, const at::Tensor& target,
                            const LossFn& loss_fn) {
  return base::ValueOrThrow(Step({input}, false, target, loss_fn, true), "pipe::Pipe::train_step");
}

at::Tensor Pipe::train_step(const std::vector<at::Tensor>& inputs, const at::Tensor& target,
                            const LossFn& loss_fn) {
  return base::ValueOrThrow(Step(inputs, true, target, loss_fn, true), "pipe::Pipe::train_step");
}

at::Tensor Pipe::eval_step(const at::Tensor& input, const at::Tensor& target,
                           const LossFn& loss_fn) {
  return base::ValueOrThrow(Step({input}, false, target, loss_fn, false), "pipe::Pipe::eval_step");
}

at::Tensor Pipe::eval_step(const std::vector<at::Tensor>& inputs, const at::Tensor& target,
                           const LossFn& loss_fn) {
  return base::ValueOrThrow(Step(inputs, true, target, loss_fn, false), "pipe::Pipe::eval_step");
}

absl::StatusOr<at::Tensor> Pipe::Step(const std::vector<at::Tensor>& inputs, bool is_list,
                                      const at::Tensor& target, const LossFn& loss_fn,
                                      bool train) {
  if (!broken_.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(Name(), ": the pipe failed earlier: ", broken_.message()));
  }
  trace_.clear();
  internal::StepState st(&orphans_);
  st.chunks = options_.chunks();
  st.loss_fn = &loss_fn;
  st.train = train;
  st.micro.resize(st.chunks * virtual_stages());
  st.losses.assign(st.chunks, 0.0);
  const bool det = options_.deterministic();
  absl::Status status;
  doing_ = "splitting the batch";
  try {
    c10::AutoGradMode grad_mode(train);
    if (stage_ == 0) {
      st.first_inputs.resize(st.chunks);
      for (size_t k = 0; k < inputs.size() && status.ok(); ++k) {
        absl::StatusOr<std::vector<at::Tensor>> parts = SplitRows(
            inputs[k], st.chunks, is_list ? absl::StrCat("input ", k) : std::string("the input"));
        status = parts.status();
        for (int64_t i = 0; status.ok() && i < st.chunks; ++i) {
          st.first_inputs[i].is_list = is_list;
          st.first_inputs[i].tensors.push_back((*parts)[i]);
        }
      }
      if (status.ok() && inputs.empty()) status = absl::InvalidArgumentError("no inputs");
    }
    if (status.ok() && stage_ + 1 == num_stages_) {
      if (!loss_fn) status = absl::InvalidArgumentError("no loss function");
      absl::StatusOr<std::vector<at::Tensor>> parts = SplitRows(target, st.chunks, "the target");
      if (status.ok()) status = parts.status();
      if (status.ok()) st.targets = *std::move(parts);
    }
    if (status.ok() && det) {
      doing_ = "checking the batch (deterministic mode)";
      status = BeginDeterministicStep(inputs, target, train);
    }
    std::vector<Action> actions =
        MakeSchedule(options_.schedule(), num_stages_, stage_, st.chunks, virtual_stages());
    if (!train) {
      actions.erase(std::remove_if(actions.begin(), actions.end(),
                                   [](const Action& a) { return a.phase == Phase::kBackward; }),
                    actions.end());
    }
    const Action* last_backward = nullptr;
    for (const Action& a : actions) {
      if (a.phase == Phase::kBackward) last_backward = &a;
    }
    for (const Action& a : actions) {
      if (!status.ok()) break;
      if (a.phase == Phase::kBackward && before_backward_) before_backward_(&a == last_backward);
      doing_ = absl::StrCat(a.phase == Phase::kForward ? "forward" : "backward",
                            " of micro-batch ", a.micro_batch);
      if (virtual_stages() > 1) {
        absl::StrAppend(&doing_, " on virtual stage ", VirtualStage(a), " (chunk ", a.chunk, ")");
      }
      status = a.phase == Phase::kForward ? Forward(st, a) : Backward(st, a);
      if (status.ok() && det && a.phase == Phase::kBackward) CaptureGradients(a);
    }
    if (status.ok()) {
      doing_ = "completing its sends";
      status = st.pending.WaitAll(timeout_);
    }
    if (status.ok() && det && train) {
      doing_ = "summing the micro-batch gradients (deterministic mode)";
      EndDeterministicStep();
    }
  } catch (const std::exception& e) {
    status = absl::InternalError(WhatOf(e));
  }
  if (!status.ok()) return Fail(Annotate(status, absl::StrCat(Name(), ": ", doing_)));

  // Every rank returns the mean loss: the last stage broadcasts it with its dtype (in
  // deterministic mode every micro-batch's loss, then their tree mean is taken on every rank).
  const int64_t values = det ? st.chunks : 1;
  at::Tensor buffer = at::empty({values + 1}, at::TensorOptions().dtype(at::kDouble));
  double* shared = buffer.data_ptr<double>();
  if (det) {
    std::copy(st.losses.begin(), st.losses.end(), shared);
  } else {
    shared[0] = st.loss_sum / static_cast<double>(st.chunks);
  }
  shared[values] = static_cast<double>(st.loss_dtype);
  comm::OpOptions op;
  op.timeout = timeout_;
  status = ctl_->Broadcast(comm::Buffer{shared, static_cast<size_t>(values + 1),
                                        comm::DataType::kF64, {}},
                           static_cast<int>(num_stages_ - 1), op)
               .Wait(timeout_);
  if (!status.ok()) {
    orphans_.push_back(buffer);
    return Fail(Annotate(status, absl::StrCat(Name(), ": loss broadcast")));
  }
  double loss = shared[0];
  if (det) {
    micro_batch_losses_.assign(shared, shared + values);
    loss_dtype_ = static_cast<c10::ScalarType>(shared[values]);
    loss = deterministic::TotalOf(micro_batch_losses_) / static_cast<double>(st.chunks);
  }
  return at::scalar_tensor(loss, at::TensorOptions().dtype(
                                     static_cast<c10::ScalarType>(shared[values])));
}

// "stage 2" or, with virtual stages, "virtual stage 5 (rank 1)".
std::string Pipe::Describe(int64_t virtual_stage) const {
  const int64_t rank = virtual_stage % num_stages_;
  if (virtual_stages() == 1) return absl::StrCat("stage ", rank);
  return absl::StrCat("virtual stage ", virtual_stage, " (rank ", rank, ")");
}

absl::Status Pipe::Forward(internal::StepState& st, const Action& a) {
  const int64_t i = a.micro_batch;
  const int64_t c = VirtualStage(a);
  const bool last = c == LastVirtualStage();
  Boundary in;
  if (c == 0) {
    in = std::move(st.first_inputs[i]);
  } else if (num_stages_ == 1) {
    auto it = st.local_activations.find({c, i});
    if (it == st.local_activations.end()) {
      return absl::InternalError(absl::StrCat("no activations from chunk ", a.chunk - 1));
    }
    in = std::move(it->second);
    st.local_activations.erase(it);
  } else {
    absl::StatusOr<Boundary> received = links_->from_prev->Recv(c * st.chunks + i);
    if (!received.ok()) {
      return Annotate(received.status(), absl::StrCat("activations from ", Describe(c - 1)));
    }
    in = *std::move(received);
  }
  const int64_t skips_in = static_cast<int64_t>(chunk_stages_[a.chunk]->skips_in().size());
  if (in.skips != skips_in) {
    return absl::InternalError(absl::StrCat("received ", in.skips, " skip tensors from ",
                                            Describe(c - 1), ", expected ", skips_in));
  }
  const absl::Time start = absl::Now();
  const bool is_list_in = in.is_list;
  // The checkpointed backward calls `run` again after this frame is gone: it owns what it uses.
  auto run = [forward = forwards_[a.chunk], is_list_in](const std::vector<at::Tensor>& xs) {
    return forward(xs, is_list_in);
  };
  const CheckpointMode mode = options_.checkpoint();
  const bool checkpointed =
      st.train && (mode == CheckpointMode::kAlways ||
                   (mode == CheckpointMode::kExceptLast && i + 1 < st.chunks));
  Boundary out;
  out.tensors = checkpointed ? checkpoint::checkpoint(run, in.tensors) : run(in.tensors);
  out.is_list = chunk_stages_[a.chunk]->output_is_list();
  out.skips = static_cast<int64_t>(chunk_stages_[a.chunk]->skips_out().size());
  internal::MicroBatch& mb = st.micro[a.chunk * st.chunks + i];
  mb.inputs = std::move(in.tensors);
  if (last) {
    if (out.is_list || out.tensors.size() != 1) {
      return absl::InvalidArgumentError(
          "the last layer must return one at::Tensor (the loss function's output argument)");
    }
    mb.loss = (*st.loss_fn)(out.tensors[0], st.targets[i]);
    TORCH_CHECK(mb.loss.defined() && mb.loss.numel() == 1,
                "the loss function must return a scalar, got ", mb.loss.sizes());
    st.loss_dtype = mb.loss.scalar_type();
    st.losses[i] = mb.loss.detach().item<double>();
    st.loss_sum += st.losses[i];
    trace_.push_back({stage_, i, Phase::kForward, start, absl::Now(), a.chunk});
    if (!st.train) mb = internal::MicroBatch();
    return absl::OkStatus();
  }
  trace_.push_back({stage_, i, Phase::kForward, start, absl::Now(), a.chunk});
  if (st.train) {
    mb.outputs = out.tensors;
  } else {
    mb = internal::MicroBatch();  // the pending send keeps what it reads
  }
  if (num_stages_ == 1) {
    // What a link would deliver: detached leaves, requiring grad where the output does.
    Boundary next;
    next.is_list = out.is_list;
    next.skips = out.skips;
    for (const at::Tensor& t : out.tensors) {
      next.tensors.push_back(t.detach().requires_grad_(t.requires_grad()));
    }
    st.local_activations[{c + 1, i}] = std::move(next);
    return absl::OkStatus();
  }
  return Annotate(links_->to_next->Send((c + 1) * st.chunks + i, out, &st.pending),
                  absl::StrCat("sending activations to ", Describe(c + 1)));
}

absl::Status Pipe::Backward(internal::StepState& st, const Action& a) {
  const int64_t i = a.micro_batch;
  const int64_t c = VirtualStage(a);
  internal::MicroBatch& mb = st.micro[a.chunk * st.chunks + i];
  absl::Time start;
  if (c == LastVirtualStage()) {
    start = absl::Now();
    if (mb.loss.requires_grad()) {
      // Deterministic mode: this micro-batch's own gradient, divided by M after the tree sum.
      if (options_.deterministic()) {
        mb.loss.backward();
      } else {
        (mb.loss / static_cast<double>(st.chunks)).backward();
      }
    }
  } else {
    std::vector<at::Tensor> outs = RequiringGrad(mb.outputs);
    absl::StatusOr<std::vector<at::Tensor>> grads;
    if (num_stages_ == 1) {
      auto it = st.local_gradients.find({c, i});
      if (it == st.local_gradients.end()) {
        return absl::InternalError(absl::StrCat("no gradients from chunk ", a.chunk + 1));
      }
      grads = std::move(it->second);
      st.local_gradients.erase(it);
    } else {
      grads = internal::RecvGradients(links_->grads_from_next.get(), 1, Layouts(outs), timeout_,
                                      &orphans_);
    }
    if (!grads.ok()) {
      return Annotate(grads.status(), absl::StrCat("gradients from ", Describe(c + 1)));
    }
    start = absl::Now();
    if (!outs.empty()) torch::autograd::backward(outs, *grads);
  }
  absl::Status status;
  if (c > 0) {
    std::vector<at::Tensor> ins = RequiringGrad(mb.inputs);
    std::vector<at::Tensor> grads;
    for (const at::Tensor& t : ins) grads.push_back(t.grad());
    if (num_stages_ == 1) {
      for (size_t k = 0; k < ins.size(); ++k) {
        if (!grads[k].defined()) grads[k] = at::zeros_like(ins[k]);
      }
      st.local_gradients[{c - 1, i}] = std::move(grads);
    } else {
      status = Annotate(internal::SendGradients(links_->grads_to_prev.get(), 0, Layouts(ins),
                                                grads, &st.pending),
                        absl::StrCat("sending gradients to ", Describe(c - 1)));
    }
  }
  mb = internal::MicroBatch();  // frees this micro-batch's activations
  trace_.push_back({stage_, i, Phase::kBackward, start, absl::Now(), a.chunk});
  return status;
}

absl::Status Pipe::SetUpDeterministic() {
  const bool det = options_.deterministic();
  const int64_t replicas = options_.replicas();
  try {
    // Collective in either mode, so that a job mixing modes fails here on every rank.
    deterministic::CheckSameMode(*comm_, det, det ? options_.chunks() * replicas : 0, "pipe");
    if (!det) return absl::OkStatus();
    if (options_.wrap_stage()) {
      return absl::InvalidArgumentError(
          "deterministic mode with wrap_stage (e.g. fsdp_stage, FSDP inside a stage) is not "
          "supported yet");
    }
    if (replicas < 1 || options_.replica() < 0 || options_.replica() >= replicas) {
      return absl::InvalidArgumentError(absl::StrCat("replica ", options_.replica(), " of ",
                                                     replicas, " replicas: need 0 <= replica < "
                                                     "replicas"));
    }
    deterministic::CheckThreads("pipe");
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(WhatOf(e));
  }
  // Each parameter must belong to one layer of one chunk: its gradient is taken after each of
  // that chunk's backwards.
  std::map<const void*, int64_t> seen;
  chunk_params_.clear();
  for (size_t j = 0; j < chunk_stages_.size(); ++j) {
    chunk_params_.push_back(chunk_stages_[j]->parameters());
    for (const at::Tensor& p : chunk_params_.back()) {
      if (!seen.emplace(p.unsafeGetTensorImpl(), static_cast<int64_t>(j)).second) {
        return absl::InvalidArgumentError(
            "deterministic mode: a parameter is shared between layers of this rank (not "
            "supported: each micro-batch's gradient is taken per chunk)");
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Pipe::BeginDeterministicStep(const std::vector<at::Tensor>& inputs,
                                          const at::Tensor& target, bool train) {
  const int64_t m = options_.chunks();
  auto check = [m](const at::Tensor& t, const std::string& what) -> absl::Status {
    if (t.defined() && t.dim() > 0 && t.size(0) % m != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "deterministic mode needs equal micro-batches, but ", what, " has ", t.size(0),
          " rows, not a multiple of chunks = ", m));
    }
    return absl::OkStatus();
  };
  if (stage_ == 0) {
    for (size_t k = 0; k < inputs.size(); ++k) {
      absl::Status s = check(inputs[k], inputs.size() == 1 ? std::string("the input")
                                                           : absl::StrCat("input ", k));
      if (!s.ok()) return s;
    }
  }
  if (stage_ + 1 == num_stages_) {
    absl::Status s = check(target, "the target");
    if (!s.ok()) return s;
  }
  if (!train) return absl::OkStatus();  // eval_step
  if (!pending_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "deterministic mode with replicas = ", options_.replicas(),
        ": the last step's gradients were not reduced; call all_reduce_gradients(pipe, "
        "*grid.data) after every train_step"));
  }
  // Each micro-batch's backward must find no gradient, so that what it leaves is its own.
  accumulators_.assign(chunk_params_.size(), {});
  grad_storage_.assign(chunk_params_.size(), {});
  for (size_t j = 0; j < chunk_params_.size(); ++j) {
    accumulators_[j].resize(chunk_params_[j].size());
    for (at::Tensor& p : chunk_params_[j]) {
      grad_storage_[j].push_back(std::move(p.mutable_grad()));
      p.mutable_grad() = at::Tensor();
    }
  }
  return absl::OkStatus();
}

void Pipe::CaptureGradients(const Action& a) {
  const int64_t global = options_.replica() * options_.chunks() + a.micro_batch;
  std::vector<at::Tensor>& params = chunk_params_.at(a.chunk);
  for (size_t k = 0; k < params.size(); ++k) {
    at::Tensor g = std::move(params[k].mutable_grad());
    params[k].mutable_grad() = at::Tensor();
    if (!g.defined()) g = at::zeros_like(params[k]);
    accumulators_[a.chunk][k].Add(global, std::move(g));
  }
}

void Pipe::EndDeterministicStep() {
  c10::NoGradGuard no_grad;
  const int64_t m = options_.chunks();
  const bool local = options_.replicas() == 1;
  for (size_t j = 0; j < chunk_params_.size(); ++j) {
    for (size_t k = 0; k < chunk_params_[j].size(); ++k) {
      std::vector<deterministic::Partial> parts = accumulators_[j][k].Take();
      if (!local) {
        pending_.push_back(std::move(parts));  // chunk order = parameters() order
        continue;
      }
      at::Tensor total = deterministic::Total(std::move(parts), m);
      total.div_(static_cast<double>(m));
      at::Tensor& storage = grad_storage_[j][k];
      at::Tensor& p = chunk_params_[j][k];
      if (storage.defined() && storage.sizes() == total.sizes() &&
          storage.scalar_type() == total.scalar_type() && storage.device() == total.device()) {
        storage.copy_(total);
        p.mutable_grad() = storage;
      } else {
        p.mutable_grad() = total;
      }
    }
  }
  if (local) grad_storage_.clear();
  accumulators_.clear();
}

}  // namespace fairscale::pipe
