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
    out.forward = [wrapped](std::vector<at::Tensor> xs, bool list) mutable {
      return wrapped->forward<std::vector<at::Tensor>>(std::move(xs), list);
    };
    return out;
  };
}

}  // namespace fairscale::pipe
