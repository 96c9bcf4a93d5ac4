// AdaScale: FairScale's AdaScale (Johnson et al., ICML 2020) for LibTorch, //adascale. Wraps a
// torch::optim optimizer used for data-parallel training at a large batch and scales each param
// group's learning rate by the "gain ratio" r = (var + sqr) / (var / S + sqr), estimated from how
// much the ranks' (and micro-batches') gradients disagree: r is 1 when every worker sees the same
// gradient (a bigger batch gives nothing) and S when the gradients are pure noise (S times the
// batch is worth S steps). The sum of the gains is the "scale-invariant iterations" (progress()),
// the clock to drive the LR schedule by.
//
// LibTorch has no DDP backward hooks, so the protocol is explicit: the caller hands AdaScale the
// LOCAL gradients before they are averaged.
//
//   adascale::AdaScale ada(sgd, comm, adascale::AdaScaleOptions().num_gradients_to_accumulate(2));
//   ada.zero_grad();
//   for (int m = 0; m < 2; ++m) {
//     loss(model(x[m]), y[m]).backward();   // the micro-batch's own loss, not divided by 2
//     ada.accumulate_local_gradients();     // this backward's local squared norms, per group
//   }
//   ada.average_gradients();                // or your own all-reduce (kAvg) of every .grad
//   ada.step();                             // ONE all-reduce of the statistics, lr *= gain, step
//   schedule_lr(ada.progress());            // scale-invariant iterations
//
// Statistics (FairScale's, paper appendix B.3, debiased EWMA): with c =
// num_gradients_to_accumulate, N = world size, n = cN gradients g_i per step, S = scale() (default
// n), per param group:
//   local = sum_i |g_i|^2 (the one all-reduce, f64),  total = |grad|^2 / c^2 (grad averaged, f64)
//   var = local * (S/n) / (n-1) - total * S / (n-1)   (clamped to >= 1e-6)
//   sqr = total - var / S                             (clamped to >= 0)
// each smoothed by a debiased exponential moving average with factor smoothing() (default
// max(1 - n/1000, 0); AdaScaleOptions::debias_ewma(false): appendix B.3's); n must be >= 2 (a
// single worker without accumulation has no variance).
// accumulate_local_gradients() takes each backward's own gradient as the change of .grad since
// the previous call, so with c > 1 it keeps a copy of the gradients between backward passes.
//
// Sharded gradients (FSDP after its reduce-scatter, OSS with ShardedDataParallel): with
// AdaScaleOptions::sharded_gradients, each rank's .grad holds a disjoint part of the averaged
// gradient; its squared norm is summed over the ranks in the same all-reduce (exact in f64;
// divided by gradient_replicas when each shard is held by several ranks, HYBRID_SHARD).
// The local squares must then come from the gradients before the reduction: for FSDP,
// AdaScaleFsdp (fsdp_adapter.h, //adascale:fsdp) feeds them from FSDP's local gradient hook
// through accumulate_local_grad_sqr(per_group); for ShardedDataParallel, run every backward
// under no_sync() with accumulate_local_gradients() after each, then reduce(), or attach
// AdaScaleSdp (sdp_adapter.h, //adascale:oss), fed by ShardedDataParallel's local gradient hook.
//
// Every rank must call step(), average_gradients() and the constructor together (collectives).
// Errors raise c10::Error through //base:torch_error: "adascale::AdaScale::step rank 1/4: ...".
#pragma once

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace fairscale::adascale {

struct AdaScaleOptions {
  // Batch-size scale relative to the baseline, >= 1; nullopt: world size * accumulation.
  TORCH_ARG(std::optional<double>, scale) = std::nullopt;
  // EMA factor in [0, 1); nullopt: max(1 - world size * accumulation / 1000, 0).
  TORCH_ARG(std::optional<double>, smoothing) = std::nullopt;
  // Backward passes (accumulate_local_gradients / accumulate_local_grad_sqr calls) per step.
  TORCH_ARG(int64_t, num_gradients_to_accumulate) = 1;
  // Each rank's .grad is a disjoint shard of the averaged gradient (see above).
  TORCH_ARG(bool, sharded_gradients) = false;
  // With sharded_gradients: how many ranks hold each shard (FSDP's HYBRID_SHARD: the replicate
  // group size), so that the squares summed over the ranks are divided by it. >= 1, and it must
  // divide the world size.
  TORCH_ARG(int64_t, gradient_replicas) = 1;
  // FairScale's debias_ewma: true, the debiased EWMA above; false, the paper's appendix B.3
  // (the plain mean of the first 1 / (1 - smoothing) steps' values, then the EWMA).
  TORCH_ARG(bool, debias_ewma) = true;
};

class AdaScale {
 public:
  // `inner` must outlive this object; its param groups are the ones scaled (groups added to it
  // later are picked up at the next step with the initial statistics). Collective-free.
  AdaScale(torch::optim::Optimizer& inner, std::shared_ptr<comm::Communicator> comm,
           AdaScaleOptions options = {});

  // After every backward: adds the squared norm of each gradient's change since the previous
  // call (this backward's local gradient) to its group's local sum. Must precede the averaging.
  void accumulate_local_gradients();
  // The same from squared norms the caller computed (one per param group, this rank's share of
  // sum_i |g_i|^2 for this backward), for gradients AdaScale cannot see (the FSDP and SDP
  // adapters). One step must use one of the two: mixing them raises FAILED_PRECONDITION (e.g.
  // accumulate_local_gradients() called with an adapter attached, which would count each
  // backward twice).
  void accumulate_local_grad_sqr(const std::vector<double>& per_group);
  // True while the next backward is not the last of this step (run it without communication).
  bool is_accumulation_step() const;

  // Collective: replaces every .grad of the inner optimizer by its mean over the ranks
  // (DDP's averaging). Not for sharded gradients.
  void average_gradients();

  // Collective: after num_gradients_to_accumulate() local accumulations (and the averaging),
  // updates the statistics with one all-reduce, steps the inner optimizer with every group's lr
  // multiplied by gain(group), restores the lrs and adds gain() to progress().
  at::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr);

  // Zeroes the inner optimizer's gradients; refuses in the middle of an accumulation.
  void zero_grad();

  // The gain of one param group, or of all (their var and sqr summed), from the statistics of
  // the last step (1 before the first).
  double gain() const;
  double gain(size_t group) const;
  double grad_sqr_avg(size_t group) const { return sqr_avg_.at(group); }
  double grad_var_avg(size_t group) const { return var_avg_.at(group); }
  // Scale-invariant iterations: the sum of gain() over the steps taken.
  double progress() const { return progress_; }

  double scale() const { return scale_; }
  // Changes the scale; with update_estimate the variance estimates are rescaled by old/new
  // (FairScale's set_scale). Not during an accumulation.
  void set_scale(double scale, bool update_estimate = true);
  double smoothing() const { return smoothing_; }
  bool sharded_gradients() const { return sharded_; }
  int64_t gradient_replicas() const { return replicas_; }
  int64_t num_gradients_to_accumulate() const { return accum_; }
  // With update_smoothing, smoothing becomes max(1 - world * n / 1000, 0).
  void set_num_gradients_to_accumulate(int64_t n, bool update_smoothing = true);

  // AdaScale's own state (statistics, progress, scale, smoothing, accumulation count, EWMA
  // mode); save the inner optimizer separately (torch::save(inner, ...)). Not during an
  // accumulation. load raises kDataLoss for an archive that is not AdaScale's, kInvalidArgument
  // when its param-group count differs from the optimizer's or its values are invalid here.
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

  torch::optim::Optimizer& optimizer() { return inner_; }
  const std::shared_ptr<comm::Communicator>& communicator() const { return comm_; }

 private:
  std::string label(const std::string& op) const;
  void ensure_groups();
  void require_idle(const std::string& op) const;
  // Refuses an accumulation from another source than the step's earlier ones.
  void check_source(bool squares, const std::string& op);
  c10::Device device() const;

  torch::optim::Optimizer& inner_;
  std::shared_ptr<comm::Communicator> comm_;
  bool sharded_;
  int64_t replicas_;
  double scale_;
  double smoothing_;
  int64_t accum_;
  int64_t calls_ = 0;     // accumulations since the last step
  bool squares_ = false;  // this step's accumulations came from accumulate_local_grad_sqr
  at::Tensor local_sqr_;  // [groups] f64 on device(), this step's local sums
  // Gradients after the previous accumulation of this step (only with accum_ > 1).
  std::vector<std::vector<at::Tensor>> previous_;
  std::vector<double> sqr_avg_, var_avg_;  // the averages gain() uses
  std::vector<double> sqr_biased_, var_biased_, unbias_;
  // debias_ewma false: the steps averaged so far and the running sums of the first steps.
  bool debias_;
  int64_t ewma_count_ = 0;
  std::vector<double> sqr_total_, var_total_;
  double progress_ = 0.0;
};

// torch::save(ada, path) / torch::load(ada, path).
torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const AdaScale& ada);
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, AdaScale& ada);

}  // namespace fairscale::adascale
