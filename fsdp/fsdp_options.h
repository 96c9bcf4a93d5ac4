// FsdpOptions: the knobs of fsdp::FullyShardedDataParallel (//fsdp), written like LibTorch's
// options structs so that a user who knows torch::nn::LinearOptions can guess them:
//
//   auto opts = fsdp::FsdpOptions()
//                   .sharding_strategy(fsdp::ShardingStrategy::kShardGradOp)
//                   .gradient_predivide_factor(2.0);
//
// Semantics follow FairScale's FullyShardedDataParallel and PyTorch's FSDP (its
// ShardingStrategy, MixedPrecision and CPUOffload); the differences are stated here.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "comm/communicator.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace fairscale::fsdp {

// How a wrapped unit keeps its parameters between uses.
enum class ShardingStrategy {
  // ZeRO-3: each rank keeps 1/N of the flat parameter; the full parameter is all-gathered before
  // forward, freed after forward, all-gathered again before backward; gradients are
  // reduce-scattered. Comm per step: 3x the parameter bytes (2 all-gathers + 1 reduce-scatter).
  kFullShard,
  // ZeRO-2: like kFullShard, but the full parameter is kept from forward until the end of this
  // unit's backward. Comm per step: 2x the parameter bytes.
  kShardGradOp,
  // Plain data parallel: every rank keeps the whole parameter; gradients are all-reduced.
  kNoShard,
  // HYBRID_SHARD: kFullShard inside a shard group (a sub-group of the ranks, see
  // FsdpOptions::hybrid_shard_group_size), replicated across the groups: parameters are
  // all-gathered inside the shard group only; gradients are reduce-scattered inside it, then
  // this rank's reduced shard is all-reduced with the ranks holding the same shard in the other
  // groups (the replicate group). Comm per step: 3x the parameter bytes inside the group plus
  // one all-reduce of the shard across groups. With a group of the whole world it is
  // kFullShard; with groups of one rank, kNoShard.
  kHybridShard,
  // PyTorch's _HYBRID_SHARD_ZERO2: kShardGradOp inside the shard group, replicated across.
  kHybridShardZero2,
};

// "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2".
const char* ShardingStrategyName(ShardingStrategy strategy);
// Whether `strategy` shards inside sub-groups and replicates across them.
inline bool IsHybrid(ShardingStrategy strategy) {
  return strategy == ShardingStrategy::kHybridShard ||
         strategy == ShardingStrategy::kHybridShardZero2;
}

// When backward prefetches the next unit's all-gather (FsdpOptions::backward_prefetch).
enum class BackwardPrefetch {
  kNone,
  kBackwardPre,   // PyTorch's BACKWARD_PRE: before this unit's gradient is computed
  kBackwardPost,  // PyTorch's BACKWARD_POST: after it
};

const char* BackwardPrefetchName(BackwardPrefetch mode);  // "NONE", "BACKWARD_PRE", ...

// FairScale's automatic gradient pre-divide factor, about sqrt(world): starting from 1, it
// doubles while it divides `world_size` and stays below world_size / factor. E.g. 1 -> 1,
// 2 -> 2, 3 -> 2, 4 -> 2, 6 -> 4, 8 -> 4, 16 -> 4, 32 -> 8.
double default_gradient_predivide_factor(int world_size);

// Mixed precision (FairScale's mixed_precision + compute_dtype + buffer_dtype +
// fp32_reduce_scatter, in PyTorch FSDP's shape). The shard the optimizer steps stays in the
// parameters' own dtype (the f32 master copy); the full parameters, the computation and the
// all-gathers use `param_dtype`; gradients are reduced in `reduce_dtype` and added to the f32
// shard's grad. Floating-point tensor arguments of forward are cast to `param_dtype`; outputs
// stay in it. Unset fields: no mixed precision / reduce in param_dtype / buffers untouched.
struct MixedPrecision {
  TORCH_ARG(c10::optional<c10::ScalarType>, param_dtype) = c10::nullopt;
  TORCH_ARG(c10::optional<c10::ScalarType>, reduce_dtype) = c10::nullopt;
  TORCH_ARG(c10::optional<c10::ScalarType>, buffer_dtype) = c10::nullopt;
};

struct FsdpOptions {
  // See ShardingStrategy. Default: kFullShard (FairScale's reshard_after_forward=True).
  TORCH_ARG(ShardingStrategy, sharding_strategy) = ShardingStrategy::kFullShard;

  // The root unit's parameters are the first ones backward needs, so with kFullShard the root
  // keeps them after forward instead of freeing and re-gathering them at once (FairScale's
  // default). Set false when the root's backward does not follow its forward directly.
  TORCH_ARG(bool, disable_reshard_on_root) = true;

  // Gradients are divided by `gradient_predivide_factor` before the reduction and by
  // `gradient_postdivide_factor` after it; together they must make the mean over ranks.
  // Dividing part of the way before the sum keeps low-precision reductions from overflowing
  // and the rest after it from underflowing. 0 (the default for both) means FairScale's
  // automatic choice: pre = default_gradient_predivide_factor(world), post = world / pre.
  // With only post set, pre is 1; with only pre set, post = world / pre.
  TORCH_ARG(double, gradient_predivide_factor) = 0.0;
  TORCH_ARG(double, gradient_postdivide_factor) = 0.0;

  // Every rank must start from the same parameters (each rank then trains the same model).
  // Construction checks that: it hashes each parameter of the unit (shape and bytes) and
  // compares the hashes across ranks (one all-gather of 16 bytes per parameter), and raises
  // c10::Error naming the first parameter that differs and the ranks that disagree, on every
  // rank, before anything is sharded. sync_module_states(true) (PyTorch's
  // sync_module_states=True) broadcasts rank 0's parameters instead, for ranks that initialize
  // differently (different seeds, or only rank 0 loads a checkpoint). Shapes must agree either
  // way. Buffers are always broadcast from rank 0 (FairScale's behaviour), so they cannot
  // differ.
  TORCH_ARG(bool, sync_module_states) = false;

  // Overlap communication with compute: while one unit computes, the all-gather of the unit
  // that comes next (in the order recorded during the first iteration) is already running.
  // Both assume every rank runs the same units in the same order, as all collectives do.
  TORCH_ARG(bool, forward_prefetch) = true;

  // Gradient bucketing, FairScale's bucket_cap_mb: the reduce-scatters of flat parameters
  // whose padded gradient is at most this many MiB are batched into one operation of up to this
  // size (in backward order, across units, one bucket per model; the cap of the unit being
  // added applies); larger ones bypass the bucket. A bucket is sent when the next gradient would
  // overflow it and at the end of backward, so small units trade overlap for fewer operations.
  // 0 (the default here; FairScale's is 25) disables it. Sharded strategies only: kNoShard
  // all-reduces each flat parameter.
  TORCH_ARG(double, bucket_cap_mb) = 0.0;

  // See MixedPrecision. Default: everything in the parameters' dtype.
  TORCH_ARG(MixedPrecision, mixed_precision) = {};

  // FairScale's flatten_parameters. true (the default): a unit's parameters are flattened into
  // one flat parameter per requires_grad kind, which is what the wrapper registers and the
  // optimizer steps ("flat_param"). false: the per-parameter layout of PyTorch's FSDP2
  // (fully_shard): the wrapper registers the wrapped module's own parameter tensors under their
  // own names, and between steps each holds this rank's rows of its dim 0 (ceil(rows / world)
  // rows per rank, fewer or none on the last ranks; a 0-dim parameter counts as one row and
  // is shaped [1] or [0]), with .grad of the same shape after backward. So an optimizer built
  // from model->named_parameters() can put parameters in different param groups (e.g. no weight
  // decay on biases) and frozen parameters (requires_grad false) may sit next to trainable
  // ones. Each unit still all-gathers (and reduce-scatters) its parameters with one collective
  // per requires_grad kind, through a staging buffer (one extra copy each way). Every unit of a
  // model must use the same value. See fsdp/README.md.
  TORCH_ARG(bool, flatten_parameters) = true;

  // The shard groups of kHybridShard / kHybridShardZero2 (rejected with other strategies):
  //   hybrid_shard_group_size(g) > 0: groups of g consecutive ranks ([0, g), [g, 2g), ...);
  //     g must divide the world size. Rank r's replicate group is {r mod g + k * g}.
  //   0 (the default): one group per host. The ranks exchange their host names (gethostname)
  //     through the communicator at construction; every host must run the same number of
  //     ranks. No environment variable is read.
  //   hybrid_shard_groups(shard, replicate): the user's communicators (PyTorch's
  //     process_group=(shard_pg, replicate_pg)), each a Split of the model's communicator:
  //     shard->size() * replicate->size() must be the world size, and the ranks of a replicate
  //     group must hold the same shard (same shard->rank()); checked at construction.
  // The groups are made with Communicator::Split (collective, two per choice). Units built over
  // the same communicator with the same group size (or by host) share them: the first unit
  // splits, the others reuse its communicators, which live as long as some unit uses them.
  TORCH_ARG(int, hybrid_shard_group_size) = 0;

  // CPU offload (FairScale's move_params_to_cpu / move_grads_to_cpu, PyTorch's
  // CPUOffload(offload_params=true)) for compute on an accelerator: the f32 shards the optimizer
  // steps (and its state) stay in CPU memory (pinned when LibTorch has CUDA), while the
  // full parameters and the computation live on `compute_device`. Each all-gather first copies
  // the shard to the compute device (cast to param_dtype there) and gathers into device
  // buffers; gradients are reduced on the compute device and the reduced gradient shard is
  // copied to the CPU shard's .grad (synchronously), for a CPU optimizer step.
  //   move_grads_to_cpu: unset = move_params_to_cpu (FairScale's default); a different value is
  //     rejected: the optimizer steps the shard where it lives, so its gradient must live there.
  //   compute_device: unset = where the module's parameters are. Without move_params_to_cpu it
  //     must be that device. A CUDA device needs LibTorch with CUDA and a GPU.
  // With the compute device on the CPU (any CPU-only build) the options are validated and
  // change nothing: the shards are already in CPU memory, results are bitwise the same.
  // The communicator must accept buffers on the compute device (and, for the state-dict and
  // checkpoint functions, which gather the CPU master shards, on the CPU).
  TORCH_ARG(bool, move_params_to_cpu) = false;
  TORCH_ARG(c10::optional<c10::Device>, compute_device) = c10::nullopt;

 public:
  FsdpOptions& move_grads_to_cpu(bool on) {
    move_grads_to_cpu_ = on;
    return *this;
  }
  // The effective value: move_params_to_cpu() unless set.
  bool move_grads_to_cpu() const noexcept { return move_grads_to_cpu_.value_or(move_params_to_cpu()); }
  bool move_grads_to_cpu_set() const noexcept { return move_grads_to_cpu_.has_value(); }

 public:
  FsdpOptions& hybrid_shard_groups(std::shared_ptr<comm::Communicator> shard,
                                   std::shared_ptr<comm::Communicator> replicate) {
    hybrid_shard_comm_ = std::move(shard);
    hybrid_replicate_comm_ = std::move(replicate);
    return *this;
  }
  const std::shared_ptr<comm::Communicator>& hybrid_shard_comm() const noexcept {
    return hybrid_shard_comm_;
  }
  const std::shared_ptr<comm::Communicator>& hybrid_replicate_comm() const noexcept {
    return hybrid_replicate_comm_;
  }

  // When, in backward, the all-gather of the unit whose backward comes next (in the order
  // recorded during the first iteration) is issued. PyTorch FSDP's BackwardPrefetch:
  //   kBackwardPre (the default; BACKWARD_PRE): when this unit's backward starts, before its
  //     gradient is computed, so the gather overlaps this unit's compute; peak: this unit's and
  //     the next unit's full parameters (plus this unit's full gradient) alive at once.
  //   kBackwardPost (BACKWARD_POST): once this unit's gradient is complete and its full
  //     parameters are freed, before its gradient reduction is issued; overlaps the reduction
  //     only, without the extra unit of full parameters.
  //   kNone: each unit gathers when its own backward starts.
  // A unit whose backward already ran in this iteration is never prefetched.
  // backward_prefetch(bool) is kept for older code: true = kBackwardPre, false = kNone.
 public:
  FsdpOptions& backward_prefetch(BackwardPrefetch mode) {
    backward_prefetch_ = mode;
    return *this;
  }
  FsdpOptions& backward_prefetch(bool enabled) {
    backward_prefetch_ = enabled ? BackwardPrefetch::kBackwardPre : BackwardPrefetch::kNone;
    return *this;
  }
  BackwardPrefetch backward_prefetch() const noexcept { return backward_prefetch_; }

  // The most all-gathers (one per flat parameter) that may be in flight at once on a rank:
  // issued and not yet waited for by the unit that computes with them. PyTorch FSDP's
  // limit_all_gathers (which, when on, allows 2). When a gather (the unit's own or a prefetch)
  // would exceed it, the oldest in-flight gathers are waited for first (blocking the caller, as
  // PyTorch's rate limiter does), so a prefetch still overlaps the next compute with limit 1; a
  // unit with more flat parameters than the limit issues them once nothing else is in flight.
  // 0 (the default): unlimited. Must be >= 0.
  TORCH_ARG(int, all_gathers_in_flight) = 0;

  // How many gradient reductions may still be running when a unit starts assembling its next
  // full gradient in backward. 1 (the default): a unit's reduce-scatter overlaps the next unit's
  // backward, at the cost of one more full gradient (the unit's size) alive. 0: the previous
  // reduction is waited for first, which with backward_prefetch(false) keeps a rank at one
  // unit's full parameters plus one full gradient at any time: the lowest peak, for memory-bound
  // jobs (see fsdp/bench/README.md for the trade-off measured). Must be >= 0.
  TORCH_ARG(int, reductions_in_flight) = 1;

  // Deterministic mode (//deterministic, see fsdp/README.md): the same global batch gives
  // bitwise the same gradients, losses and parameters at any world size that divides
  // `micro_batches`, for every strategy and both layouts. A step's global batch is cut into
  // `micro_batches` (M) micro-batches of a fixed size; rank r of W runs the contiguous block
  // [r * M/W, (r+1) * M/W) in that order, one forward and one backward each, with the
  // micro-batch's own loss (do not divide it by the number of micro-batches: FSDP does). Each
  // rank sums its micro-batches' gradients over a fixed binary tree of the micro-batch index
  // (deterministic/tree.h); after this rank's M/W-th backward the partial sums are reduced over
  // that tree (an all-to-all of partial sums instead of a reduce-scatter, the same bytes when W
  // and M/W are powers of two) and divided by M into the shards' .grad. no_sync() is optional
  // (the reduction comes after the M/W-th backward either way) but must not cover it.
  // clip_grad_norm_ sums squares exactly (order independent). Needs at::set_num_threads(1)
  // (LibTorch's CPU reductions split by thread count) and the same options on every rank
  // (both checked at construction, with clear errors, as is W dividing M). The divide factors,
  // bucket_cap_mb and reductions_in_flight do not apply: each flat parameter is reduced
  // synchronously at the end of the step's last backward. Default off.
  TORCH_ARG(bool, deterministic) = false;
  // Deterministic mode: micro-batches per optimizer step over all ranks (M above); >= 1.
  TORCH_ARG(int64_t, micro_batches) = 0;

 public:
  // PyTorch FSDP's ignored_modules: submodules (with everything below them) whose parameters and
  // buffers FSDP leaves alone, e.g. the rank-local experts of a mixture-of-experts layer (expert
  // parallelism: each rank holds different experts). Their parameters stay ordinary parameters
  // of their modules (same tensors, dtype and device; no mixed-precision cast); autograd
  // accumulates their .grad as usual and FSDP never reduces, divides, casts or frees it. They may
  // differ in shape and value across ranks: they are not flattened, sharded, gathered,
  // broadcast or compared by sync_module_states / the construction check, and neither are the
  // ignored modules' buffers. They are left out of the wrapper's parameters() (both layouts; so
  // an optimizer built over it does not step them: step them with your own, e.g. over
  // FullyShardedDataParallelImpl::ignored_parameters()), of clip_grad_norm_ (combine your own
  // norm of them with the returned one), and of every state dict and checkpoint (full, sharded,
  // local; loading never asks for them: save them yourself). A parameter shared with a module
  // that is not ignored is ignored too.
  // Each must be a submodule of the wrapped module (not the wrapped module itself), else
  // construction raises c10::Error naming it. Nesting: an ignored module inside a nested unit
  // must be ignored by that unit as well (checked by the parent); fsdp::wrap() hands each unit
  // it creates the scope's ignored modules that lie inside it, and never wraps an ignored
  // module itself, so pass the same list to EnableWrap and to the root (and so make the ignored
  // modules before the model whose constructor calls wrap()). Default: none.
  FsdpOptions& ignored_modules(std::vector<std::shared_ptr<torch::nn::Module>> modules) {
    ignored_modules_ = std::move(modules);
    return *this;
  }
  const std::vector<std::shared_ptr<torch::nn::Module>>& ignored_modules() const noexcept {
    return ignored_modules_;
  }

 private:
  BackwardPrefetch backward_prefetch_ = BackwardPrefetch::kBackwardPre;
  std::shared_ptr<comm::Communicator> hybrid_shard_comm_;
  std::shared_ptr<comm::Communicator> hybrid_replicate_comm_;
  c10::optional<bool> move_grads_to_cpu_;
  std::vector<std::shared_ptr<torch::nn::Module>> ignored_modules_;
};

}  // namespace fairscale::fsdp
