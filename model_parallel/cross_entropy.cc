#include "model_parallel/cross_entropy.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/torch_error.h"
#include "comm/torch/tensor_buffer.h"

namespace fairscale::model_parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::string Shape(const at::Tensor& t) {
  return t.defined() ? absl::StrCat("[", absl::StrJoin(t.sizes(), ", "), "]") : "(undefined)";
}

// In place: the elementwise `op` over the group.
void AllReduce(at::Tensor& t, comm::ReduceOp op, comm::Communicator& comm,
               const std::string& what) {
  const at::Tensor send = t.contiguous();
  at::Tensor recv = at::empty_like(send, at::MemoryFormat::Contiguous);
  base::ThrowIfError(comm.AllReduce(base::ValueOrThrow(comm::ToConstBuffer(send), what),
                                    base::ValueOrThrow(comm::ToBuffer(recv), what), op)
                         .Wait(),
                     what);
  t = recv;
}

class VocabParallelCrossEntropy : public torch::autograd::Function<VocabParallelCrossEntropy> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& targets, comm::Communicator* comm) {
    const std::string what =
        absl::StrCat("model_parallel::vocab_parallel_cross_entropy rank ", comm->rank(), "/",
                     comm->size(), " logits ", Shape(logits));
    // Half types are computed in f32 (exp and sums), as torch's own cross-entropy does.
    const bool half = logits.scalar_type() == at::kHalf || logits.scalar_type() == at::kBFloat16;
    const int64_t shard = logits.size(-1);
    const at::Tensor flat = (half ? logits.to(at::kFloat) : logits).reshape({-1, shard});
    const at::Tensor t = targets.reshape({-1});
    const int64_t tokens = t.numel();

    at::Tensor max = std::get<0>(flat.max(1));
    if (comm->size() > 1) AllReduce(max, comm::ReduceOp::kMax, *comm, what + " all_reduce(max)");
    const at::Tensor shifted = flat - max.unsqueeze(1);

    // The target logit comes from the rank whose shard holds it; the others contribute 0.
    const int64_t start = comm->rank() * shard;
    const at::Tensor outside = at::logical_or(t < start, t >= start + shard);
    const at::Tensor local = (t - start).masked_fill(outside, 0);
    const at::Tensor predicted =
        shifted.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(outside, 0.0);
    const at::Tensor exp = shifted.exp();
    at::Tensor sums = at::stack({predicted, exp.sum(1)});  // [2, tokens]: one collective
    if (comm->size() > 1) AllReduce(sums, comm::ReduceOp::kSum, *comm, what + " all_reduce(sum)");

    const at::Tensor loss = (sums[1].log() - sums[0]).mean();
    ctx->save_for_backward({exp / sums[1].unsqueeze(1), local, outside});
    ctx->saved_data["tokens"] = tokens;
    ctx->saved_data["shape"] = logits.sizes().vec();
    ctx->saved_data["dtype"] = logits.scalar_type();
    return loss.to(logits.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& softmax = saved[0];
    const at::Tensor& local = saved[1];
    const at::Tensor& outside = saved[2];
    const double tokens = static_cast<double>(ctx->saved_data["tokens"].toInt());
    // softmax - one_hot(target) on this shard (the one-hot is zero where another rank owns the
    // target), times d loss / d mean.
    at::Tensor grad = softmax.clone();
    grad.scatter_add_(1, local.unsqueeze(1),
                      outside.logical_not().to(grad.scalar_type()).neg().unsqueeze(1));
    grad.mul_(grads[0].to(grad.scalar_type()) / tokens);
    const std::vector<int64_t> shape = ctx->saved_data["shape"].toIntVector();
    return {grad.reshape(shape).to(ctx->saved_data["dtype"].toScalarType()), at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits_parallel,
                                        const at::Tensor& targets, comm::Communicator& comm) {
  const std::string context = absl::StrCat("model_parallel::vocab_parallel_cross_entropy rank ",
                                           comm.rank(), "/", comm.size());
  auto fail = [&](const std::string& message) {
    base::ThrowIfError(absl::InvalidArgumentError(message), context);
  };
  if (!logits_parallel.defined() || logits_parallel.dim() < 1 ||
      !at::isFloatingType(logits_parallel.scalar_type())) {
    fail(absl::StrCat("logits_parallel must be a floating tensor of at least 1 dimension, got ",
                      Shape(logits_parallel)));
  }
  if (!targets.defined() || targets.scalar_type() != at::kLong ||
      targets.sizes() != logits_parallel.sizes().slice(0, logits_parallel.dim() - 1)) {
    fail(absl::StrCat(
        "targets must be int64 of the logits' shape without the last dimension: "
        "logits_parallel ",
        Shape(logits_parallel), ", targets ", Shape(targets),
        targets.defined() ? absl::StrCat(" ", c10::toString(targets.scalar_type())) : ""));
  }
  return VocabParallelCrossEntropy::apply(logits_parallel, targets, &comm);
}

}  // namespace fairscale::model_parallel
