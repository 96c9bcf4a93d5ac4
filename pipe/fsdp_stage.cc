#include "pipe/fsdp_stage.h"

#include <utility>
#include <vector>

#include "fsdp/fully_sharded_data_parallel.h"

namespace fairscale::pipe {

WrapStageFn fsdp_stage(std::shared_ptr<comm::Communicator> data, fsdp::FsdpOptions options) {
  return [data = std::move(data), options = std::move(options)](Stage stage) {
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
    return out;
  };
}

}  // namespace fairscale::pipe
