#include "amp/layerwise_gradient_scaler.h"

#include <ATen/ops/isfinite.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fairscale::amp {
namespace {

constexpr char kWho[] = "amp::LayerwiseGradientScaler";

bool InFloatRange(double factor) {
  return factor >= static_cast<double>(std::numeric_limits<float>::min()) &&
         factor <= static_cast<double>(std::numeric_limits<float>::max());
}

// g * factor in g's dtype: computed in float for f32/f16/bf16 (f16/bf16 converted once), in double
// for f64 or a factor float cannot hold.
at::Tensor Multiply(const at::Tensor& g, double factor) {
  const at::ScalarType dtype = g.scalar_type();
  if (dtype == at::kDouble) return g * factor;
  if (!InFloatRange(factor)) return (g.to(at::kDouble) * factor).to(dtype);
  if (dtype == at::kFloat) return g * factor;
  return (g.to(at::kFloat) * factor).to(dtype);
}

// The identity at a layer boundary: multiplies the gradient flowing back by `factor` and, when
// `flag` holds a tensor (a scalar bool on the gradient's device), ORs "the multiplied gradient is
// not finite" into it. The flag travels as an IValue, not a Tensor argument, so that autograd does
// not take it for an input.
class ScaleGradient : public torch::autograd::Function<ScaleGradient> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            double factor, const c10::IValue& flag) {
    ctx->saved_data["factor"] = factor;
    ctx->saved_data["flag"] = flag;
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor& g = grads[0];
    if (!g.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    at::Tensor scaled = Multiply(g, ctx->saved_data["factor"].toDouble());
    const c10::IValue& saved = ctx->saved_data["flag"];
    if (saved.isTensor()) saved.toTensor().logical_or_(at::isfinite(scaled).all().logical_not());
    return {scaled, at::Tensor(), at::Tensor()};
  }
};

void CheckOptions(const LayerwiseGradientScalerOptions& o) {
  TORCH_CHECK(o.growth_factor() > 1.0 && std::isfinite(o.growth_factor()), kWho,
              ": growth_factor must be > 1 (and finite), got ", o.growth_factor());
  TORCH_CHECK(o.backoff_factor() > 0.0 && o.backoff_factor() < 1.0, kWho,
              ": backoff_factor must be in (0, 1), got ", o.backoff_factor());
  TORCH_CHECK(o.growth_interval() > 0, kWho, ": growth_interval must be > 0, got ",
              o.growth_interval());
  TORCH_CHECK(std::isfinite(o.min_scale()) && std::isfinite(o.max_scale()) &&
                  o.min_scale() > 0.0 && o.min_scale() <= o.max_scale(),
              kWho, ": need 0 < min_scale <= max_scale, both finite; got min_scale ",
              o.min_scale(), ", max_scale ", o.max_scale());
}

}  // namespace

LayerwiseGradientScaler::LayerwiseGradientScaler(torch::nn::Sequential model,
                                                 const std::map<std::string, double>& scales,
                                                 LayerwiseGradientScalerOptions options)
    : model_(std::move(model)), options_(options) {
  CheckOptions(options_);
  TORCH_CHECK(!model_.is_empty(), kWho, ": the model is a null Sequential");
  TORCH_CHECK(!model_->is_empty(), kWho, ": the model is an empty Sequential (no layers)");
  std::unordered_map<const c10::TensorImpl*, std::string> owner;
  for (const auto& child : model_->named_children()) {
    Layer layer;
    layer.name = child.key();
    layer.module = child.value();
    for (const at::Tensor& p : layer.module->parameters()) {
      auto [it, inserted] = owner.emplace(p.unsafeGetTensorImpl(), layer.name);
      TORCH_CHECK(inserted || it->second == layer.name, kWho, ": layers '", it->second, "' and '",
                  layer.name, "' share a parameter; its gradient would mix two scales");
    }
    layers_.push_back(std::move(layer));
  }
  for (const auto& [name, scale] : scales) {
    Layer* found = nullptr;
    for (Layer& l : layers_) {
      if (l.name == name) found = &l;
    }
    if (found == nullptr) {
      std::ostringstream known;
      for (size_t i = 0; i < layers_.size(); ++i) known << (i ? ", " : "") << layers_[i].name;
      TORCH_CHECK(false, kWho, ": unknown layer '", name, "'; the Sequential's layers are: ",
                  known.str());
    }
    TORCH_CHECK(std::isfinite(scale) && scale >= options_.min_scale() &&
                    scale <= options_.max_scale(),
                kWho, ": the scale of layer '", name, "' must be finite and in [min_scale ",
                options_.min_scale(), ", max_scale ", options_.max_scale(), "], got ", scale);
    found->scaled = true;
    found->scale = scale;
  }
}

at::Tensor LayerwiseGradientScaler::forward(const at::Tensor& x) {
  const size_t n = layers_.size();
  at::Tensor h = x;
  if (h.requires_grad() && layers_[0].scale != 1.0) {
    h = ScaleGradient::apply(h, 1.0 / layers_[0].scale, c10::IValue());
  }
  size_t i = 0;
  for (auto& any : *model_) {
    h = any.forward<at::Tensor>(h);
    Layer& layer = layers_[i];
    const double next = i + 1 < n ? layers_[i + 1].scale : 1.0;
    if (h.requires_grad() && (layer.scale != next || layer.scaled)) {
      if (layer.scaled && (!layer.boundary_inf.defined() ||
                           layer.boundary_inf.device() != h.device())) {
        layer.boundary_inf = at::zeros({}, h.options().dtype(at::kBool));
      }
      h = ScaleGradient::apply(h, layer.scale / next,
                               layer.scaled ? c10::IValue(layer.boundary_inf) : c10::IValue());
    }
    ++i;
  }
  return h;
}

void LayerwiseGradientScaler::unscale() {
  TORCH_CHECK(!unscaled_, kWho,
              ": unscale() was already called since the last step(); gradients would be divided "
              "twice");
  for (Layer& layer : layers_) {
    bool inf = false;
    if (layer.boundary_inf.defined()) {
      inf = layer.boundary_inf.item<bool>();
      layer.boundary_inf.zero_();
    }
    for (const at::Tensor& p : layer.module->parameters()) {
      if (inf) break;
      const at::Tensor& g = p.grad();
      if (g.defined() && !at::isfinite(g).all().item<bool>()) inf = true;
    }
    layer.found_inf = inf;
    if (inf || layer.scale == 1.0) continue;
    const double inverse = 1.0 / layer.scale;
    for (const at::Tensor& p : layer.module->parameters()) {
      at::Tensor g = p.grad();
      if (!g.defined()) continue;
      if ((g.scalar_type() == at::kFloat && InFloatRange(inverse)) ||
          g.scalar_type() == at::kDouble) {
        g.mul_(inverse);
      } else {
        g.copy_(Multiply(g, inverse));
      }
    }
  }
  unscaled_ = true;
}

bool LayerwiseGradientScaler::step(torch::optim::Optimizer& optimizer) {
  bool has_grads = false;
  for (const at::Tensor& p : model_->parameters()) has_grads = has_grads || p.grad().defined();
  TORCH_CHECK(has_grads, kWho,
              ": step(): no parameter of the model has a gradient (was backward run?)");
  if (!unscaled_) unscale();
  const bool skip = found_inf();
  if (!skip) optimizer.step();
  for (Layer& layer : layers_) {
    if (!layer.scaled) continue;
    if (layer.found_inf) {
      layer.scale *= options_.backoff_factor();
      layer.growth_tracker = 0;
    } else if (++layer.growth_tracker >= options_.growth_interval()) {
      layer.scale *= options_.growth_factor();
      layer.growth_tracker = 0;
    }
    layer.scale = std::max(options_.min_scale(), std::min(layer.scale, options_.max_scale()));
  }
  unscaled_ = false;
  return !skip;
}

std::vector<LayerScaleInfo> LayerwiseGradientScaler::layer_info() const {
  std::vector<LayerScaleInfo> out;
  for (const Layer& l : layers_) {
    out.push_back(LayerScaleInfo{l.name, l.scaled, l.scale, l.growth_tracker, l.found_inf});
  }
  return out;
}

std::map<std::string, double> LayerwiseGradientScaler::layer_scales() const {
  std::map<std::string, double> out;
  for (const Layer& l : layers_) out[l.name] = l.scale;
  return out;
}

bool LayerwiseGradientScaler::found_inf() const {
  for (const Layer& l : layers_) {
    if (l.found_inf) return true;
  }
  return false;
}

LayerwiseGradientScalerState LayerwiseGradientScaler::state_dict() const {
  LayerwiseGradientScalerState s;
  for (const Layer& l : layers_) {
    if (l.scaled) s.layers[l.name] = {l.scale, l.growth_tracker};
  }
  return s;
}

void LayerwiseGradientScaler::load_state_dict(const LayerwiseGradientScalerState& state) {
  size_t listed = 0;
  for (const Layer& l : layers_) {
    if (!l.scaled) continue;
    ++listed;
    auto it = state.layers.find(l.name);
    TORCH_CHECK(it != state.layers.end(), kWho, ": load_state_dict(): the state has no layer '",
                l.name, "'");
    const LayerwiseGradientScalerState::Layer& s = it->second;
    TORCH_CHECK(std::isfinite(s.scale) && s.scale >= options_.min_scale() &&
                    s.scale <= options_.max_scale(),
                kWho, ": load_state_dict(): layer '", l.name, "': scale ", s.scale,
                " outside [min_scale ", options_.min_scale(), ", max_scale ", options_.max_scale(),
                "]");
    TORCH_CHECK(s.growth_tracker >= 0 && s.growth_tracker < options_.growth_interval(), kWho,
                ": load_state_dict(): layer '", l.name, "': growth tracker ", s.growth_tracker,
                " outside [0, growth_interval ", options_.growth_interval(), ")");
  }
  if (state.layers.size() != listed) {
    for (const auto& entry : state.layers) {
      bool known = false;
      for (const Layer& l : layers_) known = known || (l.scaled && l.name == entry.first);
      TORCH_CHECK(known, kWho, ": load_state_dict(): the state's layer '", entry.first,
                  "' is not a listed layer of this scaler");
    }
  }
  for (Layer& l : layers_) {
    if (!l.scaled) continue;
    const LayerwiseGradientScalerState::Layer& s = state.layers.at(l.name);
    l.scale = s.scale;
    l.growth_tracker = s.growth_tracker;
  }
}

void LayerwiseGradientScaler::save(torch::serialize::OutputArchive& archive) const {
  c10::List<std::string> names;
  c10::List<double> scales;
  c10::List<int64_t> trackers;
  for (const auto& [name, layer] : state_dict().layers) {
    names.push_back(name);
    scales.push_back(layer.scale);
    trackers.push_back(layer.growth_tracker);
  }
  archive.write("layerwise_grad_scaler_format", c10::IValue(int64_t{1}));
  archive.write("layer_names", c10::IValue(names));
  archive.write("scales", c10::IValue(scales));
  archive.write("growth_trackers", c10::IValue(trackers));
}

void LayerwiseGradientScaler::load(torch::serialize::InputArchive& archive) {
  auto read = [&](const char* key) {
    c10::IValue v;
    TORCH_CHECK(archive.try_read(key, v), kWho, ": load(): the archive has no '", key,
                "' (not a LayerwiseGradientScaler state)");
    return v;
  };
  read("layerwise_grad_scaler_format");
  std::vector<std::string> names;
  for (const c10::IValue& name : read("layer_names").toListRef()) {
    names.push_back(name.toStringRef());
  }
  const c10::List<double> scales = read("scales").toDoubleList();
  const c10::List<int64_t> trackers = read("growth_trackers").toIntList();
  TORCH_CHECK(names.size() == scales.size() && names.size() == trackers.size(), kWho,
              ": load(): the archive's layer_names, scales and growth_trackers differ in length");
  LayerwiseGradientScalerState s;
  for (size_t i = 0; i < names.size(); ++i) s.layers[names[i]] = {scales[i], trackers[i]};
  load_state_dict(s);
}

}  // namespace fairscale::amp
