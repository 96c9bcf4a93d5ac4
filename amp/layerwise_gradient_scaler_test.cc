// LayerwiseGradientScaler: gradients after scale -> backward -> unscale equal plain backward
// (FairScale's test_linear_model, plus non-power-of-two scales, unlisted layers and a listed last
// layer); f16 underflow prevented per layer; inf/NaN skipping, backoff, growth and clamping;
// option errors; state round trips.
#include "amp/layerwise_gradient_scaler.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/full.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/functional.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/loss.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/utils.h>

#include <cmath>
#include <functional>
#include <iostream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "testing/c10_error.h"

namespace fairscale::amp {
namespace {

using ::fairscale::testing::ErrorOf;
using ::testing::HasSubstr;
namespace nn = torch::nn;

// FairScale's FeedForward(2, 10): fc1 relu1 fc2 relu2 fc3 sigmoid identity.
nn::Sequential FeedForward(uint64_t seed) {
  torch::manual_seed(seed);
  return nn::Sequential({{"fc1", nn::Linear(2, 10)},
                         {"relu1", nn::ReLU()},
                         {"fc2", nn::Linear(10, 10)},
                         {"relu2", nn::ReLU()},
                         {"fc3", nn::Linear(10, 1)},
                         {"sigmoid", nn::Sigmoid()},
                         {"identity", nn::Identity()}});
}

// Four Gaussian blobs in 2-D, 40 points; label 0 for blob 0, 1 for the others (FairScale's
// make_blobs data, drawn here with LibTorch's generator).
std::pair<at::Tensor, at::Tensor> Blobs() {
  torch::manual_seed(11);
  const at::Tensor centers = at::randn({4, 2}) * 5;
  const at::Tensor blob = at::arange(40) % 4;
  const at::Tensor x = centers.index_select(0, blob) + at::randn({40, 2}) * 1.5;
  return {x, (blob != 0).to(at::kFloat)};
}

// max |a - b| / max(max |b|, tiny), over all parameters' gradients (or values).
double MaxRelativeDiff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double err = 0, mag = 0;
  EXPECT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    err = std::max(err, (a[i] - b[i]).abs().max().item<double>());
    mag = std::max(mag, b[i].abs().max().item<double>());
  }
  return err / std::max(mag, 1e-30);
}

std::vector<at::Tensor> Grads(const nn::Sequential& m) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : m->parameters()) out.push_back(p.grad().clone());
  return out;
}
std::vector<at::Tensor> Params(const nn::Sequential& m) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : m->parameters()) out.push_back(p.detach().clone());
  return out;
}

LayerScaleInfo Info(const LayerwiseGradientScaler& s, const std::string& name) {
  for (const LayerScaleInfo& i : s.layer_info()) {
    if (i.name == name) return i;
  }
  ADD_FAILURE() << "no layer " << name;
  return {};
}

// FairScale's test_linear_model: two epochs of SGD on the blobs, per-layer scaling
// {fc1: 1024, fc2: 512, fc3: 1024} against none; gradients and parameters equal.
TEST(LayerwiseGradientScalerTest, FairScaleLinearModel) {
  auto [x, y] = Blobs();
  auto train = [&, x = x, y = y](bool per_layer) {
    nn::Sequential model = FeedForward(7);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.001));
    std::map<std::string, double> scales;
    if (per_layer) scales = {{"fc1", 1024}, {"fc2", 512}, {"fc3", 1024}};
    LayerwiseGradientScaler scaler(model, scales);
    nn::BCEWithLogitsLoss loss_fn;
    for (int epoch = 0; epoch < 2; ++epoch) {
      opt.zero_grad();
      loss_fn(scaler.forward(x).squeeze(), y).backward();
      scaler.unscale();
      EXPECT_TRUE(scaler.step(opt));
    }
    return model;
  };
  nn::Sequential plain = train(false);
  nn::Sequential scaled = train(true);
  // Power-of-two scales: the multiplications are exact.
  EXPECT_EQ(MaxRelativeDiff(Grads(scaled), Grads(plain)), 0.0);
  EXPECT_EQ(MaxRelativeDiff(Params(scaled), Params(plain)), 0.0);
}

// Non-power-of-two scales, unlisted layers between listed ones, a listed LAST layer (where
// FairScale's hooks would leave every gradient divided by its scale) and an input that requires
// grad (its gradient comes back unscaled).
TEST(LayerwiseGradientScalerTest, GradientsEqualPlainBackward) {
  auto make = [] {
    torch::manual_seed(3);
    return nn::Sequential({{"fc1", nn::Linear(5, 16)},
                           {"tanh", nn::Tanh()},
                           {"fc2", nn::Linear(16, 16)},
                           {"relu", nn::ReLU()},
                           {"fc3", nn::Linear(16, 8)},
                           {"fc4", nn::Linear(8, 3)}});
  };
  torch::manual_seed(5);
  const at::Tensor x = at::randn({32, 5});
  const at::Tensor target = at::randn({32, 3});

  nn::Sequential plain = make();
  const at::Tensor x_plain = x.clone().requires_grad_(true);
  torch::nn::functional::mse_loss(plain->forward(x_plain), target).backward();

  nn::Sequential model = make();
  LayerwiseGradientScaler scaler(model, {{"fc1", 1000.0}, {"fc3", 3.0}, {"fc4", 65536.0}});
  const at::Tensor x_scaled = x.clone().requires_grad_(true);
  torch::nn::functional::mse_loss(scaler.forward(x_scaled), target).backward();

  // Before unscale: each listed layer's gradients are the plain ones times its scale.
  const std::vector<at::Tensor> before = Grads(model);
  const std::vector<at::Tensor> reference = Grads(plain);
  const std::vector<double> factor = {1000, 1000, 1, 1, 3, 3, 65536, 65536};  // weight, bias
  ASSERT_EQ(before.size(), factor.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_LE(MaxRelativeDiff({before[i] / factor[i]}, {reference[i]}), 1e-6) << i;
  }
  scaler.unscale();
  EXPECT_FALSE(scaler.found_inf());
  const double err = MaxRelativeDiff(Grads(model), reference);
  const double input_err = MaxRelativeDiff({x_scaled.grad()}, {x_plain.grad()});
  std::cout << "max relative gradient error: parameters " << err << ", input " << input_err
            << "\n";
  EXPECT_LE(err, 1e-6);
  EXPECT_LE(input_err, 1e-6);
}

// forward() returns model->forward(x); two forward/backward passes before a step (gradient
// accumulation) unscale to the plain accumulated gradients.
TEST(LayerwiseGradientScalerTest, ForwardValuesAndGradientAccumulation) {
  auto make = [] {
    torch::manual_seed(9);
    return nn::Sequential(
        {{"fc1", nn::Linear(3, 6)}, {"relu", nn::ReLU()}, {"fc2", nn::Linear(6, 2)}});
  };
  torch::manual_seed(10);
  const at::Tensor x1 = at::randn({8, 3});
  const at::Tensor x2 = at::randn({8, 3});
  nn::Sequential plain = make();
  nn::Sequential model = make();
  LayerwiseGradientScaler scaler(model, {{"fc1", 256}, {"fc2", 16}});
  EXPECT_TRUE(at::equal(scaler.forward(x1), plain->forward(x1)));
  for (const at::Tensor& x : {x1, x2}) {
    plain->forward(x).pow(2).mean().backward();
    scaler.forward(x).pow(2).mean().backward();
  }
  scaler.unscale();
  EXPECT_EQ(MaxRelativeDiff(Grads(model), Grads(plain)), 0.0);  // powers of two: exact
}

// A layer computing x * w in f16 with an f32 parameter w (what autocast does: f32 master weights,
// f16 arithmetic), so w's gradient is computed in f16 and converted to f32.
struct HalfMulImpl : nn::Module {
  explicit HalfMulImpl(at::Tensor init) { w = register_parameter("w", init); }
  at::Tensor forward(const at::Tensor& x) { return x.to(at::kHalf) * w.to(at::kHalf); }
  at::Tensor w;
};
TORCH_MODULE(HalfMul);

// FairScale's point: "tiny" sits below a layer "damp" that multiplies by 2^-26, so its f16
// gradient (2^-26 * x) is below f16's smallest subnormal (2^-24) and flushes to zero unscaled.
// Scaling "tiny" by 2^15 and "damp" by 2^10 keeps every f16 gradient in range; a single scale of
// 2^16 for the whole model (GradScaler's way) overflows the f16 gradient at the top (65536 >
// 65504) and the layer that saw it is backed off.
TEST(LayerwiseGradientScalerTest, F16UnderflowPreventedPerLayer) {
  const at::Tensor x = at::tensor({1.0f, 2.0f, 3.0f, 0.5f});
  auto make = [] {
    return nn::Sequential(
        {{"tiny", HalfMul(at::ones({4}))},
         // Two factors 2^-13: a scalar multiplying an f16 tensor is rounded to f16 first, and
         // 2^-26 itself would round to 0.
         {"damp", nn::Functional([](const at::Tensor& h) {
            return h * std::ldexp(1.0, -13) * std::ldexp(1.0, -13);
          })}});
  };
  auto loss = [](const at::Tensor& out) { return out.to(at::kFloat).sum(); };
  const std::vector<float> truth = {std::ldexp(1.0f, -26), std::ldexp(2.0f, -26),
                                    std::ldexp(3.0f, -26), std::ldexp(0.5f, -26)};

  nn::Sequential plain = make();
  loss(plain->forward(x)).backward();
  EXPECT_EQ(plain->parameters()[0].grad().abs().max().item<float>(), 0.0f) << "underflow expected";

  nn::Sequential model = make();
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(1.0));
  LayerwiseGradientScaler scaler(model, {{"tiny", std::ldexp(1.0, 15)}, {"damp", 1024.0}});
  loss(scaler.forward(x)).backward();
  scaler.unscale();
  const at::Tensor g = model->parameters()[0].grad();
  for (int i = 0; i < 4; ++i) EXPECT_EQ(g[i].item<float>(), truth[i]) << i;  // exact: powers of 2
  EXPECT_TRUE(scaler.step(opt));

  // One scale of 2^16 everywhere: the gradient entering "damp" overflows f16.
  nn::Sequential global = make();
  torch::optim::SGD opt2(global->parameters(), torch::optim::SGDOptions(1.0));
  LayerwiseGradientScaler single(global, {{"tiny", 65536.0}, {"damp", 65536.0}});
  const std::vector<at::Tensor> before = Params(global);
  loss(single.forward(x)).backward();
  EXPECT_FALSE(single.step(opt2));
  EXPECT_TRUE(Info(single, "damp").found_inf);  // no parameters: caught at its output
  EXPECT_TRUE(Info(single, "tiny").found_inf);  // the inf propagated into its gradient
  EXPECT_EQ(MaxRelativeDiff(Params(global), before), 0.0);
  EXPECT_EQ(Info(single, "damp").scale, 32768.0);
}

// f32 model; fc0's scale 2^120 overflows its gradients on the first iteration only (the loss is
// multiplied by 1e6 there): the step is skipped (parameters unchanged), fc0 backs off, the others
// count a finite step; the next iteration steps and grows the layers whose tracker reached 2.
TEST(LayerwiseGradientScalerTest, OverflowSkipsTheStepAndBacksOffThatLayer) {
  torch::manual_seed(1);
  nn::Sequential model({{"fc0", nn::Linear(4, 8)},
                        {"relu", nn::ReLU()},
                        {"fc1", nn::Linear(8, 8)},
                        {"fc2", nn::Linear(8, 2)}});
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  LayerwiseGradientScaler scaler(model, {{"fc0", std::ldexp(1.0, 120)}, {"fc1", 4}, {"fc2", 2}},
                                 LayerwiseGradientScalerOptions().growth_interval(2));
  const at::Tensor x = at::randn({16, 4});

  const std::vector<at::Tensor> before = Params(model);
  opt.zero_grad();
  (scaler.forward(x).pow(2).sum() * 1e6).backward();
  EXPECT_FALSE(scaler.step(opt));
  EXPECT_EQ(MaxRelativeDiff(Params(model), before), 0.0) << "the step must be skipped";
  EXPECT_TRUE(Info(scaler, "fc0").found_inf);
  EXPECT_FALSE(Info(scaler, "fc1").found_inf);
  EXPECT_FALSE(Info(scaler, "relu").found_inf);
  EXPECT_EQ(Info(scaler, "fc0").scale, std::ldexp(1.0, 119));
  EXPECT_EQ(Info(scaler, "fc0").growth_tracker, 0);
  EXPECT_EQ(Info(scaler, "fc1").scale, 4.0);
  EXPECT_EQ(Info(scaler, "fc1").growth_tracker, 1);
  EXPECT_EQ(Info(scaler, "relu").scale, 1.0);
  EXPECT_FALSE(Info(scaler, "relu").scaled);

  opt.zero_grad();
  (scaler.forward(x).pow(2).sum() * 0.01).backward();
  EXPECT_TRUE(scaler.step(opt));
  EXPECT_FALSE(scaler.found_inf());
  EXPECT_GT(MaxRelativeDiff(Params(model), before), 0.0);
  EXPECT_EQ(scaler.layer_scales(),
            (std::map<std::string, double>{
                {"fc0", std::ldexp(1.0, 119)}, {"fc1", 8}, {"fc2", 4}, {"relu", 1}}));
  EXPECT_EQ(Info(scaler, "fc0").growth_tracker, 1);
  EXPECT_EQ(Info(scaler, "fc1").growth_tracker, 0);
}

// A tiny model whose gradients the test sets by hand (FairScale's update rule in isolation).
struct Manual {
  nn::Sequential model;
  torch::optim::SGD opt;
  Manual()
      : model({{"a", nn::Linear(2, 2)}, {"b", nn::Linear(2, 2)}}),
        opt(model->parameters(), torch::optim::SGDOptions(0.1)) {}
  void SetGrads(float a_value) {
    for (const auto& child : model->named_children()) {
      for (at::Tensor p : child.value()->parameters()) {
        p.mutable_grad() = at::full_like(p, child.key() == "a" ? a_value : 1.0f);
      }
    }
  }
};

TEST(LayerwiseGradientScalerTest, GrowthAfterGrowthIntervalFiniteSteps) {
  Manual m;
  LayerwiseGradientScaler scaler(
      m.model, {{"a", 8.0}}, LayerwiseGradientScalerOptions().growth_interval(3).growth_factor(4));
  std::vector<double> scales;
  for (int i = 0; i < 7; ++i) {
    m.SetGrads(8.0f);
    EXPECT_TRUE(scaler.step(m.opt));
    scales.push_back(Info(scaler, "a").scale);
  }
  EXPECT_EQ(scales, (std::vector<double>{8, 8, 32, 32, 32, 128, 128}));
  EXPECT_EQ(Info(scaler, "a").growth_tracker, 1);
  EXPECT_EQ(Info(scaler, "b").scale, 1.0);  // unlisted: never grown
  EXPECT_EQ(Info(scaler, "b").growth_tracker, 0);
  // A NaN resets the tracker and backs off; the unlisted layer stays at 1 even when it is the one
  // with the NaN.
  m.SetGrads(std::nanf(""));
  EXPECT_FALSE(scaler.step(m.opt));
  EXPECT_EQ(Info(scaler, "a").scale, 64.0);
  EXPECT_EQ(Info(scaler, "a").growth_tracker, 0);
  m.SetGrads(1.0f);
  m.model[1]->parameters()[0].mutable_grad()[0][0] = -std::numeric_limits<float>::infinity();
  EXPECT_FALSE(scaler.step(m.opt));
  EXPECT_TRUE(Info(scaler, "b").found_inf);
  EXPECT_FALSE(Info(scaler, "a").found_inf);
  EXPECT_EQ(Info(scaler, "b").scale, 1.0);
  EXPECT_EQ(Info(scaler, "a").scale, 64.0);
  EXPECT_EQ(Info(scaler, "a").growth_tracker, 1);
}

TEST(LayerwiseGradientScalerTest, ScalesAreClampedToMinAndMax) {
  Manual m;
  LayerwiseGradientScaler scaler(
      m.model, {{"a", 6.0}, {"b", 1.5}},
      LayerwiseGradientScalerOptions().growth_interval(1).min_scale(1).max_scale(8));
  m.SetGrads(1.0f);
  scaler.step(m.opt);
  EXPECT_EQ(scaler.layer_scales(), (std::map<std::string, double>{{"a", 8}, {"b", 3}}));
  m.SetGrads(std::numeric_limits<float>::infinity());
  m.model[1]->parameters()[0].mutable_grad()[0][0] = std::nanf("");
  scaler.step(m.opt);  // both back off: a 8 -> 4, b 3 -> 1.5
  scaler.step(m.opt);  // the same gradients (not unscaled: still non-finite): a -> 2, b -> 1
  scaler.step(m.opt);
  EXPECT_EQ(scaler.layer_scales(), (std::map<std::string, double>{{"a", 1}, {"b", 1}}));
}

TEST(LayerwiseGradientScalerTest, UnscaleSkipsNonFiniteLayersAndRunsOncePerStep) {
  Manual m;
  LayerwiseGradientScaler scaler(m.model, {{"a", 4.0}, {"b", 2.0}});
  m.SetGrads(std::numeric_limits<float>::infinity());
  scaler.unscale();
  EXPECT_TRUE(Info(scaler, "a").found_inf);
  EXPECT_FALSE(Info(scaler, "b").found_inf);
  EXPECT_EQ(m.model[1]->parameters()[0].grad()[0][0].item<float>(), 0.5f);  // 1 / 2
  EXPECT_THAT(ErrorOf([&] { scaler.unscale(); }), HasSubstr("already called"));
  EXPECT_FALSE(scaler.step(m.opt));  // does not unscale a second time
  EXPECT_EQ(m.model[1]->parameters()[0].grad()[0][0].item<float>(), 0.5f);
}

TEST(LayerwiseGradientScalerTest, StepWithoutGradientsIsAnError) {
  Manual m;
  LayerwiseGradientScaler scaler(m.model, {{"a", 4.0}});
  EXPECT_THAT(ErrorOf([&] { scaler.step(m.opt); }), HasSubstr("no parameter of the model has a"));
}

TEST(LayerwiseGradientScalerTest, BadOptionsAndLayersAreClearErrors) {
  auto model = [] { return nn::Sequential({{"fc", nn::Linear(2, 2)}, {"act", nn::ReLU()}}); };
  using Options = LayerwiseGradientScalerOptions;
  auto error = [&](std::map<std::string, double> scales, Options o) {
    return ErrorOf([&] { LayerwiseGradientScaler s(model(), scales, o); });
  };
  EXPECT_THAT(error({}, Options().growth_factor(1.0)), HasSubstr("growth_factor must be > 1"));
  EXPECT_THAT(error({}, Options().growth_factor(0.5)), HasSubstr("growth_factor must be > 1"));
  EXPECT_THAT(error({}, Options().backoff_factor(1.0)), HasSubstr("backoff_factor must be in"));
  EXPECT_THAT(error({}, Options().backoff_factor(0)), HasSubstr("backoff_factor must be in"));
  EXPECT_THAT(error({}, Options().growth_interval(0)), HasSubstr("growth_interval must be > 0"));
  EXPECT_THAT(error({}, Options().min_scale(4).max_scale(2)), HasSubstr("min_scale <= max_scale"));
  EXPECT_THAT(error({{"fc2", 2.0}}, Options()),
              HasSubstr("unknown layer 'fc2'; the Sequential's layers are: fc, act"));
  EXPECT_THAT(error({{"fc", 0.0}}, Options()), HasSubstr("scale of layer 'fc' must be finite"));
  EXPECT_THAT(error({{"fc", 16.0}}, Options().max_scale(8)), HasSubstr("got 16"));
  EXPECT_THAT(ErrorOf([] { LayerwiseGradientScaler s(nn::Sequential(), {}); }),
              HasSubstr("empty Sequential"));
  EXPECT_THAT(ErrorOf([] { LayerwiseGradientScaler s(nn::Sequential(nullptr), {}); }),
              HasSubstr("null Sequential"));
  nn::Linear shared(2, 2);
  EXPECT_THAT(ErrorOf([&] {
                LayerwiseGradientScaler s(nn::Sequential({{"x", shared}, {"y", shared}}), {});
              }),
              HasSubstr("layers 'x' and 'y' share a parameter"));
}

TEST(LayerwiseGradientScalerTest, StateRoundTrips) {
  Manual m;
  const auto options = LayerwiseGradientScalerOptions().growth_interval(2);
  LayerwiseGradientScaler scaler(m.model, {{"a", 8.0}, {"b", 2.0}}, options);
  m.SetGrads(1.0f);
  scaler.step(m.opt);
  m.SetGrads(1.0f);
  scaler.step(m.opt);
  m.SetGrads(1.0f);
  scaler.step(m.opt);  // a 16 (tracker 1), b 4 (tracker 1)
  const LayerwiseGradientScalerState state = scaler.state_dict();
  ASSERT_EQ(state.layers.size(), 2u);
  EXPECT_EQ(state.layers.at("a").scale, 16.0);
  EXPECT_EQ(state.layers.at("a").growth_tracker, 1);

  Manual m2;
  LayerwiseGradientScaler copy(m2.model, {{"a", 1.0}, {"b", 1.0}}, options);
  copy.load_state_dict(state);
  EXPECT_EQ(copy.layer_scales(), scaler.layer_scales());
  m2.SetGrads(1.0f);
  copy.step(m2.opt);
  EXPECT_EQ(copy.layer_scales(), (std::map<std::string, double>{{"a", 32}, {"b", 8}}));

  torch::serialize::OutputArchive out;
  scaler.save(out);
  std::stringstream buffer;
  out.save_to(buffer);
  torch::serialize::InputArchive in;
  in.load_from(buffer);
  Manual m3;
  LayerwiseGradientScaler loaded(m3.model, {{"a", 1.0}, {"b", 1.0}}, options);
  loaded.load(in);
  EXPECT_EQ(loaded.state_dict().layers.at("b").scale, 4.0);
  EXPECT_EQ(loaded.state_dict().layers.at("b").growth_tracker, 1);

  Manual m4;
  LayerwiseGradientScaler only_a(m4.model, {{"a", 1.0}}, options);
  EXPECT_THAT(ErrorOf([&] { only_a.load_state_dict(state); }),
              HasSubstr("layer 'b' is not a listed layer"));
  LayerwiseGradientScalerState bad = state;
  bad.layers["a"].growth_tracker = 2;
  EXPECT_THAT(ErrorOf([&] { copy.load_state_dict(bad); }), HasSubstr("growth tracker 2"));
  bad = state;
  bad.layers.erase("b");
  EXPECT_THAT(ErrorOf([&] { copy.load_state_dict(bad); }), HasSubstr("has no layer 'b'"));
  EXPECT_EQ(copy.layer_scales(), (std::map<std::string, double>{{"a", 32}, {"b", 8}}));
  torch::serialize::InputArchive empty;
  EXPECT_THAT(ErrorOf([&] { copy.load(empty); }), HasSubstr("not a LayerwiseGradientScaler"));
}

}  // namespace
}  // namespace fairscale::amp
