// GradScaler: dynamic loss scaling for mixed-precision training (//amp), the LibTorch counterpart
// of torch.cuda.amp.GradScaler. The training loop multiplies the loss by a scale factor before
// backward (so small fp16 gradients do not flush to zero), and the scaler divides the gradients
// back before the optimizer steps, skips any step whose gradients hold an inf or NaN, and adapts
// the scale: backed off after an overflow, grown after `growth_interval` clean steps.
//
//   amp::GradScaler scaler(amp::GradScalerOptions().init_scale(65536));
//   for (...) {
//     opt.zero_grad();
//     scaler.scale(loss_fn(model(x), y)).backward();
//     scaler.unscale_(opt);            // optional: only to look at / clip the true gradients
//     model->clip_grad_norm_(1.0);
//     scaler.step(opt);                // false: skipped, the gradients were not finite
//     scaler.update();
//   }
//
// Per optimizer, each iteration goes READY -> (unscale_) UNSCALED -> (step) STEPPED -> (update)
// READY; unscale_ twice, unscale_ after step, or step twice before update() raise c10::Error.
// With sharded models (FSDP, OSS, ShardedDataParallel) use ShardedGradScaler
// (sharded_grad_scaler.h): a plain GradScaler decides per rank, so one rank may skip a step
// that the others take.
//
// State (scale, growth tracker) lives on the host: the skip decision needs the found-inf flag on
// the host anyway, so keeping the scale there costs no extra device synchronisation and makes
// scale() free of any. Not thread-safe; one scaler per training loop.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdint>
#include <map>
#include <string>

namespace fairscale::amp {

struct GradScalerOptions {
  // The scale before the first update (PyTorch's default 2^16).
  TORCH_ARG(double, init_scale) = 65536.0;
  // Multiplies the scale after `growth_interval` consecutive steps without inf/NaN; > 1.
  TORCH_ARG(double, growth_factor) = 2.0;
  // Multiplies the scale after a step with inf/NaN gradients; in (0, 1).
  TORCH_ARG(double, backoff_factor) = 0.5;
  // Clean steps between two growths; > 0.
  TORCH_ARG(int64_t, growth_interval) = 2000;
  // false: scale() returns the loss, step() always steps, update() does nothing.
  TORCH_ARG(bool, enabled) = true;
};

// What state_dict() returns: the fields of PyTorch's GradScaler.state_dict() ("scale",
// "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker") and whether the
// scaler was enabled (PyTorch returns an empty dict then).
struct GradScalerState {
  bool enabled = true;
  double scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  int64_t growth_tracker = 0;
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});
  virtual ~GradScaler();
  GradScaler(const GradScaler&) = delete;
  GradScaler& operator=(const GradScaler&) = delete;

  // loss * scale, same dtype, shape and device as `loss` (PyTorch's result has shape [1] and
  // dtype float32 for a scalar loss). Disabled: `loss` itself.
  at::Tensor scale(const at::Tensor& loss);

  // Divides the gradients of `optimizer`'s parameters by the scale, in place, and records
  // whether any of them holds an inf or NaN. At most once per optimizer between two update()
  // calls, and not after step(). Gradients of any floating dtype are accepted (PyTorch refuses
  // fp16 ones; FairScale's scaler allows them, which pure-fp16 sharded training needs). Sparse
  // gradients are not supported.
  void unscale_(torch::optim::Optimizer& optimizer);

  // unscale_(optimizer) unless already done this iteration, then optimizer.step() unless some
  // gradient was inf/NaN. Returns whether the optimizer stepped. Raises c10::Error if none of the
  // optimizer's parameters has a gradient (backward was not run). Disabled: optimizer.step(),
  // returns true.
  bool step(torch::optim::Optimizer& optimizer);

  // Ends the iteration. Without `new_scale`: backs the scale off if any optimizer unscaled this
  // iteration saw inf/NaN (and resets the growth tracker), else counts a clean step and grows the
  // scale after growth_interval of them (a growth that would overflow to inf is not applied).
  // With `new_scale` (> 0, finite): sets the scale, growth tracker unchanged.
  void update(c10::optional<double> new_scale = c10::nullopt);

  // The current scale (1.0 when disabled).
  double get_scale() const;
  int64_t growth_tracker() const { return growth_tracker_; }
  bool is_enabled() const { return options_.enabled(); }
  const GradScalerOptions& options() const { return options_; }
  void set_growth_factor(double growth_factor);
  void set_backoff_factor(double backoff_factor);
  void set_growth_interval(int64_t growth_interval);

  GradScalerState state_dict() const;
  // No-op on a disabled scaler; c10::Error for a state saved from a disabled one.
  void load_state_dict(const GradScalerState& state);

  // Into / from a torch::serialize archive (keys as in state_dict), e.g. next to
  // fsdp::save_local_checkpoint's files; see also save_grad_scaler / load_grad_scaler.
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

 protected:
  // Called by unscale_ with this rank's verdict: `flags` is a CPU float tensor
  // {found_inf (0 or 1), has_grads (0 or 1)}; the override may replace the values (e.g. by their
  // maximum over the ranks) before the scaler decides. `grads_device` is the device of the
  // optimizer's (first) gradient, CPU if it has none. Must raise c10::Error on failure.
  virtual void sync_found_inf(at::Tensor& flags, c10::Device grads_device);
  // Prefix of error messages ("GradScaler", "ShardedGradScaler rank 1/4").
  virtual std::string name() const;

 private:
  enum class Stage { kReady, kUnscaled, kStepped };
  struct OptimizerState {
    Stage stage = Stage::kReady;
    bool found_inf = false;
    bool has_grads = false;
  };
  void CheckInitialized(const char* method) const;

  GradScalerOptions options_;
  // float, like PyTorch's scale tensor, so the arithmetic rounds the same way.
  float scale_;
  int64_t growth_tracker_ = 0;
  // Set by the first scale() (or load_state_dict): unscale_/step/update before it are misuse.
  bool initialized_ = false;
  std::map<const torch::optim::Optimizer*, OptimizerState> per_optimizer_;
};

// Writes the scaler's state to "<path>.tmp" and renames it over `path` (never a torn file).
void save_grad_scaler(const GradScaler& scaler, const std::string& path);
// c10::Error naming `path` if it cannot be read or is not a scaler checkpoint.
void load_grad_scaler(GradScaler& scaler, const std::string& path);

}  // namespace fairscale::amp
