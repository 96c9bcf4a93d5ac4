#include "pipe/pipe.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/narrow.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <exception>
#include <numeric>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/checkpoint.h"
#include "comm/torch/tensor_buffer.h"
#include "pipe/internal/wire.h"

namespace fairscale::pipe {

StageImpl::StageImpl(torch::nn::Sequential layers, int64_t first_layer)
    : torch::nn::Module("fairscale::pipe::Stage"),
      layers_(std::move(layers)),
      first_layer_(first_layer) {
  // Registered under their own names, so that parameter names are the full model's ("3.weight").
  for (const auto& item : layers_->named_children()) register_module(item.key(), item.value());
}

std::vector<at::Tensor> StageImpl::forward(std::vector<at::Tensor> inputs, bool list_input) {
  torch::nn::AnyValue v = list_input ? torch::nn::AnyValue(std::move(inputs))
                                     : torch::nn::AnyValue(std::move(inputs.at(0)));
  for (torch::nn::AnyModule& layer : *layers_) v = layer.any_forward(std::move(v));
  if (const at::Tensor* t = v.try_get<at::Tensor>()) {
    output_is_list_ = false;
    return {*t};
  }
  if (const std::vector<at::Tensor>* l = v.try_get<std::vector<at::Tensor>>()) {
    output_is_list_ = true;
    return *l;
  }
  TORCH_CHECK(false, "layer ", first_layer_ + static_cast<int64_t>(layers_->size()) - 1,
              " returned a value of type ", v.type_info().name(),
              "; stages exchange at::Tensor or std::vector<at::Tensor>");
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
  std::vector<MicroBatch> micro;
  double loss_sum = 0;
  c10::ScalarType loss_dtype = c10::ScalarType::Float;
  bool train = true;  // false: forwards only, no graph kept (eval_step)
  explicit StepState(Orphans* orphans) : pending(orphans) {}
  PendingSends pending;
};

}  // namespace internal

struct Pipe::Links {
  std::optional<internal::ActivationLink> from_prev;
  std::optional<internal::ActivationLink> to_next;
};

namespace {

using internal::Boundary;
using internal::Orphans;

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

}  // namespace

Pipe::~Pipe() = default;

absl::StatusOr<std::unique_ptr<Pipe>> Pipe::Create(torch::nn::Sequential model,
                                                   std::shared_ptr<comm::Communicator> comm,
                                                   PipeOptions options) {
  const std::string where =
      comm ? absl::StrCat("pipe::Pipe::Create (rank ", comm->rank(), "/", comm->size(), ")")
           : "pipe::Pipe::Create";
  if (!comm) return absl::InvalidArgumentError(absl::StrCat(where, ": null communicator"));
  if (model.is_empty() || model->size() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": the model has no layers"));
  }
  const int64_t stages = comm->size();
  const int64_t layers = static_cast<int64_t>(model->size());
  if (stages > layers) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": ", stages, " stages (one per rank) but the model has only ",
                     layers, " layers; every stage needs at least one"));
  }
  std::vector<int64_t> balance = options.balance();
  if (balance.empty()) {
    for (int64_t s = 0; s < stages; ++s) balance.push_back(layers / stages + (s < layers % stages));
  }
  if (static_cast<int64_t>(balance.size()) != stages) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": balance {", absl::StrJoin(balance, ", "), "} has ", balance.size(),
                     " entries but the communicator has ", stages, " ranks (one stage per rank)"));
  }
  for (size_t s = 0; s < balance.size(); ++s) {
    if (balance[s] < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": balance[", s, "] = ", balance[s], "; every stage needs at least one layer"));
    }
  }
  const int64_t sum = std::accumulate(balance.begin(), balance.end(), int64_t{0});
  if (sum != layers) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": balance {",
                                                   absl::StrJoin(balance, ", "), "} sums to ", sum,
                                                   " but the model has ", layers, " layers"));
  }
  const int64_t first =
      std::accumulate(balance.begin(), balance.begin() + comm->rank(), int64_t{0});
  torch::nn::Sequential mine;
  const auto children = model->named_children();
  for (int64_t l = first; l < first + balance[comm->rank()]; ++l) {
    mine->push_back(children[l].key(), *(model->begin() + l));
  }
  return Make(std::move(mine), std::move(comm), std::move(options), std::move(balance));
}

absl::StatusOr<std::unique_ptr<Pipe>> Pipe::CreateForStage(
    torch::nn::Sequential stage_layers, std::shared_ptr<comm::Communicator> comm,
    PipeOptions options) {
  const std::string where =
      comm ? absl::StrCat("pipe::Pipe::CreateForStage (rank ", comm->rank(), "/", comm->size(), ")")
           : "pipe::Pipe::CreateForStage";
  if (!comm) return absl::InvalidArgumentError(absl::StrCat(where, ": null communicator"));
  if (stage_layers.is_empty() || stage_layers->size() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": the stage has no layers"));
  }
  const std::vector<int64_t>& balance = options.balance();
  if (balance.empty()) return Make(std::move(stage_layers), comm, options, {});
  if (static_cast<int64_t>(balance.size()) != comm->size() ||
      balance[comm->rank()] != static_cast<int64_t>(stage_layers->size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": balance {", absl::StrJoin(balance, ", "), "} must have one entry per rank (",
        comm->size(), ") and entry ", comm->rank(), " must be this stage's layer count ",
        stage_layers->size()));
  }
  const int64_t first =
      std::accumulate(balance.begin(), balance.begin() + comm->rank(), int64_t{0});
  torch::nn::Sequential renamed;
  for (size_t l = 0; l < stage_layers->size(); ++l) {
    renamed->push_back(std::to_string(first + l), *(stage_layers->begin() + l));
  }
  return Make(std::move(renamed), std::move(comm), std::move(options), balance);
}

absl::StatusOr<std::unique_ptr<Pipe>> Pipe::Make(torch::nn::Sequential layers,
                                                 std::shared_ptr<comm::Communicator> comm,
                                                 PipeOptions options,
                                                 std::vector<int64_t> balance) {
  if (options.chunks() < 1) {
    return absl::InvalidArgumentError(absl::StrCat("pipe::Pipe (rank ", comm->rank(), "/",
                                                   comm->size(), "): chunks must be >= 1, got ",
                                                   options.chunks()));
  }
  std::unique_ptr<Pipe> pipe(new Pipe());
  pipe->stage_ = comm->rank();
  pipe->num_stages_ = comm->size();
  pipe->balance_ = std::move(balance);
  pipe->first_layer_ = pipe->balance_.empty()
                           ? 0
                           : std::accumulate(pipe->balance_.begin(),
                                             pipe->balance_.begin() + pipe->stage_, int64_t{0});
  pipe->layers_ = std::move(layers);
  pipe->stage_layers_ = Stage(pipe->layers_, pipe->first_layer_);
  pipe->module_ = pipe->stage_layers_.ptr();
  pipe->forward_ = [stage = pipe->stage_layers_](std::vector<at::Tensor> xs, bool list) mutable {
    return stage->forward(std::move(xs), list);
  };
  pipe->timeout_ =
      options.timeout() > absl::ZeroDuration() ? options.timeout() : comm->default_timeout();
  pipe->options_ = std::move(options);
  comm::OpOptions op;
  op.timeout = pipe->timeout_;
  for (auto* child : {&pipe->fwd_, &pipe->bwd_}) {
    absl::StatusOr<std::shared_ptr<comm::Communicator>> c = comm->Split(0, comm->rank(), op);
    if (!c.ok()) return Annotate(c.status(), pipe->Name() + ": splitting the communicator");
    *child = *std::move(c);
  }
  // Every rank has both communicators before any uses them: a rank that failed its first step
  // at once must not tear its communicators down while a peer is still creating its own.
  absl::Status ready = pipe->bwd_->Barrier(op).Wait(pipe->timeout_);
  if (!ready.ok()) return Annotate(ready, pipe->Name() + ": waiting for the other stages");
  if (pipe->options_.wrap_stage()) {
    try {
      WrappedStage wrapped = pipe->options_.wrap_stage()(pipe->stage_layers_);
      if (!wrapped.module || !wrapped.forward) {
        return absl::InvalidArgumentError(
            pipe->Name() + ": wrap_stage returned no module or no forward function");
      }
      pipe->module_ = std::move(wrapped.module);
      pipe->forward_ = std::move(wrapped.forward);
    } catch (const std::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat(pipe->Name(), ": wrap_stage: ", e.what()));
    }
  }
  pipe->comm_ = std::move(comm);
  pipe->links_ = std::make_unique<Links>();
  if (pipe->stage_ > 0) {
    pipe->links_->from_prev.emplace(pipe->fwd_.get(), pipe->stage_ - 1, pipe->timeout_,
                                    &pipe->orphans_);
  }
  if (pipe->stage_ + 1 < pipe->num_stages_) {
    pipe->links_->to_next.emplace(pipe->fwd_.get(), pipe->stage_ + 1, pipe->timeout_,
                                  &pipe->orphans_);
  }
  return pipe;
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
  fwd_->Abort(status);
  bwd_->Abort(status);
  return status;
}

absl::StatusOr<at::Tensor> Pipe::train_step(const at::Tensor& input, const at::Tensor& target,
                                            const LossFn& loss_fn) {
  return Step({input}, false, target, loss_fn, true);
}

absl::StatusOr<at::Tensor> Pipe::train_step(const std::vector<at::Tensor>& inputs,
                                            const at::Tensor& target, const LossFn& loss_fn) {
  return Step(inputs, true, target, loss_fn, true);
}

absl::StatusOr<at::Tensor> Pipe::eval_step(const at::Tensor& input, const at::Tensor& target,
                                           const LossFn& loss_fn) {
  return Step({input}, false, target, loss_fn, false);
}

absl::StatusOr<at::Tensor> Pipe::eval_step(const std::vector<at::Tensor>& inputs,
                                           const at::Tensor& target, const LossFn& loss_fn) {
  return Step(inputs, true, target, loss_fn, false);
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
  st.micro.resize(st.chunks);
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
    std::vector<Action> actions = MakeSchedule(options_.schedule(), num_stages_, stage_, st.chunks);
    if (!train) {
      actions.erase(std::remove_if(actions.begin(), actions.end(),
                                   [](const Action& a) { return a.phase == Phase::kBackward; }),
                    actions.end());
    }
    for (const Action& a : actions) {
      if (!status.ok()) break;
      doing_ = absl::StrCat(a.phase == Phase::kForward ? "forward" : "backward",
                            " of micro-batch ", a.micro_batch);
      status = a.phase == Phase::kForward ? Forward(st, a.micro_batch)
                                          : Backward(st, a.micro_batch);
    }
    if (status.ok()) {
      doing_ = "completing its sends";
      status = st.pending.WaitAll(timeout_);
    }
  } catch (const std::exception& e) {
    status = absl::InternalError(e.what());
  }
  if (!status.ok()) return Fail(Annotate(status, absl::StrCat(Name(), ": ", doing_)));

  // Every rank returns the mean loss: the last stage broadcasts it with its dtype.
  at::Tensor buffer = at::empty({2}, at::TensorOptions().dtype(at::kDouble));
  double* shared = buffer.data_ptr<double>();
  shared[0] = st.loss_sum / static_cast<double>(st.chunks);
  shared[1] = static_cast<double>(st.loss_dtype);
  comm::OpOptions op;
  op.timeout = timeout_;
  status = bwd_->Broadcast(comm::Buffer{shared, 2, comm::DataType::kF64, {}},
                           static_cast<int>(num_stages_ - 1), op)
               .Wait(timeout_);
  if (!status.ok()) {
    orphans_.push_back(buffer);
    return Fail(Annotate(status, absl::StrCat(Name(), ": loss broadcast")));
  }
  return at::scalar_tensor(shared[0], at::TensorOptions().dtype(
                                          static_cast<c10::ScalarType>(shared[1])));
}

absl::Status Pipe::Forward(internal::StepState& st, int64_t i) {
  Boundary in;
  if (stage_ == 0) {
    in = std::move(st.first_inputs[i]);
  } else {
    absl::StatusOr<Boundary> received = links_->from_prev->Recv(i);
    if (!received.ok()) {
      return Annotate(received.status(), absl::StrCat("activations from stage ", stage_ - 1));
    }
    in = *std::move(received);
  }
  const absl::Time start = absl::Now();
  const bool is_list_in = in.is_list;
  // The checkpointed backward calls `run` again after this frame is gone: it owns what it uses.
  auto run = [forward = forward_, is_list_in](const std::vector<at::Tensor>& xs) {
    return forward(xs, is_list_in);
  };
  const CheckpointMode mode = options_.checkpoint();
  const bool checkpointed =
      st.train && (mode == CheckpointMode::kAlways ||
                   (mode == CheckpointMode::kExceptLast && i + 1 < st.chunks));
  Boundary out;
  out.tensors = checkpointed ? checkpoint::checkpoint(run, in.tensors) : run(in.tensors);
  out.is_list = stage_layers_->output_is_list();
  internal::MicroBatch& mb = st.micro[i];
  mb.inputs = std::move(in.tensors);
  if (stage_ + 1 == num_stages_) {
    if (out.is_list || out.tensors.size() != 1) {
      return absl::InvalidArgumentError(
          "the last layer must return one at::Tensor (the loss function's output argument)");
    }
    mb.loss = (*st.loss_fn)(out.tensors[0], st.targets[i]);
    TORCH_CHECK(mb.loss.defined() && mb.loss.numel() == 1,
                "the loss function must return a scalar, got ", mb.loss.sizes());
    st.loss_dtype = mb.loss.scalar_type();
    st.loss_sum += mb.loss.detach().item<double>();
    trace_.push_back({stage_, i, Phase::kForward, start, absl::Now()});
    if (!st.train) mb = internal::MicroBatch();
    return absl::OkStatus();
  }
  trace_.push_back({stage_, i, Phase::kForward, start, absl::Now()});
  if (st.train) {
    mb.outputs = out.tensors;
  } else {
    mb = internal::MicroBatch();  // the pending send keeps what it reads
  }
  return Annotate(links_->to_next->Send(i, out, &st.pending),
                  absl::StrCat("sending activations to stage ", stage_ + 1));
}

absl::Status Pipe::Backward(internal::StepState& st, int64_t i) {
  internal::MicroBatch& mb = st.micro[i];
  absl::Time start;
  if (stage_ + 1 == num_stages_) {
    start = absl::Now();
    if (mb.loss.requires_grad()) (mb.loss / static_cast<double>(st.chunks)).backward();
  } else {
    std::vector<at::Tensor> outs = RequiringGrad(mb.outputs);
    absl::StatusOr<std::vector<at::Tensor>> grads =
        internal::RecvGradients(bwd_.get(), static_cast<int>(stage_ + 1), Layouts(outs), timeout_,
                                &orphans_);
    if (!grads.ok()) {
      return Annotate(grads.status(), absl::StrCat("gradients from stage ", stage_ + 1));
    }
    start = absl::Now();
    if (!outs.empty()) torch::autograd::backward(outs, *grads);
  }
  absl::Status status;
  if (stage_ > 0) {
    std::vector<at::Tensor> ins = RequiringGrad(mb.inputs);
    std::vector<at::Tensor> grads;
    for (const at::Tensor& t : ins) grads.push_back(t.grad());
    status = Annotate(internal::SendGradients(bwd_.get(), static_cast<int>(stage_ - 1),
                                              Layouts(ins), grads, &st.pending),
                      absl::StrCat("sending gradients to stage ", stage_ - 1));
  }
  mb = internal::MicroBatch();  // frees this micro-batch's activations
  trace_.push_back({stage_, i, Phase::kBackward, start, absl::Now()});
  return status;
}

}  // namespace fairscale::pipe
