// SlowMo and LocalSGD (FairScale's SlowMoDistributedDataParallel with localsgd / slowmo, Wang et
// al. 2020; the DiLoCo family): communication-efficient data parallel. Every rank runs its base
// optimizer on its own gradients (no gradient all-reduce) and, every `frequency` (H) steps, the
// ranks average their parameters exactly with one all-reduce per dtype, then optionally take the
// slow-momentum outer step:
//
//   x_avg = (1/N) sum_r x_r                          (all-reduce sum in the parameter dtype, / N)
//   u     = beta * u + (x_prev - x_avg) / base_lr    (u starts at 0)
//   x     = x_prev - alpha * base_lr * u;  x_prev = x
//
// alpha = slowmo_lr, beta = slowmo_momentum. With alpha = 1 and beta = 0 (the defaults) this is
// plain LocalSGD: the parameters become x_avg exactly (the outer state is not even kept).
//
//   slowmo::SlowMo slowmo(model->parameters(), comm,
//                         slowmo::SlowMoOptions().frequency(4).slowmo_lr(1).slowmo_momentum(0.5)
//                             .base_lr(1e-3));
//   for (...) { loss.backward(); opt.step(); slowmo.step_completed(); }
//
// Contract: every rank constructs SlowMo with the same parameters in the same order (same shapes
// and dtypes) and the same values (the outer step starts from each rank's own x_prev; broadcast
// the initial parameters first if they may differ), and calls step_completed() once after every
// base optimizer step. The base optimizer's own state (momentum, Adam moments) stays local, as in
// FairScale. Errors raise c10::Error "slowmo::SlowMo::<method> rank r/N: <CODE>: <message>".
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "comm/communicator.h"

namespace fairscale::slowmo {

struct SlowMoOptions {
  // H: average every `frequency` base steps (>= 1; 1 = after every step).
  SlowMoOptions& frequency(int64_t h) { frequency_ = h; return *this; }
  // alpha (> 0): the outer learning rate, in units of base_lr.
  SlowMoOptions& slowmo_lr(double alpha) { slowmo_lr_ = alpha; return *this; }
  // beta in [0, 1): the slow momentum.
  SlowMoOptions& slowmo_momentum(double beta) { slowmo_momentum_ = beta; return *this; }
  // The base optimizer's learning rate (> 0); u is kept in units of it, as in the paper.
  SlowMoOptions& base_lr(double lr) { base_lr_ = lr; return *this; }

  int64_t frequency() const { return frequency_; }
  double slowmo_lr() const { return slowmo_lr_; }
  double slowmo_momentum() const { return slowmo_momentum_; }
  double base_lr() const { return base_lr_; }
  // alpha == 1 and beta == 0: plain parameter averaging, no outer state.
  bool is_local_sgd() const { return slowmo_lr_ == 1.0 && slowmo_momentum_ == 0.0; }

 private:
  int64_t frequency_ = 1;
  double slowmo_lr_ = 1.0;
  double slowmo_momentum_ = 0.0;
  double base_lr_ = 1.0;
};

// What state_dict() returns, for checkpoints: the number of completed base steps and, per dtype
// bucket (in the order of the constructor's parameters' first appearance), the flat outer
// parameters x_prev and slow momentum u (empty for LocalSGD).
struct SlowMoState {
  int64_t steps = 0;
  std::vector<at::Tensor> prev_params;
  std::vector<at::Tensor> momentum;
};

class SlowMo {
 public:
  SlowMo(std::vector<at::Tensor> params, std::shared_ptr<comm::Communicator> comm,
         SlowMoOptions options = {});

  // Call after each base optimizer step: counts it and, when it completes a round of H steps,
  // averages (and takes the outer step). Returns whether it averaged.
  bool step_completed();
  // Averages when `step` (0-based index of the base step just taken) completes a round of H,
  // i.e. (step + 1) % H == 0; does not touch the step counter. Returns whether it averaged.
  bool maybe_average(int64_t step);
  // Averages now (and takes the outer step), regardless of the step count.
  void average();

  // For a learning-rate schedule: the base_lr the next outer step divides / multiplies by.
  void set_base_lr(double lr);

  SlowMoState state_dict() const;
  void load_state_dict(const SlowMoState& state);

  int64_t steps() const { return steps_; }
  const SlowMoOptions& options() const { return options_; }

 private:
  // Parameters of one dtype, averaged with one flat all-reduce.
  struct Bucket {
    std::vector<at::Tensor> params;
    at::Tensor flat;       // communication buffer, the parameters' dtype
    at::Tensor prev;       // x_prev (outer state dtype: f64 for f64, else f32); undefined for LocalSGD
    at::Tensor momentum;   // u, same dtype as prev
  };

  std::string Context(const char* method) const;

  std::shared_ptr<comm::Communicator> comm_;
  SlowMoOptions options_;
  std::vector<Bucket> buckets_;
  int64_t steps_ = 0;
};

}  // namespace fairscale::slowmo
