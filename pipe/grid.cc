#include "pipe/grid.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/GradMode.h>

#include <ATen/ops/scalar_tensor.h>

#include <map>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/torch_error.h"
#include "comm/torch/tensor_buffer.h"
#include "deterministic/collectives.h"
#include "deterministic/tree.h"

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

at::Tensor all_reduce_gradients(Pipe& pipe, comm::Communicator& data) {
  c10::NoGradGuard no_grad;
  const PipeOptions& o = pipe.options();
  const std::string where = absl::StrCat("pipe::all_reduce_gradients (rank ", data.rank(), "/",
                                         data.size(), ", deterministic mode)");
  if (!o.deterministic()) {
    base::ThrowIfError(absl::InvalidArgumentError(
                           "the pipe runs the default mode: use all_reduce_gradients("
                           "pipe->parameters(), data) (this overload is for "
                           "PipeOptions::deterministic)"),
                       where);
  }
  if (data.size() != o.replicas() || data.rank() != o.replica()) {
    base::ThrowIfError(
        absl::InvalidArgumentError(absl::StrCat(
            "the pipe is replica ", o.replica(), " of ", o.replicas(),
            " (PipeOptions::replica / replicas) but the data communicator is rank ", data.rank(),
            " of ", data.size())),
        where);
  }
  const int64_t m = o.chunks() * o.replicas();
  const deterministic::MicroBatchLayout layout =
      deterministic::MicroBatchLayout::Make(m, static_cast<int>(o.replicas()), data.rank());
  const std::vector<double>& losses = pipe.micro_batch_losses();
  if (static_cast<int64_t>(losses.size()) != o.chunks()) {
    base::ThrowIfError(absl::FailedPreconditionError("no train_step ran yet"), where);
  }
  const at::Tensor loss = at::scalar_tensor(deterministic::Mean(data, layout, losses, where),
                                            at::TensorOptions().dtype(pipe.loss_dtype_));
  if (o.replicas() == 1) return loss;  // train_step set the gradients
  std::vector<std::vector<deterministic::Partial>> pending = std::move(pipe.pending_);
  pipe.pending_.clear();
  std::vector<at::Tensor> storage;
  for (auto& chunk : pipe.grad_storage_) {
    for (at::Tensor& t : chunk) storage.push_back(std::move(t));
  }
  pipe.grad_storage_.clear();
  const std::vector<at::Tensor> params = pipe.parameters();
  if (pending.empty() || pending.size() != params.size()) {
    base::ThrowIfError(
        absl::FailedPreconditionError(
            "no train_step is waiting to be reduced (call it once after every train_step)"),
        where);
  }
  const std::vector<deterministic::Node> mine = layout.nodes_of(layout.rank);
  std::map<c10::ScalarType, std::vector<size_t>> by_dtype;
  for (size_t k = 0; k < params.size(); ++k) {
    std::vector<deterministic::Node> nodes;
    for (const deterministic::Partial& part : pending[k]) nodes.push_back(part.node);
    if (nodes != mine) {
      base::ThrowIfError(absl::InternalError("the partial sums of train_step do not match the "
                                             "micro-batch layout"),
                         where);
    }
    by_dtype[pending[k].at(0).value.scalar_type()].push_back(k);
  }
  for (const auto& [dtype, indices] : by_dtype) {
    std::vector<deterministic::Partial> flat;
    for (size_t n = 0; n < mine.size(); ++n) {
      std::vector<at::Tensor> pieces;
      for (size_t k : indices) pieces.push_back(pending[k][n].value.reshape({-1}));
      flat.push_back({mine[n], at::cat(pieces).contiguous()});
    }
    at::Tensor total = deterministic::AllReduce(data, std::move(flat), layout.nodes_by_rank(), m,
                                                absl::StrCat(where, " ", c10::toString(dtype)));
    total.div_(static_cast<double>(m));
    int64_t offset = 0;
    for (size_t k : indices) {
      const at::Tensor& p = params[k];
      at::Tensor g = total.narrow(0, offset, p.numel()).view(p.sizes());
      offset += p.numel();
      at::Tensor& grad = const_cast<at::Tensor&>(p).mutable_grad();
      if (k < storage.size() && storage[k].defined() && storage[k].sizes() == p.sizes() &&
          storage[k].scalar_type() == dtype) {
        storage[k].copy_(g);  // the gradient tensor the step found, e.g. the optimizer's zeros
        grad = storage[k];
      } else {
        grad = g.clone();
      }
    }
  }
  return loss;
}

}  // namespace fairscale::pipe
