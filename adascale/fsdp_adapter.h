// AdaScaleFsdp: AdaScale (adascale.h) over fsdp::FullyShardedDataParallel, //adascale:fsdp.
// FSDP reduces the gradients inside backward, so after backward a rank holds only its shard of
// the averaged gradient and AdaScale cannot see the local gradients its variance estimate
// needs. This adapter registers FSDP's local gradient hook (fsdp/local_grad_hook.h) on the root
// and, at the end of every backward pass, hands AdaScale this backward's local squared norms per
// param group (accumulate_local_grad_sqr); the averaged side comes from the shards
// (AdaScaleOptions::sharded_gradients, summed exactly over the ranks in step()'s one
// all-reduce). With gradient accumulation, the step's earlier backward passes run under
// no_sync():
//
//   fsdp::FullyShardedDataParallel model(net, comm);   // kFullShard / kShardGradOp
//   torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
//   adascale::AdaScale ada(sgd, comm, adascale::AdaScaleOptions()
//                                         .num_gradients_to_accumulate(2)
//                                         .sharded_gradients(model->is_sharded()));
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
// Supported: kFullShard, kShardGradOp and kNoShard (every unit of the model alike), the flat and
// the per-parameter layout, nested units, CPU offload, mixed precision (the local norms are
// those of the low-precision gradients). Refused with INVALID_ARGUMENT at construction:
// HYBRID_SHARD (each shard is held by several ranks, so the summed shard norms would count it
// more than once), deterministic mode (it divides by the micro-batch count, not the world size),
// divide factors that do not make the mean over the ranks, a sharded_gradients setting that does
// not match the model, a param group holding a tensor the model does not shard (an ignored
// module's parameter, a frozen one, another model's), and a model that has a local gradient
// hook already (attached twice). Tensors of the model that no param group holds are left out.
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
  AdaScaleFsdp(const AdaScaleFsdp&) = delete;
  AdaScaleFsdp& operator=(const AdaScaleFsdp&) = delete;

 private:
  struct State;
  fsdp::FullyShardedDataParallel model_;
  std::shared_ptr<State> state_;
};

}  // namespace fairscale::adascale
