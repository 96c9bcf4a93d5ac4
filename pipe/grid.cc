#include "pipe/grid.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/GradMode.h>

#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "comm/torch/tensor_buffer.h"

namespace fairscale::pipe {

absl::StatusOr<PipeGrid> MakePipeGrid(const std::shared_ptr<comm::Communicator>& world,
                                      int64_t stages) {
  if (!world) return absl::InvalidArgumentError("MakePipeGrid: null communicator");
  if (stages < 1 || world->size() % stages != 0) {
    return absl::InvalidArgumentError(absl::StrCat("MakePipeGrid (rank ", world->rank(), "/",
                                                   world->size(), "): ", stages,
                                                   " stages do not divide ", world->size(),
                                                   " ranks"));
  }
  PipeGrid grid;
  grid.stages = stages;
  grid.replicas = world->size() / stages;
  grid.stage = world->rank() % stages;
  grid.replica = world->rank() / stages;
  absl::StatusOr<std::shared_ptr<comm::Communicator>> pipe =
      world->Split(static_cast<int>(grid.replica), static_cast<int>(grid.stage));
  if (!pipe.ok()) return pipe.status();
  absl::StatusOr<std::shared_ptr<comm::Communicator>> data =
      world->Split(static_cast<int>(grid.stage), static_cast<int>(grid.replica));
  if (!data.ok()) return data.status();
  grid.pipe = *std::move(pipe);
  grid.data = *std::move(data);
  return grid;
}

absl::Status all_reduce_gradients(const std::vector<at::Tensor>& parameters,
                                  comm::Communicator& data, absl::Duration timeout) {
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
    absl::StatusOr<comm::Buffer> b = comm::ToBuffer(buffer);
    if (!b.ok()) return b.status();
    comm::OpOptions op;
    op.timeout = timeout;
    absl::Status s = data.AllReduce(*b, *b, comm::ReduceOp::kAvg, op).Wait(timeout);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("all_reduce_gradients (", c10::toString(dtype),
                                                 ", ", buffer.numel(), " elements): ",
                                                 s.message()));
    }
    int64_t offset = 0;
    for (at::Tensor& g : grads) {
      g.copy_(buffer.narrow(0, offset, g.numel()).view(g.sizes()));
      offset += g.numel();
    }
  }
  return absl::OkStatus();
}

}  // namespace fairscale::pipe
