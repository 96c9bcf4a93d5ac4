// RootState: what all FSDP units of one model share, owned by the root (//fsdp, internal). In a
// header because the training path (fully_sharded_data_parallel.cc) and the state-dict code
// (local_state_dict.cc) both walk it.
#pragma once

#include <ATen/core/Tensor.h>

#include <deque>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "comm/work.h"

namespace fairscale::fsdp {
class FullyShardedDataParallelImpl;
}

namespace fairscale::fsdp::internal {

// Where one flat parameter's reduced gradient lands in a reduction's `recv`.
struct ReducePart {
  FullyShardedDataParallelImpl* unit;
  size_t flat;
  int64_t offset = 0;  // in recv
};

// A gradient reduction that is issued and not yet waited for: one flat parameter, or a bucket
// of several (bucket_cap_mb).
struct PendingReduce {
  std::vector<ReducePart> parts;
  comm::Work work;
  at::Tensor send;  // kept alive until the Work completes
  at::Tensor recv;  // reduce-scatter: this rank's block of `send` (in place)
  // All-reduce in place on the shard's .grad (FlatParam::grad_views): nothing to add.
  bool in_place_grad = false;
  // HYBRID_SHARD: once the reduce-scatter inside the shard group is done, `recv` is
  // all-reduced in place over this replicate group (null: nothing more to do).
  std::shared_ptr<comm::Communicator> replicate;
};

// Padded full gradients waiting to be reduce-scattered together in one operation (all of units
// with the same shard group).
struct GradBucket {
  std::vector<ReducePart> parts;
  std::vector<at::Tensor> sends;  // each [shard group size * shard_numel]
  int64_t bytes = 0;
  int64_t numel = 0;  // per rank: the sum of the parts' shard_numel
};

// State shared by all units of one model, owned by the root.
struct RootState {
  FullyShardedDataParallelImpl* root = nullptr;
  std::vector<FullyShardedDataParallelImpl*> units;  // parents before children
  // Orders in which the units' forwards / pre-backward hooks ran in the first iteration; the
  // prefetches of later iterations follow them.
  std::vector<FullyShardedDataParallelImpl*> forward_order;
  std::vector<FullyShardedDataParallelImpl*> backward_order;
  bool forward_order_done = false;
  bool backward_order_done = false;
  bool backward_active = false;  // finalize_backward is queued on the engine
  bool no_sync = false;
  std::vector<PendingReduce> pending;
  GradBucket bucket;
  // All-gathers issued and not yet waited for (FsdpOptions::all_gathers_in_flight), and the
  // units that issued them, oldest first (a unit once per issue_gathers call).
  int gathers_in_flight = 0;
  std::deque<FullyShardedDataParallelImpl*> gathering;
};

}  // namespace fairscale::fsdp::internal
