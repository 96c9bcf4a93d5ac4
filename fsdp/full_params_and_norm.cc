// FullyShardedDataParallel's methods outside the training path: no_sync, clip_grad_norm_ and
// summon_full_params, over the units' engines (internal/unit.h).
#include <ATen/ops/scalar_tensor.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "fsdp/fully_sharded_data_parallel.h"
#include "deterministic/collectives.h"
#include "base/torch_error.h"
#include "fsdp/internal/coordinator.h"
#include "fsdp/internal/flat_param.h"
#include "fsdp/internal/unit.h"

namespace fairscale::fsdp {

using internal::FlatParam;

FullyShardedDataParallelImpl::NoSyncGuard FullyShardedDataParallelImpl::no_sync() {
  internal::Coordinator& c = internal::Coordinator::RootOf(*unit_);
  TORCH_CHECK(is_root(), label(), ": no_sync() is for the root unit");
  TORCH_CHECK(!c.backward_active(), label(), ": no_sync() inside backward");
  const bool previous = c.no_sync();
  c.set_no_sync(true);
  return NoSyncGuard(this, previous);
}

FullyShardedDataParallelImpl::NoSyncGuard::~NoSyncGuard() {
  if (const auto& c = root_->unit_->coordinator()) c->set_no_sync(previous_);
}

at::Tensor FullyShardedDataParallelImpl::clip_grad_norm_(double max_norm, double norm_type) {
  const internal::Coordinator& c = internal::Coordinator::RootOf(*unit_);
  TORCH_CHECK(is_root(), label(), ": clip_grad_norm_() is for the root unit");
  TORCH_CHECK(!c.backward_active(), label(), ": clip_grad_norm_() inside backward");
  TORCH_CHECK(!c.no_sync(), label(),
              ": clip_grad_norm_() inside no_sync(): the gradients are not reduced yet");
  TORCH_CHECK(norm_type > 0, label(), ": clip_grad_norm_() needs norm_type > 0, got ", norm_type);
  const bool inf = std::isinf(norm_type);
  c10::NoGradGuard no_grad;
  // Deterministic mode: the squares summed exactly (deterministic::ExactSquareSum), so the norm
  // does not depend on how the elements are sharded (the inf-norm, a max, is exact already).
  const bool exact = unit_->det_layout() != nullptr && !inf;
  TORCH_CHECK(!exact || norm_type == 2.0, label(), ": deterministic mode computes the 2-norm "
              "(an exact sum of squares) or the inf-norm, not the ", norm_type, "-norm");
  deterministic::ExactSquareSum squares;
  double local = 0;
  std::vector<at::Tensor> grads;
  for (const internal::Unit* u : c.units()) {
    for (const FlatParam& fp : u->flats()) {
      if (!fp.requires_grad) continue;
      for (const at::Tensor& g : internal::ShardGrads(fp)) {
        grads.push_back(g);
        // Every element counted once over the world: an unsharded unit's gradient (the same on
        // every rank) on rank 0 only; a HYBRID_SHARD shard (the same in every shard group) in
        // the first group only, so the sum is the shard group's, not replicate-size times it.
        if (!inf && (u->sharded() ? u->groups().replicate_rank != 0 : rank() != 0)) continue;
        if (exact) {
          squares.Add(g);
          continue;
        }
        const double n = g.to(at::kDouble).norm(norm_type).item<double>();
        local = inf ? std::max(local, n) : local + std::pow(n, norm_type);
      }
    }
  }
  double total = local;
  const std::string context = label() + ": clip_grad_norm_ all_reduce";
  if (exact) {
    squares.AllReduce(*communicator(), context);
    total = squares.norm();
  } else if (world_size() > 1) {
    base::ThrowIfError(communicator()
                     ->AllReduce(comm::MakeConstBuffer(&local, 1), comm::MakeBuffer(&total, 1),
                                 inf ? comm::ReduceOp::kMax : comm::ReduceOp::kSum)
                     .Wait(),
                 context);
  }
  if (!inf && !exact) total = std::pow(total, 1.0 / norm_type);
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1) {
    for (at::Tensor& g : grads) g.mul_(coef);
  }
  return at::scalar_tensor(total, at::kFloat);
}

FullyShardedDataParallelImpl::FullParamsGuard FullyShardedDataParallelImpl::summon_full_params(
    bool writeback) {
  std::vector<FullyShardedDataParallelImpl*> units = fsdp_units();
  for (FullyShardedDataParallelImpl* impl : units) {
    const internal::Unit& u = *impl->unit_;
    TORCH_CHECK(!u.progress.summoned, u.label(), ": summon_full_params() is already active");
    for (const FlatParam& fp : u.flats()) {
      // The full parameters are in the compute dtype: writing them back would round the master
      // copy silently.
      TORCH_CHECK(!fp.mixed || !writeback, u.label(),
                  ": summon_full_params(writeback=true) under mixed precision would round the "
                  "master parameters to the compute dtype; use writeback=false");
    }
    TORCH_CHECK(!u.progress.in_forward && !(u.coordinator() && u.coordinator()->backward_active()),
                u.label(), ": summon_full_params() inside forward or backward");
  }
  for (FullyShardedDataParallelImpl* impl : units) impl->unit_->IssueGathers();
  std::vector<at::Tensor> snapshots;
  for (FullyShardedDataParallelImpl* impl : units) {
    internal::Unit& u = *impl->unit_;
    u.WaitGathers();
    u.SetParamViews(true);
    u.progress.summoned = true;
    for (at::Tensor& t : u.SnapshotShards(writeback)) snapshots.push_back(std::move(t));
  }
  return FullParamsGuard(std::move(units), writeback, std::move(snapshots));
}

FullyShardedDataParallelImpl::FullParamsGuard::~FullParamsGuard() {
  size_t next_snapshot = 0;
  for (FullyShardedDataParallelImpl* impl : units_) {
    impl->unit_->EndSummon(writeback_, snapshots_, next_snapshot);
  }
}

}  // namespace fairscale::fsdp
