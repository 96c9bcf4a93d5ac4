// AdaScaleFsdp: AdaScale (adascale.h) over fsdp::FullyShardedDataParallel, //adascale:fsdp.
// FSDP reduces the gradients inside backward, so after backward a rank holds only its shard of
// the averaged gradient and AdaScale cannot see the local gradients its variance estimate
// needs. This adapter registers FSDP's local gradient hook (fsdp/local_grad_hook.h) on the root
// and, at the end of every backward pass, hands AdaScale this backward's local squared norms per
// param group (accumulate_local_grad_sqr); the averaged side comes from the shards
// (AdaScaleOptions::sharded_gradients and gradient_replicas, which options_for() sets from the
// model: summed exactly over the ranks in step()'s one all-reduce). With gradient accumulation,
// the step's earlier backward passes run under no_sync():
//
//   fsdp::FullyShardedDataParallel model(net, comm);
//   torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
//   adascale::AdaScale ada(sgd, comm, adascale::AdaScaleFsdp::options_for(
//                                         model, adascale::AdaScaleOptions()
//                                                    .num_gradients_to_accumulate(2)));
//   adascale::AdaScaleFsdp adapter(model, ada);
//   ada.zero_grad();
//   for (int m = 0; m < 2; ++m) {
//     if (ada.is_accumulation_step()) {
//       auto no_sync = model->no_sync();
//       loss(model(x[m]), y[m]).backward();   // the adapter accumulates at its end
//     } else {
//       loss(model(x[m]), y[m]).backward();   // reduces the sum of both
//     }
//   }
//   ada.step();
//
// Supported: every sharding strategy (all units of the model alike; HYBRID_SHARD's replicated
// shards are counted once through gradient_replicas), the flat and the per-parameter layout,
// nested units, CPU offload, mixed precision (the local norms are those of the low-precision
// gradients; not covered by the tests). Refused with INVALID_ARGUMENT at construction: deterministic mode (it divides by
// the micro-batch count, not the world size), divide factors that do not make the mean over the
// ranks, units that shard differently, sharded_gradients / gradient_replicas settings that do
// not match the model (use options_for), a param group holding a tensor the model does not
// shard (an ignored module's parameter, a frozen one, another model's), and a model that has a
// local gradient hook already (attached twice). Tensors of the model that no param group holds
// are left out.
#pragma once

#include <memory>

#include "adascale/adascale.h"
#include "fsdp/fully_sharded_data_parallel.h"

namespace fairscale::adascale {

class AdaScaleFsdp {
 public:
  // Checks the model and `ada` (raises c10::Error, see above) and registers the hook on the root
  // `model`. No communication. `ada` must outlive this object; the hook goes with it.
  AdaScaleFsdp(fsdp::FullyShardedDataParallel model, AdaScale& ada);
  ~AdaScaleFsdp();
  // `options` with sharded_gradients and gradient_replicas set as `model` needs them.
  static AdaScaleOptions options_for(const fsdp::FullyShardedDataParallel& model,
                                     AdaScaleOptions options = {});
  AdaScaleFsdp(const AdaScaleFsdp&) = delete;
  AdaScaleFsdp& operator=(const AdaScaleFsdp&) = delete;

 private:
  struct State;
  fsdp::FullyShardedDataParallel model_;
  std::shared_ptr<State> state_;
};

}  // namespace fairscale::adascale
