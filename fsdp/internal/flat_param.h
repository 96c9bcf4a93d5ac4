// FlatParam: the storage layout of one FSDP unit's parameters (//fsdp, internal).
//
// The unit's original parameters (of one requires_grad kind) are laid out back to back in a
// padded 1-D buffer `full` of world * shard_numel elements; each rank keeps the contiguous slice
// [rank * shard_numel, (rank + 1) * shard_numel) as `shard`, the tensor the optimizer sees. The
// original parameter tensors (the ones the wrapped module's forward uses) are re-pointed, once,
// at their slice of `full` with set_data, so gathering or freeing the full parameter only
// changes what `full`'s storage holds: the parameters keep their identity, shape and autograd
// accumulator, and tensors autograd saved in forward see the re-gathered data in backward.
// Used by fully_sharded_data_parallel.cc only.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/work.h"

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
  // The parameter's AccumulateGrad node, kept alive so the post-backward hook stays attached.
  std::shared_ptr<torch::autograd::Node> grad_accumulator;
  uintptr_t hook_key = 0;
};

struct FlatParam {
  std::vector<ParamSlot> slots;
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
};

// Whether `t`'s storage currently holds memory (false after FreeStorage).
bool HasStorage(const at::Tensor& t);
// Gives the storage back to its allocator; `t` and every view of it keep their metadata and must
// not be read until AllocateStorage.
void FreeStorage(const at::Tensor& t);
// Re-allocates the storage (uninitialized) at the size `t` needs.
void AllocateStorage(const at::Tensor& t);

}  // namespace fairscale::fsdp::internal
