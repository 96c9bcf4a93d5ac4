#include "autograd_comm/collectives.h"

#include <ATen/core/ivalue.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/custom_function.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/torch_error.h"
#include "comm/torch/tensor_buffer.h"

namespace fairscale::autograd_comm {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The communicator, held by reference in the autograd graph until backward (header: `comm` must
// outlive the backward pass).
struct CommRef : torch::CustomClassHolder {
  explicit CommRef(comm::Communicator* c) : comm(c) {}
  comm::Communicator* comm;
};

void SaveComm(AutogradContext* ctx, comm::Communicator* comm) {
  ctx->saved_data["comm"] = c10::IValue::make_capsule(c10::make_intrusive<CommRef>(comm));
}

comm::Communicator& LoadComm(AutogradContext* ctx) {
  return *c10::static_intrusive_pointer_cast<CommRef>(ctx->saved_data["comm"].toCapsule())->comm;
}

// "autograd_comm::gather_from_parallel_region backward rank 1/4 grad [8, 6]"
std::string What(const char* function, bool backward, const comm::Communicator& comm,
                 const at::Tensor& t) {
  return absl::StrCat("autograd_comm::", function, backward ? " backward" : "", " rank ",
                      comm.rank(), "/", comm.size(), backward ? " grad " : " x ",
                      t.defined() ? absl::StrCat("[", absl::StrJoin(t.sizes(), ", "), "]")
                                  : std::string("(undefined)"));
}

void Wait(comm::Work work, const std::string& what) { base::ThrowIfError(work.Wait(), what); }

// `dim` wrapped into [0, x.dim()).
int64_t WrapDim(const at::Tensor& x, int64_t dim, const std::string& what) {
  const int64_t ndim = x.dim();
  if (dim < -ndim || dim >= ndim) {
    base::ThrowIfError(absl::InvalidArgumentError(absl::StrCat(
                           "dimension ", dim, " is out of range for a tensor of ", ndim,
                           " dimensions")),
                       what);
  }
  return dim < 0 ? dim + ndim : dim;
}

void CheckDivisible(const at::Tensor& x, int64_t dim, int world, const std::string& what) {
  if (x.size(dim) % world != 0) {
    base::ThrowIfError(absl::InvalidArgumentError(absl::StrCat(
                           "dimension ", dim, " has size ", x.size(dim),
                           ", which is not divisible by the world size ", world)),
                       what);
  }
}

// The sum over the ranks (a new contiguous tensor).
at::Tensor AllReduceSum(const at::Tensor& x, comm::Communicator& comm, const std::string& what) {
  const at::Tensor send = x.contiguous();
  at::Tensor recv = at::empty(send.sizes(), send.options());
  Wait(comm.AllReduce(base::ValueOrThrow(comm::ToConstBuffer(send), what),
                      base::ValueOrThrow(comm::ToBuffer(recv), what), comm::ReduceOp::kSum),
       what);
  return recv;
}

// Every rank's x concatenated along `dim` in rank order.
at::Tensor AllGather(const at::Tensor& x, int64_t dim, comm::Communicator& comm,
                     const std::string& what) {
  // Gathering along dim 0 is concatenating the buffers: move `dim` to the front and back.
  const at::Tensor send = (dim == 0 ? x : x.movedim(dim, 0)).contiguous();
  std::vector<int64_t> shape = send.sizes().vec();
  shape[0] *= comm.size();
  at::Tensor recv = at::empty(shape, send.options());
  Wait(comm.AllGather(base::ValueOrThrow(comm::ToConstBuffer(send), what),
                      base::ValueOrThrow(comm::ToBuffer(recv), what)),
       what);
  return dim == 0 ? recv : recv.movedim(0, dim).contiguous();
}

// This rank's chunk of `dim`, as a new tensor (never a view of x: outputs of autograd functions
// that alias their inputs invite in-place trouble).
at::Tensor Chunk(const at::Tensor& x, int64_t dim, const comm::Communicator& comm) {
  const int64_t chunk = x.size(dim) / comm.size();
  return x.narrow(dim, comm.rank() * chunk, chunk).clone(at::MemoryFormat::Contiguous);
}

// Chunk r along dim 0 of the sum over the ranks.
at::Tensor ReduceScatter(const at::Tensor& x, comm::Communicator& comm, const std::string& what) {
  const at::Tensor send = x.contiguous();
  std::vector<int64_t> shape = send.sizes().vec();
  shape[0] /= comm.size();
  at::Tensor recv = at::empty(shape, send.options());
  Wait(comm.ReduceScatter(base::ValueOrThrow(comm::ToConstBuffer(send), what),
                          base::ValueOrThrow(comm::ToBuffer(recv), what), comm::ReduceOp::kSum),
       what);
  return recv;
}

at::Tensor AllToAll(const at::Tensor& x, comm::Communicator& comm, const std::string& what) {
  const at::Tensor send = x.contiguous();
  at::Tensor recv = at::empty(send.sizes(), send.options());
  Wait(comm.AllToAll(base::ValueOrThrow(comm::ToConstBuffer(send), what),
                     base::ValueOrThrow(comm::ToBuffer(recv), what)),
       what);
  return recv;
}

constexpr char kCopyTo[] = "copy_to_parallel_region";
constexpr char kReduceFrom[] = "reduce_from_parallel_region";
constexpr char kScatterTo[] = "scatter_to_parallel_region";
constexpr char kGatherFrom[] = "gather_from_parallel_region";
constexpr char kScatterToSeq[] = "scatter_to_sequence_parallel_region";
constexpr char kGatherFromSeq[] = "gather_from_sequence_parallel_region";
constexpr char kReduceScatterToSeq[] = "reduce_scatter_to_sequence_parallel_region";
constexpr char kAllToAll[] = "all_to_all";

class CopyTo : public torch::autograd::Function<CopyTo> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, comm::Communicator* comm) {
    SaveComm(ctx, comm);
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    comm::Communicator& comm = LoadComm(ctx);
    return {AllReduceSum(grads[0], comm, What(kCopyTo, true, comm, grads[0])), at::Tensor()};
  }
};

class ReduceFrom : public torch::autograd::Function<ReduceFrom> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, comm::Communicator* comm) {
    return AllReduceSum(x, *comm, What(kReduceFrom, false, *comm, x));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

// Chunk forward, all-gather backward, along a dimension (scatter_to_parallel_region and, with
// dim 0, scatter_to_sequence_parallel_region).
class ScatterTo : public torch::autograd::Function<ScatterTo> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, comm::Communicator* comm,
                            int64_t dim, const char* name) {
    SaveComm(ctx, comm);
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["name"] = std::string(name);
    return Chunk(x, dim, *comm);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    comm::Communicator& comm = LoadComm(ctx);
    const int64_t dim = ctx->saved_data["dim"].toInt();
    const std::string name = ctx->saved_data["name"].toStringRef();
    return {AllGather(grads[0], dim, comm, What(name.c_str(), true, comm, grads[0])),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// All-gather forward; chunk backward, or reduce-scatter backward along dim 0 when
// `reduce_scatter_grad` (gather_from_parallel_region and the sequence-parallel gather).
class GatherFrom : public torch::autograd::Function<GatherFrom> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, comm::Communicator* comm,
                            int64_t dim, bool reduce_scatter_grad, const char* name) {
    SaveComm(ctx, comm);
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["reduce_scatter_grad"] = reduce_scatter_grad;
    ctx->saved_data["name"] = std::string(name);
    return AllGather(x, dim, *comm, What(name, false, *comm, x));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    comm::Communicator& comm = LoadComm(ctx);
    const int64_t dim = ctx->saved_data["dim"].toInt();
    const std::string name = ctx->saved_data["name"].toStringRef();
    at::Tensor grad = ctx->saved_data["reduce_scatter_grad"].toBool()
                          ? ReduceScatter(grads[0], comm, What(name.c_str(), true, comm, grads[0]))
                          : Chunk(grads[0], dim, comm);
    return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class ReduceScatterToSeq : public torch::autograd::Function<ReduceScatterToSeq> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, comm::Communicator* comm) {
    SaveComm(ctx, comm);
    return ReduceScatter(x, *comm, What(kReduceScatterToSeq, false, *comm, x));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    comm::Communicator& comm = LoadComm(ctx);
    return {AllGather(grads[0], 0, comm, What(kReduceScatterToSeq, true, comm, grads[0])),
            at::Tensor()};
  }
};

class AllToAllFunction : public torch::autograd::Function<AllToAllFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, comm::Communicator* comm) {
    SaveComm(ctx, comm);
    return AllToAll(x, *comm, What(kAllToAll, false, *comm, x));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    comm::Communicator& comm = LoadComm(ctx);
    return {AllToAll(grads[0], comm, What(kAllToAll, true, comm, grads[0])), at::Tensor()};
  }
};

// The checks every rank makes before communicating (so a bad shape fails on every rank alike).
int64_t CheckedDim(const at::Tensor& x, int64_t dim, bool chunked, const comm::Communicator& comm,
                   const char* name) {
  const std::string what = What(name, false, comm, x);
  TORCH_CHECK(x.defined(), what, ": the input is undefined");
  const int64_t d = WrapDim(x, dim, what);
  if (chunked) CheckDivisible(x, d, comm.size(), what);
  return d;
}

}  // namespace

at::Tensor copy_to_parallel_region(const at::Tensor& x, comm::Communicator& comm) {
  TORCH_CHECK(x.defined(), What(kCopyTo, false, comm, x), ": the input is undefined");
  if (comm.size() == 1) return x;
  return CopyTo::apply(x, &comm);
}

at::Tensor reduce_from_parallel_region(const at::Tensor& x, comm::Communicator& comm) {
  TORCH_CHECK(x.defined(), What(kReduceFrom, false, comm, x), ": the input is undefined");
  if (comm.size() == 1) return x;
  return ReduceFrom::apply(x, &comm);
}

at::Tensor scatter_to_parallel_region(const at::Tensor& x, comm::Communicator& comm,
                                      int64_t dim) {
  const int64_t d = CheckedDim(x, dim, /*chunked=*/true, comm, kScatterTo);
  if (comm.size() == 1) return x;
  return ScatterTo::apply(x, &comm, d, kScatterTo);
}

at::Tensor gather_from_parallel_region(const at::Tensor& x, comm::Communicator& comm,
                                       int64_t dim) {
  const int64_t d = CheckedDim(x, dim, /*chunked=*/false, comm, kGatherFrom);
  if (comm.size() == 1) return x;
  return GatherFrom::apply(x, &comm, d, /*reduce_scatter_grad=*/false, kGatherFrom);
}

at::Tensor scatter_to_sequence_parallel_region(const at::Tensor& x, comm::Communicator& comm) {
  CheckedDim(x, 0, /*chunked=*/true, comm, kScatterToSeq);
  if (comm.size() == 1) return x;
  return ScatterTo::apply(x, &comm, int64_t{0}, kScatterToSeq);
}

at::Tensor gather_from_sequence_parallel_region(const at::Tensor& x, comm::Communicator& comm,
                                                bool tensor_parallel_output_grad) {
  CheckedDim(x, 0, /*chunked=*/false, comm, kGatherFromSeq);
  if (comm.size() == 1) return x;
  return GatherFrom::apply(x, &comm, int64_t{0}, tensor_parallel_output_grad, kGatherFromSeq);
}

at::Tensor reduce_scatter_to_sequence_parallel_region(const at::Tensor& x,
                                                      comm::Communicator& comm) {
  CheckedDim(x, 0, /*chunked=*/true, comm, kReduceScatterToSeq);
  if (comm.size() == 1) return x;
  return ReduceScatterToSeq::apply(x, &comm);
}

at::Tensor all_to_all(const at::Tensor& x, comm::Communicator& comm) {
  CheckedDim(x, 0, /*chunked=*/true, comm, kAllToAll);
  if (comm.size() == 1) return x;
  return AllToAllFunction::apply(x, &comm);
}

}  // namespace fairscale::autograd_comm
