// LocalGradHook: the observer of each rank's local gradients before FSDP reduces them
// (FullyShardedDataParallelImpl::register_local_grad_hook, //fsdp). After a reduce-scatter a
// rank only sees its shard of the mean gradient; statistics that need every rank's own
// gradient (AdaScale's gradient variance, //adascale:fsdp; gradient-noise monitors) take it
// from this hook instead. Defined apart from the module so that the engine can call it.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace fairscale::fsdp {

// One trainable tensor an optimizer steps and this rank's local gradient of one backward pass.
struct LocalGradSqr {
  // The tensor the optimizer holds: a flat parameter's shard (flatten_parameters(true)) or one
  // original parameter (flatten_parameters(false)); the same tensor parameters() lists.
  at::Tensor param;
  // Sum over ALL its elements (every rank's shard, unsharded) of this rank's gradient of this
  // backward pass, squared, in f64: before any reduction, divide factor or accumulation (also
  // under no_sync()); 0 when the backward gave it no gradient.
  double sum_sqr = 0.0;
};

// Called once at the end of every backward pass of the root it is registered on (inside the
// autograd engine's final callback, after the reductions completed, also under no_sync()),
// with one entry per trainable tensor of the root and its nested units (units in fsdp_units()
// order, each unit's tensors in its flat_shards() order; the same list every time).
// An exception it raises propagates out of backward().
using LocalGradHook = std::function<void(const std::vector<LocalGradSqr>&)>;

}  // namespace fairscale::fsdp
