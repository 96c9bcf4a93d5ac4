#include "amp/sharded_grad_scaler.h"

#include <c10/util/Exception.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/torch_error.h"
#include "comm/torch/tensor_buffer.h"

namespace fairscale::amp {

ShardedGradScaler::ShardedGradScaler(std::shared_ptr<comm::Communicator> comm,
                                     GradScalerOptions options)
    : GradScaler(options), comm_(std::move(comm)) {
  TORCH_CHECK(comm_ != nullptr, "ShardedGradScaler: the communicator is null");
}

std::string ShardedGradScaler::name() const {
  return absl::StrCat("ShardedGradScaler rank ", comm_->rank(), "/", comm_->size());
}

void ShardedGradScaler::sync_found_inf(at::Tensor& flags, c10::Device grads_device) {
  // The flags travel on the host unless the backend takes only device buffers (NCCL): then on
  // the gradients' device.
  at::Tensor buffer = flags;
  if (!comm_->SupportsDevice(comm::Device::Cpu()) && grads_device.is_cuda()) {
    buffer = flags.to(grads_device);
  }
  const comm::Buffer view =
      base::ValueOrThrow(comm::ToBuffer(buffer), name() + ": found-inf flags");
  base::ThrowIfError(
      comm_->AllReduce(comm::ConstBuffer(view), view, comm::ReduceOp::kMax).Wait(),
      name() +
          ": the all_reduce of the found-inf flags failed, so no rank can decide whether "
          "to step");
  if (!buffer.is_same(flags)) flags.copy_(buffer);
}

}  // namespace fairscale::amp
