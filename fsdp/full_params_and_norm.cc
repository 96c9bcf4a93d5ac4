// FullyShardedDataParallel's methods outside the training path: no_sync, clip_grad_norm_ and
// summon_full_params (kept apart from fully_sharded_data_parallel.cc, which holds forward,
// backward and their communication).
#include <ATen/ops/scalar_tensor.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/internal/errors.h"
#include "fsdp/internal/flat_param.h"
#include "fsdp/internal/root_state.h"

namespace fairscale::fsdp {

using internal::FlatParam;
using internal::ThrowIfError;

FullyShardedDataParallelImpl::NoSyncGuard FullyShardedDataParallelImpl::no_sync() {
  if (!state_) init_root();
  TORCH_CHECK(is_root(), label(), ": no_sync() is for the root unit");
  TORCH_CHECK(!state_->backward_active, label(), ": no_sync() inside backward");
  const bool previous = state_->no_sync;
  state_->no_sync = true;
  return NoSyncGuard(this, previous);
}

FullyShardedDataParallelImpl::NoSyncGuard::~NoSyncGuard() {
  if (root_->state_) root_->state_->no_sync = previous_;
}

at::Tensor FullyShardedDataParallelImpl::clip_grad_norm_(double max_norm, double norm_type) {
  if (!state_) init_root();
  internal::RootState& st = *state_;
  TORCH_CHECK(is_root(), label(), ": clip_grad_norm_() is for the root unit");
  TORCH_CHECK(!st.backward_active, label(), ": clip_grad_norm_() inside backward");
  TORCH_CHECK(!st.no_sync, label(),
              ": clip_grad_norm_() inside no_sync(): the gradients are not reduced yet");
  TORCH_CHECK(norm_type > 0, label(), ": clip_grad_norm_() needs norm_type > 0, got ", norm_type);
  const bool inf = std::isinf(norm_type);
  c10::NoGradGuard no_grad;
  double local = 0;
  std::vector<at::Tensor> grads;
  for (FullyShardedDataParallelImpl* u : st.units) {
    for (FlatParam& fp : u->flats_) {
      if (!fp.requires_grad) continue;
      for (const at::Tensor& g : internal::ShardGrads(fp)) {
        grads.push_back(g);
        // Every element counted once over the world: an unsharded unit's gradient (the same on
        // every rank) on rank 0 only; a HYBRID_SHARD shard (the same in every shard group) in
        // the first group only, so the sum is the shard group's, not replicate-size times it.
        if (!inf && (u->sharded() ? u->replicate_rank_ != 0 : rank_ != 0)) continue;
        const double n = g.to(at::kDouble).norm(norm_type).item<double>();
        local = inf ? std::max(local, n) : local + std::pow(n, norm_type);
      }
    }
  }
  double total = local;
  if (world_ > 1) {
    const std::string context = label() + ": clip_grad_norm_ all_reduce";
    ThrowIfError(comm_
                     ->AllReduce(comm::MakeConstBuffer(&local, 1), comm::MakeBuffer(&total, 1),
                                 inf ? comm::ReduceOp::kMax : comm::ReduceOp::kSum)
                     .Wait(),
                 context);
  }
  if (!inf) total = std::pow(total, 1.0 / norm_type);
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1) {
    for (at::Tensor& g : grads) g.mul_(coef);
  }
  return at::scalar_tensor(total, at::kFloat);
}

FullyShardedDataParallelImpl::FullParamsGuard FullyShardedDataParallelImpl::summon_full_params(
    bool writeback) {
  std::vector<FullyShardedDataParallelImpl*> units = fsdp_units();
  for (FullyShardedDataParallelImpl* u : units) {
    TORCH_CHECK(!u->summoned_, u->label(), ": summon_full_params() is already active");
    for (const FlatParam& fp : u->flats_) {
      // The full parameters are in the compute dtype: writing them back would round the master
      // copy silently.
      TORCH_CHECK(!fp.mixed || !writeback, u->label(),
                  ": summon_full_params(writeback=true) under mixed precision would round the "
                  "master parameters to the compute dtype; use writeback=false");
    }
    TORCH_CHECK(!u->in_forward_ && !(u->state_ && u->state_->backward_active), u->label(),
                ": summon_full_params() inside forward or backward");
  }
  for (FullyShardedDataParallelImpl* u : units) u->issue_gathers();
  std::vector<at::Tensor> snapshots;
  for (FullyShardedDataParallelImpl* u : units) {
    u->wait_gathers();
    u->set_param_views(true);
    u->summoned_ = true;
    for (FlatParam& fp : u->flats_) {
      if (!u->sharded() && !fp.separate && !writeback) {
        snapshots.push_back(fp.shard.detach().clone());
      }
    }
  }
  return FullParamsGuard(std::move(units), writeback, std::move(snapshots));
}

FullyShardedDataParallelImpl::FullParamsGuard::~FullParamsGuard() {
  c10::NoGradGuard no_grad;
  size_t next_snapshot = 0;
  for (FullyShardedDataParallelImpl* u : units_) {
    for (FlatParam& fp : u->flats_) {
      if (u->sharded()) {
        if (writeback_ && fp.per_param) {
          internal::WritebackDim0(fp);
        } else if (writeback_) {
          fp.shard.detach().copy_(fp.full.narrow(0, fp.shard_offset, fp.shard_numel));
        }
      } else if (fp.separate) {
        // A copy on the compute device in the parameters' dtype is written back; a
        // low-precision one is read-only: its changes are dropped.
        if (writeback_ && !fp.mixed) {
          fp.shard.detach().copy_(fp.full);
        } else {
          fp.stale = true;
        }
      } else if (!writeback_) {
        fp.shard.detach().copy_(snapshots_[next_snapshot++]);
      }
    }
    u->summoned_ = false;
    u->reshard();
  }
}

}  // namespace fairscale::fsdp
