#include "model_parallel/sequence_parallel.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/torch_error.h"
#include "comm/torch/tensor_buffer.h"

namespace fairscale::model_parallel {

void all_reduce_sequence_parallel_grads(const std::vector<at::Tensor>& params,
                                        comm::Communicator& comm) {
  if (comm.size() == 1) return;
  c10::NoGradGuard no_grad;
  // Ordered by dtype, so every rank issues the same all-reduces in the same order.
  std::map<c10::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const at::Tensor& p : params) {
    at::Tensor& g = const_cast<at::Tensor&>(p).mutable_grad();
    if (!g.defined()) g = at::zeros_like(p);
    by_dtype[g.scalar_type()].push_back(g);
  }
  for (auto& [dtype, grads] : by_dtype) {
    std::vector<at::Tensor> flat;
    for (const at::Tensor& g : grads) flat.push_back(g.reshape({-1}));
    at::Tensor buffer = at::cat(flat).contiguous();
    const std::string where =
        absl::StrCat("model_parallel::all_reduce_sequence_parallel_grads rank ", comm.rank(), "/",
                     comm.size(), " (", c10::toString(dtype), ", ", buffer.numel(), " elements)");
    const comm::Buffer b = base::ValueOrThrow(comm::ToBuffer(buffer), where);
    base::ThrowIfError(comm.AllReduce(b, b, comm::ReduceOp::kSum).Wait(), where);
    int64_t offset = 0;
    for (at::Tensor& g : grads) {
      g.copy_(buffer.narrow(0, offset, g.numel()).view(g.sizes()));
      offset += g.numel();
    }
  }
}

}  // namespace fairscale::model_parallel
