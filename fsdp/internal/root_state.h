// RootState: what all FSDP units of one model share, owned by the root (//fsdp, internal). In a
// header because the training path (fully_sharded_data_parallel.cc) and the state-dict code
// (local_state_dict.cc) both walk it.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "comm/work.h"

namespace fairscale::fsdp {
class FullyShardedDataParallelImpl;
}

namespace fairscale::fsdp::internal {

// A gradient reduction that is issued and not yet waited for.
struct PendingReduce {
  FullyShardedDataParallelImpl* unit;
  size_t flat;
  comm::Work work;
  at::Tensor send;  // kept alive until the Work completes
  at::Tensor recv;
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
};

}  // namespace fairscale::fsdp::internal
