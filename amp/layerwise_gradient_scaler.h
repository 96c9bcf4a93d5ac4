// LayerwiseGradientScaler: one gradient scale factor per layer for mixed-precision backward
// (//amp), the LibTorch counterpart of FairScale's fairscale.optim.LayerwiseGradientScaler. A
// single loss scale (GradScaler) must suit every layer at once; when the gradients of one layer
// are tiny (they flush to zero in f16) and another's are large (a scale big enough for the first
// overflows the second), a factor per layer keeps both in range.
//
//   torch::nn::Sequential model({{"fc1", torch::nn::Linear(2, 10)}, {"relu1", torch::nn::ReLU()},
//                                {"fc2", torch::nn::Linear(10, 1)}});
//   amp::LayerwiseGradientScaler scaler(model, {{"fc1", 1024}, {"fc2", 512}});
//   for (...) {
//     opt.zero_grad();
//     at::Tensor loss = loss_fn(scaler.forward(x), y);  // the layers, with scaling boundaries
//     loss.backward();                   // the loss itself is NOT scaled
//     scaler.unscale();                  // optional: each finite layer's gradients / its scale
//     bool stepped = scaler.step(opt);   // unscale() if not done; steps unless some layer saw
//   }                                    // inf/NaN; then updates every listed layer's scale
//
// The model is a torch::nn::Sequential: its children, in order, are the layers; their names are
// the child names. LibTorch has no module backward hooks (FairScale registers a full backward
// hook per module), so forward(x) runs the layers itself and puts a differentiable identity at
// the boundary after each layer i. In backward that identity multiplies the gradient flowing
// into layer i's output by s_i / s_{i+1}, with s_n = 1 standing for the loss; one more identity on
// the model input multiplies the gradient leaving layer 0 by 1 / s_0.
//
// Why that is the right factor: let g_i be the true gradient of the loss with respect to layer
// i's output. The loss gradient enters at scale 1 (= s_n), so the gradient reaching layer n-1's
// output is g_{n-1} * s_{n-1}. Backward through layer i is linear in its output gradient, so if
// layer i receives g_i * s_i, its parameter gradients are (true gradients) * s_i and its input
// gradient is g_{i-1} * s_i; the boundary after layer i-1 multiplies that by s_{i-1} / s_i, so
// layer i-1 receives g_{i-1} * s_{i-1}. By induction every layer's parameter gradients come out
// multiplied by exactly its own scale, which unscale() divides out; the gradient with respect to
// the model input comes out unscaled (factor 1 / s_0 on s_0). This is FairScale's net effect
// (its hook on layer i multiplies layer i's input gradient by s_{i-1} / s_i) in the case its
// tests use, a last module with scale 1; see amp/README.md for the case where they differ.
//
// Inf/NaN: unscale() marks a layer found_inf when one of its parameter gradients is not finite,
// or (for listed layers) when the scaled gradient entering its output was not finite, which
// catches an overflow in a layer without parameters. step() skips the optimizer if any layer was
// marked, then updates each listed layer as FairScale does: found_inf -> scale * backoff_factor,
// tracker 0; else tracker + 1, and at growth_interval scale * growth_factor, tracker 0; the scale
// clamped to [min_scale, max_scale]. Unlisted layers keep scale 1 and are never updated.
//
// Contract: one scaler per model; the optimizer's parameters are the model's (other parameters
// of the optimizer are neither checked nor unscaled). A parameter shared by two layers is refused
// (its gradient would mix two scales). Every forward() of an iteration (gradient accumulation)
// uses the same scales; they change only in step(). The boundary inf flags accumulate over
// every backward since the last unscale(). The scales are doubles on the host (as
// FairScale's Python floats); the gradient multiplications run in float for f32/f16/bf16
// gradients (f16/bf16 are converted to f32, multiplied and rounded back once) and in double for
// f64 or when the factor is outside float's range. Not thread-safe.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fairscale::amp {

struct LayerwiseGradientScalerOptions {
  // Multiplies a layer's scale after `growth_interval` consecutive finite steps; > 1.
  TORCH_ARG(double, growth_factor) = 2.0;
  // Multiplies a layer's scale after a step where its gradients held inf/NaN; in (0, 1).
  TORCH_ARG(double, backoff_factor) = 0.5;
  // Finite steps between two growths of a layer's scale; > 0.
  TORCH_ARG(int64_t, growth_interval) = 10000;
  // Every scale stays in [min_scale, max_scale] (FairScale's defaults: float's smallest normal
  // and largest finite value); 0 < min_scale <= max_scale, both finite.
  TORCH_ARG(double, min_scale) = static_cast<double>(std::numeric_limits<float>::min());
  TORCH_ARG(double, max_scale) = static_cast<double>(std::numeric_limits<float>::max());
};

// One layer, as layer_info() reports it.
struct LayerScaleInfo {
  std::string name;
  // Listed in the constructor's scales (only those are grown and backed off).
  bool scaled = false;
  double scale = 1.0;
  // Finite steps since the last growth or backoff (0 for unlisted layers).
  int64_t growth_tracker = 0;
  // Set by the last unscale() (explicit or inside step()).
  bool found_inf = false;
};

// What state_dict() returns: per listed layer, its scale and growth tracker.
struct LayerwiseGradientScalerState {
  struct Layer {
    double scale = 1.0;
    int64_t growth_tracker = 0;
  };
  std::map<std::string, Layer> layers;
};

class LayerwiseGradientScaler {
 public:
  // `scales`: initial scale of each listed layer, by child name of `model`. Raises c10::Error
  // for a null or empty Sequential, a name that is not a child of `model` (the message lists the
  // children), a scale that is not finite or outside [min_scale, max_scale], a parameter shared
  // by two layers, or bad options (growth_factor <= 1, backoff_factor outside (0, 1),
  // growth_interval <= 0, bad min/max).
  LayerwiseGradientScaler(torch::nn::Sequential model, const std::map<std::string, double>& scales,
                          LayerwiseGradientScalerOptions options = {});
  LayerwiseGradientScaler(const LayerwiseGradientScaler&) = delete;
  LayerwiseGradientScaler& operator=(const LayerwiseGradientScaler&) = delete;

  // model's layers in order on `x`, with the scaling boundaries described above. The result
  // equals model->forward(x); only the gradients differ. Backward of the result must run
  // while this scaler is alive.
  at::Tensor forward(const at::Tensor& x);

  // For each layer: records whether any of its parameter gradients (or, for a listed layer, the
  // scaled gradient entering its output since the last unscale) held inf/NaN, and divides the
  // gradients of each finite layer by its scale, in place. At most once between two step()s.
  void unscale();

  // unscale() unless already done since the last step; optimizer.step() unless some layer was
  // found_inf; then updates the listed layers' scales. Returns whether the optimizer stepped.
  // Raises c10::Error if no parameter of the model has a gradient (backward was not run).
  bool step(torch::optim::Optimizer& optimizer);

  // Layers in model order.
  std::vector<LayerScaleInfo> layer_info() const;
  // name -> current scale, every layer (1 for unlisted ones).
  std::map<std::string, double> layer_scales() const;
  // Whether the last unscale() found inf/NaN in some layer.
  bool found_inf() const;
  const LayerwiseGradientScalerOptions& options() const { return options_; }

  LayerwiseGradientScalerState state_dict() const;
  // The state must name exactly the listed layers, with scales in [min_scale, max_scale] and
  // trackers in [0, growth_interval); c10::Error otherwise, leaving the scaler unchanged.
  void load_state_dict(const LayerwiseGradientScalerState& state);
  // Into / from a torch::serialize archive: "layerwise_grad_scaler_format" and the parallel
  // lists "layer_names", "scales", "growth_trackers" (listed layers, by name).
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

 private:
  struct Layer {
    std::string name;
    std::shared_ptr<torch::nn::Module> module;
    bool scaled = false;
    double scale = 1.0;
    int64_t growth_tracker = 0;
    bool found_inf = false;
    // Scalar bool: the scaled gradient entering this (listed) layer's output was not finite.
    // Shared with the autograd nodes of forward(), which OR into it during backward.
    at::Tensor boundary_inf;
  };

  torch::nn::Sequential model_;
  LayerwiseGradientScalerOptions options_;
  std::vector<Layer> layers_;
  bool unscaled_ = false;
};

}  // namespace fairscale::amp
