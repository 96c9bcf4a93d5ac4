#include "pipe/fsdp_stage.h"

#include <memory>
#include <utility>
#include <vector>

#include "fsdp/fully_sharded_data_parallel.h"

namespace fairscale::pipe {

WrapStageFn fsdp_stage(std::shared_ptr<comm::Communicator> data, fsdp::FsdpOptions options,
                       bool reduce_once_per_step) {
  return [data = std::move(data), options = std::move(options), reduce_once_per_step](Stage stage) {
    fsdp::FullyShardedDataParallel wrapped(stage, data, options);
    WrappedStage out;
    out.module = wrapped.ptr();
    const c10::optional<c10::ScalarType> dtype = options.mixed_precision().param_dtype();
    out.forward = [wrapped, dtype](std::vector<at::Tensor> xs, bool list) mutable {
      // FSDP casts forward's at::Tensor arguments, not a list's elements: floating-point
      // inputs (stage 0's batch; the other stages receive the previous stage's dtype) go in the
      // compute dtype here.
      if (dtype) {
        for (at::Tensor& x : xs) {
          if (x.defined() && x.is_floating_point() && x.scalar_type() != *dtype) x = x.to(*dtype);
        }
      }
      return wrapped->forward<std::vector<at::Tensor>>(std::move(xs), list);
    };
    if (reduce_once_per_step) {
      using Guard = fsdp::FullyShardedDataParallelImpl::NoSyncGuard;
      // Held from the first backward of a step to its last (which then reduces everything).
      auto guard = std::make_shared<std::unique_ptr<Guard>>();
      out.before_backward = [wrapped, guard](bool last) mutable {
        if (last) {
          guard->reset();
        } else if (!*guard) {
          guard->reset(new Guard(wrapped->no_sync()));
        }
      };
    }
    return out;
  };
}

}  // namespace fairscale::pipe
