// ShardedGradScaler: a GradScaler for sharded training (FSDP, OSS, ShardedDataParallel) whose
// skip decision is the same on every rank (//amp). Each rank checks only the gradients its
// optimizer steps (its shards), so one rank can see an inf that the others do not. FairScale
// #180: with a per-rank decision that rank skips step() while the others step and enter the
// next collective without it, and the job hangs. Here unscale_ all-reduces {found_inf,
// has_grads} with max over the communicator before anything is decided, so every rank takes the
// same branch in step() and backs the scale off identically in update().
//
//   FullyShardedDataParallel model(Net(), comm);
//   torch::optim::Adam opt(model->parameters(), ...);   // the shards
//   amp::ShardedGradScaler scaler(comm);
//   scaler.scale(loss).backward(); scaler.step(opt); scaler.update();
//
// Contract: every rank of `comm` uses its scaler in the same way: the same options (enabled
// included), and the same sequence of unscale_/step calls per optimizer, because each unscale_
// (explicit or inside step) is one collective. A rank whose optimizer has no gradient (an empty
// shard) still joins it; step() raises on every rank only when no rank has gradients. If the
// all-reduce fails (a peer died, the timeout passed, the communicator was aborted), unscale_ and
// step raise c10::Error naming this rank and the communicator's error, on every rank; nothing is
// stepped (a step() retried after catching the error skips: the gradients are already unscaled).
#pragma once

#include <memory>
#include <string>

#include "amp/grad_scaler.h"
#include "comm/communicator.h"

namespace fairscale::amp {

class ShardedGradScaler : public GradScaler {
 public:
  explicit ShardedGradScaler(std::shared_ptr<comm::Communicator> comm,
                             GradScalerOptions options = {});

  const std::shared_ptr<comm::Communicator>& communicator() const { return comm_; }

 protected:
  void sync_found_inf(at::Tensor& flags, c10::Device grads_device) override;
  std::string name() const override;

 private:
  std::shared_ptr<comm::Communicator> comm_;
};

}  // namespace fairscale::amp
