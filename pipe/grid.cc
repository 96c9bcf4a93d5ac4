#include "pipe/grid.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/GradMode.h>

#include <map>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/torch_error.h"
#include "comm/torch/tensor_buffer.h"

namespace fairscale::pipe {

PipeGrid MakePipeGrid(const std::shared_ptr<comm::Communicator>& world, int64_t stages) {
  if (!world) {
    base::ThrowIfError(absl::InvalidArgumentError("null communicator"), "pipe::MakePipeGrid");
  }
  const std::string where =
      absl::StrCat("pipe::MakePipeGrid (rank ", world->rank(), "/", world->size(), ")");
  if (stages < 1 || world->size() % stages != 0) {
    base::ThrowIfError(absl::InvalidArgumentError(
                           absl::StrCat(stages, " stages do not divide ", world->size(), " ranks")),
                       where);
  }
  PipeGrid grid;
  grid.stages = stages;
  grid.replicas = world->size() / stages;
  grid.stage = world->rank() % stages;
  grid.replica = world->rank() / stages;
  grid.pipe = base::ValueOrThrow(
      world->Split(static_cast<int>(grid.replica), static_cast<int>(grid.stage)), where);
  grid.data = base::ValueOrThrow(
      world->Split(static_cast<int>(grid.stage), static_cast<int>(grid.replica)), where);
  return grid;
}

void all_reduce_gradients(const std::vector<at::Tensor>& parameters, comm::Communicator& data,
                          absl::Duration timeout) {
  c10::NoGradGuard no_grad;
  if (timeout <= absl::ZeroDuration()) timeout = data.default_timeout();
  std::map<c10::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const at::Tensor& p : parameters) {
    at::Tensor& g = const_cast<at::Tensor&>(p).mutable_grad();
    if (!g.defined()) g = at::zeros_like(p);
    by_dtype[g.scalar_type()].push_back(g);
  }
  for (auto& [dtype, grads] : by_dtype) {
    std::vector<at::Tensor> flat;
    for (const at::Tensor& g : grads) flat.push_back(g.reshape({-1}));
    at::Tensor buffer = at::cat(flat).contiguous();
    const std::string where = absl::StrCat("pipe::all_reduce_gradients (", c10::toString(dtype),
                                           ", ", buffer.numel(), " elements)");
    const comm::Buffer b = base::ValueOrThrow(comm::ToBuffer(buffer), where);
    comm::OpOptions op;
    op.timeout = timeout;
    base::ThrowIfError(data.AllReduce(b, b, comm::ReduceOp::kAvg, op).Wait(timeout), where);
    int64_t offset = 0;
    for (at::Tensor& g : grads) {
      g.copy_(buffer.narrow(0, offset, g.numel()).view(g.sizes()));
      offset += g.numel();
    }
  }
}

}  // namespace fairscale::pipe
