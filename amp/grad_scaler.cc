#include "amp/grad_scaler.h"

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/full.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <tuple>
#include <unordered_set>
#include <utility>
#include <vector>

namespace fairscale::amp {
namespace {

void CheckOptions(const std::string& who, double growth_factor, double backoff_factor,
                  int64_t growth_interval) {
  TORCH_CHECK(std::isfinite(growth_factor) && growth_factor > 1.0, who,
              ": growth_factor must be a finite number > 1, got ", growth_factor);
  TORCH_CHECK(backoff_factor > 0.0 && backoff_factor < 1.0, who,
              ": backoff_factor must be in (0, 1), got ", backoff_factor);
  TORCH_CHECK(growth_interval > 0, who, ": growth_interval must be > 0, got ", growth_interval);
}

void CheckScale(const std::string& who, double scale) {
  TORCH_CHECK(std::isfinite(scale) && scale > 0.0 &&
                  scale <= std::numeric_limits<float>::max(),
              who, ": the scale must be a positive finite float, got ", scale);
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options)
    : options_(options), scale_(static_cast<float>(options.init_scale())) {
  CheckOptions("GradScaler", options_.growth_factor(), options_.backoff_factor(),
               options_.growth_interval());
  CheckScale("GradScaler: init_scale", options_.init_scale());
}

GradScaler::~GradScaler() = default;

std::string GradScaler::name() const { return "GradScaler"; }

void GradScaler::sync_found_inf(at::Tensor& /*flags*/, c10::Device /*grads_device*/) {}

void GradScaler::CheckInitialized(const char* method) const {
  TORCH_CHECK(initialized_, name(), ": ", method,
              "() called before scale(): call scale(loss).backward() first in the iteration");
}

at::Tensor GradScaler::scale(const at::Tensor& loss) {
  TORCH_CHECK(loss.defined(), name(), ": scale() got an undefined tensor");
  if (!is_enabled()) return loss;
  TORCH_CHECK(at::isFloatingType(loss.scalar_type()), name(),
              ": scale() needs a floating-point loss, got ", loss.scalar_type());
  initialized_ = true;
  return loss * static_cast<double>(scale_);
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!is_enabled()) return;
  CheckInitialized("unscale_");
  OptimizerState& state = per_optimizer_[&optimizer];
  TORCH_CHECK(state.stage != Stage::kUnscaled, name(),
              ": unscale_() has already been called on this optimizer since the last update()");
  TORCH_CHECK(state.stage != Stage::kStepped, name(),
              ": unscale_() is being called after step() (call update() first)");

  // PyTorch computes 1/scale in double and rounds it to float; the gradients are multiplied by
  // that float (in float arithmetic, also for fp16/bf16 gradients).
  const float inv_scale = static_cast<float>(1.0 / static_cast<double>(scale_));
  bool found_inf = false;
  bool has_grads = false;
  c10::optional<c10::Device> grads_device;
  // CUDA gradients go through ATen's fused kernel per (device, dtype). LibTorch 1.13 registers
  // _amp_foreach_non_finite_check_and_unscale_ for CUDA only ("Could not run ... with arguments
  // from the 'CPU' backend"), so CPU gradients are checked with isfinite().all() and scaled with
  // mul_ one by one, with the same arithmetic.
  std::map<std::pair<c10::DeviceIndex, c10::ScalarType>, std::vector<at::Tensor>> cuda_grads;
  // LibTorch optimizers accept a tensor listed twice (tied weights); unscale its gradient once.
  std::unordered_set<const c10::TensorImpl*> seen;
  for (auto& group : optimizer.param_groups()) {
    for (auto& param : group.params()) {
      at::Tensor& grad = param.mutable_grad();
      if (!grad.defined() || !seen.insert(grad.unsafeGetTensorImpl()).second) continue;
      TORCH_CHECK(!grad.is_sparse(), name(), ": sparse gradients are not supported");
      TORCH_CHECK(at::isFloatingType(grad.scalar_type()), name(),
                  ": unscale_() got a gradient of dtype ", grad.scalar_type());
      has_grads = true;
      if (!grads_device) grads_device = grad.device();
      if (grad.is_cuda()) {
        cuda_grads[{grad.device().index(), grad.scalar_type()}].push_back(grad);
        continue;
      }
      TORCH_CHECK(grad.is_cpu(), name(), ": unscale_() supports CPU and CUDA gradients, got ",
                  grad.device());
      if (!found_inf && grad.numel() > 0 && !at::isfinite(grad).all().item<bool>()) {
        found_inf = true;
      }
      grad.mul_(static_cast<double>(inv_scale));
    }
  }
  for (auto& entry : cuda_grads) {
    const c10::Device device(c10::kCUDA, entry.first.first);
    const auto on_device = at::TensorOptions().dtype(at::kFloat).device(device);
    at::Tensor found = at::zeros({1}, on_device);
    at::Tensor inv = at::full({1}, inv_scale, on_device);
    at::_amp_foreach_non_finite_check_and_unscale_(entry.second, found, inv);
    if (found.item<float>() != 0.0f) found_inf = true;
  }

  // The gradients are unscaled from here on. Should the agreement fail (sync_found_inf raises),
  // the optimizer counts as unscaled with an inf: a later step() skips instead of unscaling the
  // gradients a second time.
  state.stage = Stage::kUnscaled;
  state.found_inf = true;
  state.has_grads = has_grads;
  at::Tensor flags = at::zeros({2}, at::kFloat);
  flags[0] = found_inf ? 1.0 : 0.0;
  flags[1] = has_grads ? 1.0 : 0.0;
  sync_found_inf(flags, grads_device.value_or(c10::Device(c10::kCPU)));
  state.found_inf = flags[0].item<float>() != 0.0f;
  state.has_grads = flags[1].item<float>() != 0.0f;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!is_enabled()) {
    optimizer.step();
    return true;
  }
  CheckInitialized("step");
  auto it = per_optimizer_.find(&optimizer);
  TORCH_CHECK(it == per_optimizer_.end() || it->second.stage != Stage::kStepped, name(),
              ": step() has already been called on this optimizer since the last update()");
  if (it == per_optimizer_.end() || it->second.stage == Stage::kReady) {
    unscale_(optimizer);
    it = per_optimizer_.find(&optimizer);
  }
  OptimizerState& state = it->second;
  TORCH_CHECK(state.has_grads, name(),
              ": step(): none of the optimizer's parameters has a gradient (no inf checks were "
              "recorded); run scale(loss).backward() before step()");
  state.stage = Stage::kStepped;
  if (state.found_inf) return false;
  optimizer.step();
  return true;
}

void GradScaler::update(c10::optional<double> new_scale) {
  if (!is_enabled()) return;
  CheckInitialized("update");
  if (new_scale.has_value()) {
    CheckScale(name() + ": update(new_scale)", *new_scale);
    scale_ = static_cast<float>(*new_scale);
  } else {
    bool recorded = false;
    bool found_inf = false;
    for (const auto& entry : per_optimizer_) {
      if (entry.second.stage == Stage::kReady || !entry.second.has_grads) continue;
      recorded = true;
      found_inf = found_inf || entry.second.found_inf;
    }
    TORCH_CHECK(recorded, name(),
                ": update(): no inf checks were recorded this iteration; call step(optimizer) "
                "(or unscale_) after scale(loss).backward()");
    // The arithmetic of ATen's _amp_update_scale_ kernel (float scale times double factor,
    // rounded to float; a growth to inf is dropped). It runs here, on the host, because the
    // found-inf flag already is (and LibTorch 1.13 has no CPU kernel for it either).
    if (found_inf) {
      scale_ = static_cast<float>(static_cast<double>(scale_) * options_.backoff_factor());
      growth_tracker_ = 0;
    } else if (growth_tracker_ + 1 == options_.growth_interval()) {
      const float grown =
          static_cast<float>(static_cast<double>(scale_) * options_.growth_factor());
      if (std::isfinite(grown)) scale_ = grown;
      growth_tracker_ = 0;
    } else {
      ++growth_tracker_;
    }
  }
  per_optimizer_.clear();
}

double GradScaler::get_scale() const {
  return is_enabled() ? static_cast<double>(scale_) : 1.0;
}

void GradScaler::set_growth_factor(double growth_factor) {
  CheckOptions(name(), growth_factor, options_.backoff_factor(), options_.growth_interval());
  options_.growth_factor(growth_factor);
}

void GradScaler::set_backoff_factor(double backoff_factor) {
  CheckOptions(name(), options_.growth_factor(), backoff_factor, options_.growth_interval());
  options_.backoff_factor(backoff_factor);
}

void GradScaler::set_growth_interval(int64_t growth_interval) {
  CheckOptions(name(), options_.growth_factor(), options_.backoff_factor(), growth_interval);
  options_.growth_interval(growth_interval);
}

GradScalerState GradScaler::state_dict() const {
  GradScalerState state;
  state.enabled = is_enabled();
  state.scale = static_cast<double>(scale_);
  state.growth_factor = options_.growth_factor();
  state.backoff_factor = options_.backoff_factor();
  state.growth_interval = options_.growth_interval();
  state.growth_tracker = growth_tracker_;
  return state;
}

void GradScaler::load_state_dict(const GradScalerState& state) {
  if (!is_enabled()) return;
  TORCH_CHECK(state.enabled, name(),
              ": load_state_dict(): the state was saved from a disabled GradScaler");
  CheckOptions(name() + ": load_state_dict()", state.growth_factor, state.backoff_factor,
               state.growth_interval);
  CheckScale(name() + ": load_state_dict()", state.scale);
  TORCH_CHECK(state.growth_tracker >= 0 && state.growth_tracker < state.growth_interval, name(),
              ": load_state_dict(): growth tracker ", state.growth_tracker,
              " out of range for growth_interval ", state.growth_interval);
  options_.growth_factor(state.growth_factor)
      .backoff_factor(state.backoff_factor)
      .growth_interval(state.growth_interval);
  scale_ = static_cast<float>(state.scale);
  growth_tracker_ = state.growth_tracker;
  initialized_ = true;
  per_optimizer_.clear();
}

void GradScaler::save(torch::serialize::OutputArchive& archive) const {
  const GradScalerState s = state_dict();
  archive.write("grad_scaler_format", c10::IValue(int64_t{1}));
  archive.write("enabled", c10::IValue(s.enabled));
  archive.write("scale", c10::IValue(s.scale));
  archive.write("growth_factor", c10::IValue(s.growth_factor));
  archive.write("backoff_factor", c10::IValue(s.backoff_factor));
  archive.write("growth_interval", c10::IValue(s.growth_interval));
  archive.write("_growth_tracker", c10::IValue(s.growth_tracker));
}

void GradScaler::load(torch::serialize::InputArchive& archive) {
  auto read = [&](const char* key) {
    c10::IValue v;
    TORCH_CHECK(archive.try_read(key, v), name(), ": load(): the archive has no '", key,
                "' (not a GradScaler state)");
    return v;
  };
  read("grad_scaler_format");
  GradScalerState s;
  s.enabled = read("enabled").toBool();
  s.scale = read("scale").toDouble();
  s.growth_factor = read("growth_factor").toDouble();
  s.backoff_factor = read("backoff_factor").toDouble();
  s.growth_interval = read("growth_interval").toInt();
  s.growth_tracker = read("_growth_tracker").toInt();
  load_state_dict(s);
}

void save_grad_scaler(const GradScaler& scaler, const std::string& path) {
  torch::serialize::OutputArchive archive;
  scaler.save(archive);
  const std::string tmp = path + ".tmp";
  try {
    archive.save_to(tmp);
  } catch (const c10::Error& e) {
    std::remove(tmp.c_str());
    TORCH_CHECK(false, "save_grad_scaler: writing '", tmp,
                "' failed: ", e.what_without_backtrace());
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    TORCH_CHECK(false, "save_grad_scaler: renaming '", tmp, "' to '", path,
                "' failed: ", std::strerror(err));
  }
}

void load_grad_scaler(GradScaler& scaler, const std::string& path) {
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(path);
    scaler.load(archive);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "load_grad_scaler('", path, "'): ", e.what_without_backtrace());
  }
}

}  // namespace fairscale::amp
