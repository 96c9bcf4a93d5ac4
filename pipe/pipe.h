// Pipeline parallelism across ranks (//pipe): FairScale's Pipe (GPipe) and PyTorch's
// Schedule1F1B for LibTorch, one stage per rank of a communicator.
//
// A torch::nn::Sequential is cut into `num_stages() == comm->size()` consecutive groups of
// layers (PipeOptions::balance, or an even split; see balance.h for automatic balances). Rank r
// keeps the layers of stage r. train_step() splits the batch into `chunks` micro-batches along
// dimension 0 (sizes differ by at most one), runs their forwards and backwards in the order of
// the schedule, moving activations forward and their gradients backward with the
// communicator's Send/Recv (any backend), computes the loss on the last stage from the targets
// the caller passes, and leaves the gradients accumulated in each stage's parameters (call your
// optimizer's zero_grad()/step() on parameters() as usual).
//
//   std::unique_ptr<Pipe> pipe =
//       Pipe::Create(model, comm, PipeOptions().balance({2, 3}).chunks(8));
//   auto opt = torch::optim::Adam(pipe->parameters(), 1e-3);
//   opt.zero_grad();
//   at::Tensor loss = pipe->train_step(x, y, [](auto& out, auto& y) {
//     return torch::mse_loss(out, y);
//   });   // x is read on stage 0, y on the last stage; every rank gets the mean loss
//   opt.step();
//
// Between stages travels what the boundary layer returns: an at::Tensor or a
// std::vector<at::Tensor> (a tuple), of any dtype the comm layer carries (f32 f64 f16 bf16 i8
// u8 i32 i64, and bool); the next stage's first layer receives the same C++ type. Shapes and
// dtypes need not be known in advance: they are sent in a small header when they change.
// Floating point activations that require grad get their gradient back.
//
// Gradient semantics: the backward pass is that of mean_i loss_fn(output_i, target_i) over the
// micro-batches, so with a mean-reduced loss and a batch divisible by `chunks` the gradients
// (and the returned loss) equal those of one un-pipelined step on the whole batch.
//
// Interleaved 1F1B (PipeOptions::virtual_stages(v) > 1 with Schedule::kInterleaved1F1B): the
// layers are cut into p * v virtual stages (balance has p * v entries); virtual stage c runs on
// rank c % p as its local chunk c / p, so rank r holds chunks r, r + p, ... and activations
// travel around the ranks v times (rank p - 1 sends back to rank 0 between rounds). Chunks
// (micro-batches) must be a multiple of p. The bubble shrinks v times (see schedule.h); each
// link between neighbouring ranks has its own two-rank communicators per direction, so a send
// never waits behind a receive and the order in schedule.h cannot deadlock.
//
// Skip connections (skip.h, FairScale's @skippable): a Skippable layer stashes a tensor that a
// later layer pops. Create / CreateForStage gather every rank's declarations, verify them
// (verify_skippables' errors, INVALID_ARGUMENT on every rank) and route each skip: it travels
// with the activations of its micro-batch through every stage between its stash and its pop
// (appended to the boundary tensors, StageImpl::skips_in / skips_out), and its gradient back.
//
// Deterministic mode (PipeOptions::deterministic, //deterministic): the same global batch gives
// bitwise the same losses, gradients and parameters at any number of stages (and, on a
// PipeGrid, of replicas); see PipeOptions::deterministic and README.md.
//
// Errors raise c10::Error, "<function>: <CODE>: <message>" (//base:torch_error; the code is
// absl's name, e.g. INVALID_ARGUMENT). train_step() is collective over the communicator. A stage
// that fails (a layer or the loss throws, a bad input, a comm error) aborts the pipe's
// communicators with
//   "pipe stage 1/4 (rank 1): forward of micro-batch 3: <what happened>"
// and raises e.g. "pipe::Pipe::train_step: INTERNAL: pipe stage 1/4 (rank 1): ..."; every other
// rank's train_step() raises an error containing that message within the timeout instead of
// hanging. A failed Pipe stays failed: later steps raise FAILED_PRECONDITION ("the pipe failed
// earlier: ..."), and failed() / error() say so. Configuration errors raise INVALID_ARGUMENT
// from Create() / CreateForStage() ("pipe::Pipe::Create (rank 0/2): INVALID_ARGUMENT: ...").
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "deterministic/tree.h"
#include "pipe/schedule.h"
#include "pipe/skip.h"

namespace fairscale::pipe {

namespace internal {
struct StepState;
}

// Which micro-batches run their stage forward under activation checkpointing (//checkpoint):
// only the stage's inputs are kept and the forward is recomputed in backward.
enum class CheckpointMode {
  kAlways,
  // All but the last micro-batch, whose backward follows soonest (FairScale's default).
  kExceptLast,
  kNever,
};
const char* CheckpointModeName(CheckpointMode mode);  // "always", "except_last", "never"

// This stage's layers as one module, what PipeOptions::wrap_stage receives. forward() runs the
// layers in order on one micro-batch: the first layer gets `inputs[0]` (an at::Tensor) or, with
// `list_input`, `inputs` (a std::vector<at::Tensor>); the last layer's at::Tensor or
// std::vector<at::Tensor> comes back as a list, and output_is_list() says which it was. The
// layers are registered under their names in the stage's Sequential ("3", "4", ...), so a
// wrapper's named_parameters() uses the full model's names.
//
// Skip connections (skip.h): the inputs end with one tensor per skips_in() (skips stashed on an
// earlier stage that this stage pops or passes on) and the outputs end with one per skips_out()
// (skips stashed here or earlier that a later stage pops). forward() runs the layers on a
// SkipTracker of its own holding the incoming skips, with the per-layer checks (a Skippable
// layer must stash and pop every name it declares); a pass-through skip is returned unchanged.
class StageImpl : public torch::nn::Module {
 public:
  StageImpl(torch::nn::Sequential layers, int64_t first_layer, std::vector<SkipId> skips_in = {},
            std::vector<SkipId> skips_out = {});
  std::vector<at::Tensor> forward(std::vector<at::Tensor> inputs, bool list_input);
  bool output_is_list() const { return output_is_list_; }
  const torch::nn::Sequential& layers() const { return layers_; }
  const std::vector<SkipId>& skips_in() const { return skips_in_; }
  const std::vector<SkipId>& skips_out() const { return skips_out_; }

 private:
  torch::nn::Sequential layers_;
  int64_t first_layer_;
  std::vector<SkipId> skips_in_;
  std::vector<SkipId> skips_out_;
  std::vector<std::string> names_;        // per layer
  std::vector<Skippable*> skippables_;    // per layer, nullptr if it is not one
  bool output_is_list_ = false;
};
TORCH_MODULE(Stage);

// What a PipeOptions::wrap_stage hook returns: `module` owns the parameters the optimizer steps
// (Pipe::parameters() is module->parameters()), and the pipe calls `forward` (same arguments and
// result as StageImpl::forward) for every forward of a micro-batch, including the recompute of
// a checkpointed one inside backward. E.g. FSDP inside a stage (fsdp_stage.h):
//   fsdp::FullyShardedDataParallel w(stage, grid.data, fsdp_options);
//   return WrappedStage{w.ptr(), [w](std::vector<at::Tensor> xs, bool list) mutable {
//     return w->forward<std::vector<at::Tensor>>(std::move(xs), list);
//   }};
//
// `before_backward` (optional) runs before each micro-batch's backward on this stage, with
// `last` true for the step's last one here: e.g. fsdp_stage's reduce_once_per_step holds FSDP's
// no_sync() over all but the last, so the gradients are reduced once per step.
struct WrappedStage {
  std::shared_ptr<torch::nn::Module> module;
  std::function<std::vector<at::Tensor>(std::vector<at::Tensor>, bool)> forward;
  std::function<void(bool last)> before_backward;
};
using WrapStageFn = std::function<WrappedStage(Stage stage)>;

struct PipeOptions {
  // Layers per stage, one entry per rank (per virtual stage: p * v entries, virtual stage c on
  // rank c % p), each >= 1, summing to the number of layers. Empty: as even as possible by
  // layer count (the first stages get the extra layers).
  TORCH_ARG(std::vector<int64_t>, balance) = {};
  // Micro-batches per train_step; the batch must have at least this many rows. With
  // virtual_stages > 1 a multiple of the number of ranks.
  TORCH_ARG(int64_t, chunks) = 1;
  TORCH_ARG(Schedule, schedule) = Schedule::k1F1B;
  // Model chunks per rank (v >= 1); v > 1 needs Schedule::kInterleaved1F1B. 1: one stage per
  // rank (kInterleaved1F1B then runs exactly k1F1B).
  TORCH_ARG(int64_t, virtual_stages) = 1;
  TORCH_ARG(CheckpointMode, checkpoint) = CheckpointMode::kExceptLast;
  // Longest wait for one message from a neighbouring stage (it must cover the other stages'
  // compute between two messages: with GPipe, stage 0 waits for a whole forward phase).
  // Zero: the communicator's default timeout.
  TORCH_ARG(absl::Duration, timeout) = absl::ZeroDuration();
  // Called once by Create / CreateForStage with this rank's stage (after the split, before any
  // step) to wrap it, e.g. in FSDP over the ranks that hold the same stage (fsdp_stage.h).
  // Unset: the pipe runs the layers itself and parameters() are theirs.
  // Only with virtual_stages == 1 (INVALID_ARGUMENT otherwise).
  // Not supported (yet) with deterministic(true): Create raises INVALID_ARGUMENT.
  TORCH_ARG(WrapStageFn, wrap_stage) = nullptr;
  // Deterministic mode (issue 22): the step's losses, gradients and (after the optimizer)
  // parameters are bitwise the same whatever the number of stages, the virtual stages and the
  // schedule, and on a PipeGrid whatever the number of replicas, for the same model, global
  // batch and global micro-batch count M. The batch must split into `chunks` equal micro-batches
  // (INVALID_ARGUMENT otherwise). Each micro-batch's gradient of this rank's parameters is
  // captured on its own (the loss is not scaled by 1/chunks before backward) and summed over
  // the canonical micro-batch tree (deterministic/tree.h), then divided by M: train_step SETS
  // each parameter's gradient to that (it does not accumulate into what was there). The
  // returned loss is the tree mean of the micro-batch losses. With replicas() > 1 the gradients
  // are left undefined by train_step and set by all_reduce_gradients(Pipe&, ...) (grid.h), which
  // must follow every train_step. Every rank of the pipe's communicator must use the same mode
  // and M (checked at construction, one 32-byte all-gather in either mode); needs
  // at::set_num_threads(1) (checked at construction). Parameters shared between layers of this
  // rank are not supported (INVALID_ARGUMENT).
  TORCH_ARG(bool, deterministic) = false;
  // Pipe x data parallel in deterministic mode (read only there): this pipe is replica
  // `replica` of `replicas` (PipeGrid::replica / replicas) and computes the global
  // micro-batches [replica * chunks, (replica + 1) * chunks) of M = replicas * chunks.
  TORCH_ARG(int64_t, replica) = 0;
  TORCH_ARG(int64_t, replicas) = 1;
};

// loss_fn(output of the last layer for one micro-batch, its rows of the target) -> a scalar.
using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

// One forward or backward of one micro-batch on this stage, as it ran.
struct PipeEvent {
  int64_t stage = 0;
  int64_t micro_batch = 0;
  Phase phase = Phase::kForward;
  absl::Time start;  // compute only: waiting for a neighbour is outside [start, end)
  absl::Time end;
  int64_t chunk = 0;  // local model chunk: virtual stage chunk * num_stages() + stage
};

class Pipe {
 public:
  // `model` is the whole model (the same on every rank); this rank keeps its stage's layers,
  // registered under their names in `model` (so stage_module()->named_parameters() uses the
  // full model's names). Collective (splits `comm` into the pipe's own communicators). Raises
  // c10::Error on a bad configuration (on every rank) or a failed split.
  static std::unique_ptr<Pipe> Create(torch::nn::Sequential model,
                                      std::shared_ptr<comm::Communicator> comm,
                                      PipeOptions options = {});
  // For models too large to build whole on every rank: `stage_layers` are this rank's layers
  // only (with virtual stages, those of its chunks in chunk order; a balance is then required).
  // With a balance, this rank's entries must sum to their count and the layers are renamed to
  // their global indices ("5", "6", ...); without one they keep their names.
  static std::unique_ptr<Pipe> CreateForStage(torch::nn::Sequential stage_layers,
                                              std::shared_ptr<comm::Communicator> comm,
                                              PipeOptions options = {});

  ~Pipe();
  Pipe(const Pipe&) = delete;
  Pipe& operator=(const Pipe&) = delete;

  // One forward + backward over `chunks` micro-batches (collective). `input` is read on stage 0
  // (ignored elsewhere; pass an undefined tensor; it is used detached: no gradient flows back
  // into it), `target` on the last stage. Returns the mean
  // micro-batch loss (detached, 0-dim, the loss's dtype converted through double) on every
  // rank. Gradients accumulate into parameters() (deterministic mode: they are set, and the
  // loss is the tree mean; see PipeOptions::deterministic). Raises c10::Error (see Errors above).
  at::Tensor train_step(const at::Tensor& input, const at::Tensor& target, const LossFn& loss_fn);
  // The same with a list input: stage 0's first layer receives a std::vector<at::Tensor> (each
  // tensor split along dimension 0).
  at::Tensor train_step(const std::vector<at::Tensor>& inputs, const at::Tensor& target,
                        const LossFn& loss_fn);

  // Forwards only (no grad, no checkpointing, no activations kept), same batch split, loss and
  // errors as train_step: the mean micro-batch loss on every rank, e.g. for validation.
  at::Tensor eval_step(const at::Tensor& input, const at::Tensor& target, const LossFn& loss_fn);
  at::Tensor eval_step(const std::vector<at::Tensor>& inputs, const at::Tensor& target,
                       const LossFn& loss_fn);

  int64_t stage() const { return stage_; }
  int64_t num_stages() const { return num_stages_; }
  int64_t virtual_stages() const { return static_cast<int64_t>(chunk_stages_.size()); }
  // Global index of this stage's first layer (of chunk 0), and its layer count (all chunks).
  int64_t first_layer() const { return chunk_first_.at(0); }
  int64_t num_layers() const;
  const std::vector<int64_t>& balance() const { return balance_; }
  const PipeOptions& options() const { return options_; }

  // All of this rank's layers (every chunk), under their names in the full model (with
  // wrap_stage: the wrapped module's layers, whose parameters may be views the wrapper manages,
  // e.g. FSDP's freed full parameters between steps).
  torch::nn::Sequential stage_module() const { return layers_; }
  // Local chunk `chunk` (virtual stage chunk * num_stages() + stage()) and its first layer.
  torch::nn::Sequential chunk_module(int64_t chunk) const {
    return chunk_stages_.at(chunk)->layers();
  }
  int64_t chunk_first_layer(int64_t chunk) const { return chunk_first_.at(chunk); }
  // The wrapper's module with wrap_stage, otherwise the stage's layers (as a Stage; with
  // virtual stages, stage_module()).
  std::shared_ptr<torch::nn::Module> module() const { return module_; }
  // What the optimizer steps: module()->parameters() (FSDP: this rank's shards).
  std::vector<at::Tensor> parameters() const;

  // The forwards and backwards of the last train_step (or eval_step), in the order they ran.
  const std::vector<PipeEvent>& trace() const { return trace_; }
  // Whether a step failed (the pipe is then unusable), and that failure as "<CODE>: <message>"
  // ("" while not failed).
  bool failed() const { return !broken_.ok(); }
  std::string error() const { return broken_.ok() ? std::string() : broken_.ToString(); }

  // Deterministic mode: the last train_step's (or eval_step's) micro-batch losses, in
  // micro-batch order (chunks of them), on every rank. Empty in the default mode.
  const std::vector<double>& micro_batch_losses() const { return micro_batch_losses_; }

 private:
  // grid.h: reduces the partial sums train_step keeps with replicas > 1.
  friend at::Tensor all_reduce_gradients(Pipe& pipe, comm::Communicator& data);
  Pipe() = default;
  // Create / CreateForStage without the conversion to c10::Error.
  static absl::StatusOr<std::unique_ptr<Pipe>> Build(torch::nn::Sequential model,
                                                     std::shared_ptr<comm::Communicator> comm,
                                                     PipeOptions options);
  static absl::StatusOr<std::unique_ptr<Pipe>> BuildForStage(
      torch::nn::Sequential stage_layers, std::shared_ptr<comm::Communicator> comm,
      PipeOptions options);
  // `chunks[j]` holds local chunk j's layers, its first global layer index in `firsts[j]`.
  static absl::StatusOr<std::unique_ptr<Pipe>> Make(std::vector<torch::nn::Sequential> chunks,
                                                    std::vector<int64_t> firsts,
                                                    std::shared_ptr<comm::Communicator> comm,
                                                    PipeOptions options,
                                                    std::vector<int64_t> balance);
  absl::Status Connect(const comm::OpOptions& op);
  absl::StatusOr<at::Tensor> Step(const std::vector<at::Tensor>& inputs, bool is_list,
                                  const at::Tensor& target, const LossFn& loss_fn, bool train);
  absl::Status Forward(internal::StepState& st, const Action& a);
  absl::Status Backward(internal::StepState& st, const Action& a);
  int64_t VirtualStage(const Action& a) const { return a.chunk * num_stages_ + stage_; }
  int64_t LastVirtualStage() const { return num_stages_ * virtual_stages() - 1; }
  // "pipe stage 1/4 (rank 1)"
  std::string Name() const;
  // A virtual stage in messages: "stage 2", or "virtual stage 5 (rank 1)".
  std::string Describe(int64_t virtual_stage) const;
  absl::Status Fail(absl::Status status);
  // Deterministic mode: checks at construction; before a step (the batch split, the gradients
  // moved aside); after each backward (that micro-batch's gradients into the accumulators);
  // after the step (the gradients set, or the partial sums kept for all_reduce_gradients).
  absl::Status SetUpDeterministic();
  absl::Status BeginDeterministicStep(const std::vector<at::Tensor>& inputs,
                                      const at::Tensor& target, bool train);
  void CaptureGradients(const Action& a);
  void EndDeterministicStep();

  // Declared first, destroyed last: buffers of failed operations that the communicators below
  // may still touch, and the links that point at those communicators.
  std::vector<at::Tensor> orphans_;
  struct Links;
  std::unique_ptr<Links> links_;
  std::shared_ptr<comm::Communicator> comm_;
  // The pipe's own communicators (split from comm_): the loss broadcast on ctl_, and per link
  // between neighbouring ranks and direction a two-rank one (in Links) on which one rank only
  // sends and the other only receives, so a pending send never holds up a receive (each
  // communicator runs its operations in issue order).
  std::shared_ptr<comm::Communicator> ctl_;
  PipeOptions options_;
  absl::Duration timeout_;
  int64_t stage_ = 0;
  int64_t num_stages_ = 1;
  std::vector<int64_t> balance_;
  torch::nn::Sequential layers_{nullptr};
  // One Stage per local chunk (one without virtual stages), the module() and the forward of
  // each chunk (wrap_stage's, or the Stage's).
  std::vector<Stage> chunk_stages_;
  std::vector<int64_t> chunk_first_;
  std::shared_ptr<torch::nn::Module> module_;
  std::vector<std::function<std::vector<at::Tensor>(std::vector<at::Tensor>, bool)>> forwards_;
  std::function<void(bool last)> before_backward_;  // WrappedStage::before_backward
  std::vector<PipeEvent> trace_;
  // Deterministic mode: each local chunk's parameters, their accumulators during a step (same
  // indices), the gradient tensors found at the step's start (reused as storage), and with
  // replicas > 1 the partial sums of the last step awaiting all_reduce_gradients (indexed like
  // parameters(), which lists the chunks' parameters in chunk order).
  std::vector<std::vector<at::Tensor>> chunk_params_;
  std::vector<std::vector<deterministic::Accumulator>> accumulators_;
  std::vector<std::vector<at::Tensor>> grad_storage_;
  std::vector<std::vector<deterministic::Partial>> pending_;
  std::vector<double> micro_batch_losses_;
  c10::ScalarType loss_dtype_ = c10::ScalarType::Float;  // of the last step's loss
  absl::Status broken_;
  std::string doing_;  // the action running now, for error messages
};

}  // namespace fairscale::pipe
