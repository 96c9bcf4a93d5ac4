// AdaScaleSdp: AdaScale (adascale.h) over oss::ShardedDataParallel, //adascale:oss.
// A synchronised ShardedDataParallel backward reduces each gradient to the rank that owns it in
// the OSS partition and frees the rest, so after it AdaScale cannot see the local gradients its
// variance estimate needs (accumulate_local_gradients() would read reduced or freed gradients:
// wrong statistics). This adapter registers ShardedDataParallel's local gradient hook
// (oss/local_grad_hook.h) and, at the end of every backward pass (synchronised or under
// no_sync()), hands AdaScale this backward's local squared norms per param group
// (accumulate_local_grad_sqr); the averaged side comes from the owners' gradients
// (AdaScaleOptions::sharded_gradients, which options_for() sets: each rank's .grad is zero or
// absent outside what it owns, so the squares summed over the ranks in step()'s one all-reduce
// are the mean gradient's, exactly). The user's usual loop works:
//
//   auto oss = std::make_shared<oss::OSS>(net->parameters(), factory, comm);
//   oss::ShardedDataParallel sdp(torch::nn::AnyModule(net), oss);
//   adascale::AdaScale ada(*oss, comm, adascale::AdaScaleSdp::options_for(
//                                          sdp, adascale::AdaScaleOptions()
//                                                   .num_gradients_to_accumulate(2)));
//   adascale::AdaScaleSdp adapter(sdp, ada);
//   ada.zero_grad();
//   for (int m = 0; m < 2; ++m) {
//     if (ada.is_accumulation_step()) {
//       auto no_sync = sdp->no_sync();
//       loss(sdp->forward(x[m]), y[m]).backward();   // the adapter accumulates at its end
//     } else {
//       loss(sdp->forward(x[m]), y[m]).backward();   // reduces the sum to the owners
//     }
//   }
//   ada.step();
//
// (Every backward under no_sync() followed by sdp->reduce() works too.) Supported: kGreedy and
// kFlat partitioning (a kFlat parameter split between ranks is reported whole by every rank's
// hook; its owners hold their ranges of the mean), any number of param groups of the OSS.
// Refused with INVALID_ARGUMENT at construction: AdaScale over another optimizer than the
// model's OSS (its param groups are what the hook reports on), deterministic mode (it divides
// the gradient sum by the micro-batch count, not by the world size), sharded_gradients(false)
// at more than one rank or gradient_replicas other than 1 (use options_for), a communicator of
// another rank or size, and a model that has a local gradient hook already (attached twice).
// With the adapter attached, a call of accumulate_local_gradients() raises (AdaScale refuses
// mixing it with accumulate_local_grad_sqr in one step), and a backward more than
// num_gradients_to_accumulate per step raises out of backward().
// Not detected: a step whose backward passes all ran under no_sync() without sdp->reduce()
// before ada.step() (the owners would step on local, unaveraged gradients: the same mistake
// without AdaScale).
#pragma once

#include <memory>

#include "adascale/adascale.h"
#include "oss/sharded_data_parallel.h"

namespace fairscale::adascale {

class AdaScaleSdp {
 public:
  // Checks the model and `ada` (raises c10::Error, see above) and registers the hook on `sdp`.
  // No communication. `ada` must outlive this object; the hook goes with it.
  AdaScaleSdp(oss::ShardedDataParallel sdp, AdaScale& ada);
  ~AdaScaleSdp();
  // `options` with sharded_gradients(true) and gradient_replicas(1), as `sdp` needs them.
  static AdaScaleOptions options_for(const oss::ShardedDataParallel& sdp,
                                     AdaScaleOptions options = {});
  AdaScaleSdp(const AdaScaleSdp&) = delete;
  AdaScaleSdp& operator=(const AdaScaleSdp&) = delete;

 private:
  struct State;
  oss::ShardedDataParallel sdp_;
  std::shared_ptr<State> state_;
};

}  // namespace fairscale::adascale
