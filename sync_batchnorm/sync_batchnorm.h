// SyncBatchNorm (//sync_batchnorm): batch normalization whose batch statistics are those of the
// whole batch spread over the ranks of a communicator, for data-parallel training with small
// per-rank batches (detection, segmentation, 3-D models). PyTorch's torch.nn.SyncBatchNorm and
// FairScale 0.4.13's fairscale.experimental.nn.SyncBatchNorm in LibTorch, and
// convert_sync_batchnorm() to turn the torch::nn::BatchNorm{1,2,3}d of an existing model into it.
//
// Contract (n = comm->size(), C = num_features, x [N, C, *] on this rank, N may be 0; "the batch"
// = every rank's x concatenated along dim 0, of M = sum over ranks of N * prod(*) values per
// channel):
// * Batch statistics are used when is_training() or !track_running_stats (as BatchNorm). Then
//   forward computes this rank's per-channel sum and sum of squares (in f64, from a temporary
//   f64 copy of x for narrower dtypes: E[x^2] - mean^2 cancels) and count, runs ONE all-reduce
//   (sum) of [sum, sumsq, count] (2C + 1 doubles) over comm, and normalizes with the batch's
//   mean and biased variance var = sumsq / M - mean^2:
//   y = (x - mean) / sqrt(var + eps) * weight + bias (weight/bias only when affine). The result
//   equals torch::nn::BatchNorm on the batch in one process (tested at 1-4 ranks with odd
//   and zero per-rank batch sizes: within 7.4e-7 relative in f32, 3.2e-14 in f64).
// * Running statistics (training and track_running_stats): num_batches_tracked += 1;
//   f = momentum, or 1 / num_batches_tracked when momentum is nullopt (cumulative average);
//   running_mean = (1 - f) running_mean + f mean; running_var = (1 - f) running_var +
//   f var * M / (M - 1) (unbiased). Identical on every rank of comm.
// * Backward (when x requires grad): ONE all-reduce (sum) of [sum(dy), sum(dy * xhat)] per
//   channel (2C doubles), then the batch-norm backward with the batch's M:
//   dx = weight / sqrt(var + eps) * (dy - sum(dy) / M - xhat * sum(dy * xhat) / M).
//   d weight = this rank's sum(dy * xhat), d bias = this rank's sum(dy): the gradient of this
//   rank's part of the loss, as in PyTorch, so that data-parallel gradient averaging (DDP, FSDP,
//   OSS's ShardedDataParallel) gives the full batch's gradient. When x does not require grad
//   there is no backward all-reduce (every rank has the same graph, so all agree).
// * Eval with track_running_stats: the running statistics, no communication at all.
// * Collective: every rank of comm calls forward together (and backward, where x requires grad)
//   with the same C and dtype; N may differ, and may be 0: an empty rank takes part in the
//   collectives with zeros and gets empty outputs and gradients. comm may be a sub-communicator
//   (Communicator::Split): each group normalizes over its own ranks only.
// * Errors (c10::Error "sync_batchnorm::SyncBatchNorm::forward rank r/n x [shape]: CODE: ..."):
//   null comm (at construction), x.dim() < 2, x.size(1) != C (before anything is sent, so when
//   every rank has the same bad input every rank raises it; a rank alone with a bad input leaves
//   its peers to the communicator's timeout), and M <= 1 when batch statistics are needed
//   ("expected more than 1 value per channel", raised on every rank after the all-reduce:
//   PyTorch's check, extended to the whole group; M = 0 when every rank is empty). A failed
//   collective raises its Status (base/torch_error.h); the communicator is then broken.
// * Parameters and buffers are named as BatchNorm's ("weight", "bias", "running_mean",
//   "running_var", "num_batches_tracked"; undefined when !affine / !track_running_stats), so
//   state dicts interchange with torch::nn::BatchNorm{1,2,3}d.
// * Once differentiable (no double backward). comm is kept alive by the module and must stay
//   alive until the backward pass of every output.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <ostream>

#include "comm/communicator.h"

namespace fairscale::sync_batchnorm {

// torch::nn::BatchNormOptions' fields and defaults.
struct SyncBatchNormOptions {
  /* implicit */ SyncBatchNormOptions(int64_t num_features) : num_features_(num_features) {}
  // The options of an existing torch::nn::BatchNorm{1,2,3}d.
  explicit SyncBatchNormOptions(const torch::nn::BatchNormOptions& bn);

  // C, the channel dimension's size (dim 1 of the input).
  TORCH_ARG(int64_t, num_features);
  TORCH_ARG(double, eps) = 1e-5;
  // nullopt: the cumulative moving average (f = 1 / num_batches_tracked).
  TORCH_ARG(c10::optional<double>, momentum) = 0.1;
  TORCH_ARG(bool, affine) = true;
  TORCH_ARG(bool, track_running_stats) = true;
};

class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  SyncBatchNormImpl(const SyncBatchNormOptions& options,
                    std::shared_ptr<comm::Communicator> comm);
  // Converts a torch::nn::BatchNorm{1,2,3}d: its options and training mode, and its parameters
  // and buffers themselves (the same tensors, as PyTorch's convert_sync_batchnorm: an optimizer
  // that holds them keeps working).
  template <size_t D, typename Derived>
  SyncBatchNormImpl(const torch::nn::BatchNormImplBase<D, Derived>& bn,
                    std::shared_ptr<comm::Communicator> comm)
      : SyncBatchNormImpl(SyncBatchNormOptions(bn.options), std::move(comm), NoReset()) {
    adopt(bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.num_batches_tracked);
    train(bn.is_training());
  }

  // x [N, C, *] (2 or more dimensions; N may be 0). See the contract above.
  at::Tensor forward(const at::Tensor& x);

  // (Re)creates the parameters and buffers (weight 1, bias 0, running_mean 0, running_var 1,
  // num_batches_tracked 0), as BatchNorm's reset().
  void reset() override;
  void reset_running_stats();
  void reset_parameters();

  void pretty_print(std::ostream& stream) const override;

  const std::shared_ptr<comm::Communicator>& comm() const { return comm_; }

  SyncBatchNormOptions options;
  at::Tensor weight;               // [C] when affine
  at::Tensor bias;                 // [C] when affine
  at::Tensor running_mean;         // [C] when track_running_stats
  at::Tensor running_var;          // [C] when track_running_stats
  at::Tensor num_batches_tracked;  // int64 scalar when track_running_stats

 private:
  struct NoReset {};
  // Checks the arguments and registers nothing (adopt() does).
  SyncBatchNormImpl(const SyncBatchNormOptions& options, std::shared_ptr<comm::Communicator> comm,
                    NoReset);
  // Registers the given tensors themselves as the parameters and buffers.
  void adopt(const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& running_mean,
             const at::Tensor& running_var, const at::Tensor& num_batches_tracked);

  std::shared_ptr<comm::Communicator> comm_;
};
TORCH_MODULE(SyncBatchNorm);

// Replaces every torch::nn::BatchNorm1d/2d/3d in root's tree (root included) with a
// SyncBatchNorm over comm built by the converting constructor above (options, training mode,
// the same parameter and buffer tensors), and returns the new root: root itself, changed in
// place, unless root is a BatchNorm (then the new SyncBatchNorm). PyTorch's
// SyncBatchNorm.convert_sync_batchnorm(module, process_group).
//
// How the replacement reaches forward: LibTorch's containers call their children through their
// own lists, which are updated in place: torch::nn::Sequential (its AnyModules), ModuleList and
// ModuleDict, so a model built from them (at any depth) runs SyncBatchNorm afterwards. Any other
// parent gets Module::replace_module(name, ...), which changes what named_children(),
// parameters() and state dicts see, but NOT a typed member through which the parent's forward
// calls the child (`torch::nn::BatchNorm2d bn;` ... `bn(x)`): C++ cannot retype it, and that
// forward keeps running the old, unsynchronized BatchNorm. Such a model must hold its norms in
// a Sequential / ModuleList / ModuleDict (or as AnyModule called through a container), or
// construct SyncBatchNorm directly. A TORCH_WARN names every replaced BatchNorm that is still
// referenced from outside the module tree after the replacement (the sign of such a member, or
// of the caller holding it).
//
// Errors: null root or comm (c10::Error).
std::shared_ptr<torch::nn::Module> convert_sync_batchnorm(
    std::shared_ptr<torch::nn::Module> root, std::shared_ptr<comm::Communicator> comm);

}  // namespace fairscale::sync_batchnorm
