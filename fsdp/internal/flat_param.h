// FlatParam: the storage layout of one FSDP unit's parameters (//fsdp, internal).
//
// The unit's original parameters (of one requires_grad kind) are laid out back to back in a
// padded 1-D buffer `full` of world * shard_numel elements; each rank keeps the contiguous slice
// [rank * shard_numel, (rank + 1) * shard_numel) as `shard`, the tensor the optimizer sees. The
// original parameter tensors (the ones the wrapped module's forward uses) are re-pointed, once,
// at their slice of `full` with set_data, so gathering or freeing the full parameter only
// changes what `full`'s storage holds: the parameters keep their identity, shape and autograd
// accumulator, and tensors autograd saved in forward see the re-gathered data in backward.
// Owned by a Unit (unit.h); the per-parameter layout's functions are in per_param.cc.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/work.h"
#include "deterministic/tree.h"

namespace torch::autograd {
struct Node;
}

namespace fairscale::fsdp::internal {

// One original parameter inside a FlatParam.
struct ParamSlot {
  std::string name;                  // relative to the unit's wrapped module: "fc1.weight"
  std::vector<std::string> aliases;  // further names of the same tensor (tied weights)
  at::Tensor param;                  // the wrapped module's parameter (same TensorImpl)
  std::vector<int64_t> shape;
  int64_t offset = 0;  // in `full`
  int64_t numel = 0;
  // Per-parameter layout (FlatParam::per_param): every rank holds rows_per_rank =
  // ceil(rows / world) rows of row_numel elements of this parameter (zero padding at the end
  // of the last ranks' rows) at [shard_offset, shard_offset + rows_per_rank * row_numel) of its
  // `shard`; `param` shows this rank's unpadded rows, shaped `local_shape`, between uses.
  int64_t shard_offset = 0;
  int64_t rank_numel = 0;  // rows_per_rank * row_numel
  std::vector<int64_t> local_shape;
  at::Tensor shard_grad;  // param's shard-shaped .grad, kept aside while param views `full`
  // Flat layout: whether this slot of FlatParam::full_grad holds a gradient yet (the buffer is
  // allocated uninitialized; a slot's first gradient is copied in, later ones added).
  bool grad_written = false;
  // With a local gradient hook on the root (local_grad_hook.h): the sum of squares (f64, 0-dim,
  // on the gradient's device) of this backward's incoming gradient; undefined if none came.
  at::Tensor local_sqr;
  // The parameter's AccumulateGrad node, kept alive so the post-backward hook stays attached.
  std::shared_ptr<torch::autograd::Node> grad_accumulator;
  uintptr_t hook_key = 0;
};

struct FlatParam {
  std::vector<ParamSlot> slots;
  // FsdpOptions::flatten_parameters(false): the per-parameter (dim-0) layout. `shard` is the
  // concatenation of this rank's rows of every parameter (see ParamSlot::shard_offset), and each
  // parameter tensor is re-pointed between its rows in `shard` (between steps: what the
  // optimizer steps) and its slice of `full` (the unpadded parameters back to back, in the
  // compute dtype, while the unit computes; see per_param.cc). The all-gather lands in
  // `gather_buf` (rank-major, padded_numel elements) and is copied out into `full`.
  bool per_param = false;
  bool full_views = false;  // per_param: the parameters currently view `full`
  at::Tensor gather_buf;
  bool requires_grad = false;
  int64_t numel = 0;         // sum of the slots' numels
  int64_t padded_numel = 0;  // world * shard_numel (kNoShard: numel)
  int64_t shard_numel = 0;
  int64_t shard_offset = 0;  // rank * shard_numel (kNoShard: 0)
  at::Tensor shard;          // the registered parameter (kNoShard: the same tensor as `full`)
  at::Tensor full;           // storage freed while resharded (never for kNoShard)
  // Mixed precision: `full` (and the parameters) are in the compute dtype, `shard` is the
  // master copy in the parameters' original dtype.
  bool mixed = false;
  // CPU offload (FsdpOptions::move_params_to_cpu with an accelerator compute device, or the
  // test hook below): `shard` (and its .grad) in CPU memory, `full` on the compute device.
  bool offloaded = false;
  // `full` does not share the master's storage (mixed or offloaded).
  bool separate = false;
  // kNoShard with mixed precision: `full` is a separate low-precision copy of the shard that the
  // next forward must refresh (set at the end of backward, when the optimizer is about to step).
  bool stale = false;
  at::ScalarType reduce_dtype = at::kFloat;
  // Unsharded (kNoShard, or world size 1), no mixed precision, reduction in the parameters'
  // dtype and divide factors that make the mean: the original parameters' .grad are views
  // into the shard's .grad (the flat gradient), so autograd accumulates there in place and the
  // all-reduce runs on it in place; no gradient is copied. (Accumulating across backward passes
  // without zero_grad stays right: the part already reduced is the same on every rank, and
  // the mean of equal values is that value.)
  bool grad_views = false;

  // All-gather into `full` that is issued but not yet waited for (prefetch).
  bool gather_pending = false;
  comm::Work gather_work;
  at::Tensor gather_send;  // the low-precision copy of the shard being sent (mixed precision)

  // Backward bookkeeping, reset at the end of every backward pass.
  at::Tensor full_grad;  // padded full gradient being assembled from the slots' grads
  int grads_ready = 0;   // slots whose AccumulateGrad fired in this backward
  bool reduced = false;  // the reduction of this backward is issued

  // Deterministic mode: this step's per-micro-batch full gradients, summed over the canonical
  // tree so far (reduced after the rank's last micro-batch of the step).
  deterministic::Accumulator det_acc;
};

// Test hook: makes move_params_to_cpu take the offloaded path (separate compute buffers, copies
// to the compute device and back) although the compute device is the CPU, so that path runs
// and can be checked on a CPU-only machine. Read when a unit is constructed.
void SetOffloadOnCpuForTesting(bool on);
bool OffloadOnCpuForTesting();

// Whether `t`'s storage currently holds memory (false after FreeStorage).
bool HasStorage(const at::Tensor& t);
// Gives the storage back to its allocator; `t` and every view of it keep their metadata and must
// not be read until AllocateStorage.
void FreeStorage(const at::Tensor& t);
// Re-allocates the storage (uninitialized) at the size `t` needs.
void AllocateStorage(const at::Tensor& t);

// The per-parameter layout (per_param.cc), over a shard world of `world` ranks. LayoutDim0 lays
// out `slots` in `fp` dim-0 sharded (this rank's rows in `shard`, `full` in the `compute` dtype,
// allocated only when unsharded or until the caller frees it) and points the parameters at
// `full`; SetDim0Views switches the parameters between their rows in `shard` and their full
// values in `full` (keeping the shard-shaped .grad aside meanwhile).
void LayoutDim0(FlatParam& fp, std::vector<ParamSlot>& slots, int world, int rank,
                at::ScalarType compute, bool sharded);
void SetDim0Views(FlatParam& fp, bool full);
// The per-parameter layout's data movement:
// copies the all-gathered `gather_buf` (rank-major) into `full` (parameters back to back) and
// releases it; adds one parameter's full gradient into the rank-major `full_grad` (allocated);
// adds this rank's reduced block `recv` into the parameters' shard-shaped gradients; copies
// this rank's rows of `full` back into `shard`.
void CopyOutGathered(FlatParam& fp, int world);
void AddDim0Grad(FlatParam& fp, const ParamSlot& slot, const at::Tensor& grad, int world);
void AccumulateDim0Grads(FlatParam& fp, const at::Tensor& recv);
void WritebackDim0(FlatParam& fp);
// The gradients the optimizer sees: the shard's .grad, or (per_param) each parameter's.
std::vector<at::Tensor> ShardGrads(const FlatParam& fp);

}  // namespace fairscale::fsdp::internal
