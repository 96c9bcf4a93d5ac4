// LocalGradHook: the observer of each rank's local gradients before ShardedDataParallel reduces
// them (ShardedDataParallelImpl::register_local_grad_hook, //oss). After a synchronised backward
// a rank holds only the reduced gradients of the parameters it owns (and none, or zeros in a
// kFlat parameter's other ranges, for the rest); statistics that need every rank's own gradient
// (AdaScale's gradient variance, //adascale:oss; gradient-noise monitors) take it from this hook
// instead. The same contract as fsdp/local_grad_hook.h; a type of its own because //oss does not
// depend on //fsdp.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace fairscale::oss {

// One trainable parameter of the OSS optimizer and this rank's local gradient of one backward.
struct LocalGradSqr {
  // The parameter (the tensor the OSS optimizer's param groups hold, whole: kFlat ranges are not
  // reported separately).
  at::Tensor param;
  // Sum over ALL its elements of this rank's gradient of this backward pass, squared, in f64:
  // before any reduction, division by the world size or accumulation into .grad (also under
  // no_sync() and in deterministic mode); 0 when the backward gave it no gradient.
  double sum_sqr = 0.0;
};

// Called once at the end of every backward pass that reached a trainable parameter of the
// wrapped module (inside the autograd engine's final callback, after the reductions completed;
// also under no_sync()), with one entry per parameter of the OSS optimizer that requires grad,
// in OSS::shards() order (the same list while requires_grad flags do not change).
// An exception it raises propagates out of backward().
using LocalGradHook = std::function<void(const std::vector<LocalGradSqr>&)>;

}  // namespace fairscale::oss
