// GradScaler against hand-derived values: scaling, unscaling, skipping, backoff and growth, the
// per-optimizer state machine, and state round trips (struct, archive, file).
#include "amp/grad_scaler.h"

#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "testing/c10_error.h"
#include "testing/tmp.h"

namespace fairscale::amp {
namespace {

using ::fairscale::testing::ErrorOf;
using ::fairscale::testing::TmpPath;
using ::testing::HasSubstr;

std::vector<float> Values(const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kFloat).contiguous();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

// w = {1, 2}, loss = sum(w * w): dloss/dw = {2, 4}. SGD with lr 0.5 steps w to {0, 0}.
struct Problem {
  at::Tensor w = at::tensor({1.0f, 2.0f}).set_requires_grad(true);
  torch::optim::SGD opt{std::vector<at::Tensor>{w}, torch::optim::SGDOptions(0.5)};
  at::Tensor Loss() const { return (w * w).sum(); }
  // One iteration's forward + backward through `scaler`.
  void Backward(GradScaler& scaler) {
    opt.zero_grad();
    scaler.scale(Loss()).backward();
  }
};

TEST(GradScalerTest, DefaultsMatchPyTorch) {
  GradScaler scaler;
  EXPECT_TRUE(scaler.is_enabled());
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  EXPECT_EQ(scaler.options().growth_factor(), 2.0);
  EXPECT_EQ(scaler.options().backoff_factor(), 0.5);
  EXPECT_EQ(scaler.options().growth_interval(), 2000);
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

TEST(GradScalerTest, ScaleMultipliesTheLossKeepingItsDtype) {
  GradScaler scaler(GradScalerOptions().init_scale(1024));
  at::Tensor scaled = scaler.scale(at::scalar_tensor(3.0));
  EXPECT_EQ(scaled.dim(), 0);
  EXPECT_EQ(scaled.item<float>(), 3072.0f);
  at::Tensor bf16 = scaler.scale(at::scalar_tensor(3.0, at::kBFloat16));
  EXPECT_EQ(bf16.scalar_type(), at::kBFloat16);
  EXPECT_EQ(bf16.item<float>(), 3072.0f);
  EXPECT_THAT(ErrorOf([&] { scaler.scale(at::tensor(3)); }), HasSubstr("floating-point loss"));
}

TEST(GradScalerTest, UnscaleDividesTheGradientsAndStepUsesThem) {
  GradScaler scaler(GradScalerOptions().init_scale(1024));
  Problem p;
  p.Backward(scaler);
  EXPECT_EQ(Values(p.w.grad()), (std::vector<float>{2048, 4096}));
  scaler.unscale_(p.opt);
  EXPECT_EQ(Values(p.w.grad()), (std::vector<float>{2, 4}));
  EXPECT_TRUE(scaler.step(p.opt));  // does not unscale a second time
  EXPECT_EQ(Values(p.w.grad()), (std::vector<float>{2, 4}));
  EXPECT_EQ(Values(p.w), (std::vector<float>{0, 0}));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 1024.0);
  EXPECT_EQ(scaler.growth_tracker(), 1);
}

TEST(GradScalerTest, StepUnscalesWhenUnscaleWasNotCalled) {
  GradScaler scaler(GradScalerOptions().init_scale(256));
  Problem p;
  p.Backward(scaler);
  EXPECT_TRUE(scaler.step(p.opt));
  EXPECT_EQ(Values(p.w.grad()), (std::vector<float>{2, 4}));
  EXPECT_EQ(Values(p.w), (std::vector<float>{0, 0}));
}

TEST(GradScalerTest, UnscalesBFloat16Gradients) {
  GradScaler scaler(GradScalerOptions().init_scale(8));
  at::Tensor w = at::ones({3}, at::kBFloat16).set_requires_grad(true);
  torch::optim::SGD opt({w}, torch::optim::SGDOptions(0.25));
  scaler.scale((w * w).sum()).backward();  // grad 2 * 8 = 16
  EXPECT_EQ(Values(w.grad()), (std::vector<float>{16, 16, 16}));
  EXPECT_TRUE(scaler.step(opt));
  EXPECT_EQ(Values(w.grad()), (std::vector<float>{2, 2, 2}));
  EXPECT_EQ(Values(w), (std::vector<float>{0.5, 0.5, 0.5}));
}

TEST(GradScalerTest, ATensorListedTwiceIsUnscaledOnce) {
  GradScaler scaler(GradScalerOptions().init_scale(4));
  at::Tensor w = at::tensor({1.0f, 2.0f}).set_requires_grad(true);
  torch::optim::SGD opt({w, w}, torch::optim::SGDOptions(0.0));
  scaler.scale((w * w).sum()).backward();
  scaler.unscale_(opt);
  EXPECT_EQ(Values(w.grad()), (std::vector<float>{2, 4}));
}

class NonFiniteTest : public ::testing::TestWithParam<float> {};

TEST_P(NonFiniteTest, SkipsTheStepAndBacksOff) {
  GradScaler scaler(GradScalerOptions().init_scale(1024).growth_interval(3));
  Problem p;
  p.Backward(scaler);
  ASSERT_TRUE(scaler.step(p.opt));
  scaler.update();  // tracker 1
  p.w.data().copy_(at::tensor({1.0f, 2.0f}));
  p.Backward(scaler);
  p.w.mutable_grad()[1] = GetParam();
  EXPECT_FALSE(scaler.step(p.opt));
  EXPECT_EQ(Values(p.w), (std::vector<float>{1, 2}));  // not stepped
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 512.0);
  EXPECT_EQ(scaler.growth_tracker(), 0);
  // The next clean iteration steps with the backed-off scale.
  p.Backward(scaler);
  EXPECT_EQ(Values(p.w.grad()), (std::vector<float>{1024, 2048}));
  EXPECT_TRUE(scaler.step(p.opt));
  EXPECT_EQ(Values(p.w), (std::vector<float>{0, 0}));
}

INSTANTIATE_TEST_SUITE_P(InfAndNaN, NonFiniteTest,
                         ::testing::Values(std::numeric_limits<float>::infinity(),
                                           -std::numeric_limits<float>::infinity(),
                                           std::numeric_limits<float>::quiet_NaN()));

TEST(GradScalerTest, GrowsAfterGrowthIntervalCleanSteps) {
  GradScaler scaler(GradScalerOptions().init_scale(8).growth_factor(4).growth_interval(3));
  Problem p;
  // Hand-derived: trackers 1, 2, then growth (8 * 4 = 32) with the tracker reset; again.
  const std::vector<double> scales = {8, 8, 32, 32, 32, 128};
  const std::vector<int64_t> trackers = {1, 2, 0, 1, 2, 0};
  for (size_t i = 0; i < scales.size(); ++i) {
    p.Backward(scaler);
    ASSERT_TRUE(scaler.step(p.opt));
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), scales[i]) << "iteration " << i;
    EXPECT_EQ(scaler.growth_tracker(), trackers[i]) << "iteration " << i;
  }
}

TEST(GradScalerTest, AGrowthThatOverflowsIsDropped) {
  const double top = std::ldexp(1.0, 127);  // 2^128 is not a finite float
  GradScaler scaler(GradScalerOptions().init_scale(top).growth_interval(1));
  Problem p;
  p.w.data().fill_(0);  // zero gradients: finite whatever the scale
  p.Backward(scaler);
  ASSERT_TRUE(scaler.step(p.opt));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), top);
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

TEST(GradScalerTest, UpdateWithNewScale) {
  GradScaler scaler(GradScalerOptions().init_scale(1024));
  Problem p;
  p.Backward(scaler);
  scaler.step(p.opt);
  scaler.update(3.0);
  EXPECT_EQ(scaler.get_scale(), 3.0);
  EXPECT_EQ(scaler.growth_tracker(), 0);
  for (double bad : {0.0, -1.0, std::numeric_limits<double>::infinity(),
                     std::numeric_limits<double>::quiet_NaN()}) {
    EXPECT_THAT(ErrorOf([&] { scaler.update(bad); }), HasSubstr("positive finite")) << bad;
  }
  // new_scale needs no step in the iteration.
  scaler.update(5.0);
  EXPECT_EQ(scaler.get_scale(), 5.0);
}

TEST(GradScalerTest, StateMachineMisuseRaises) {
  {
    GradScaler scaler;
    Problem p;
    EXPECT_THAT(ErrorOf([&] { scaler.unscale_(p.opt); }), HasSubstr("before scale()"));
    EXPECT_THAT(ErrorOf([&] { scaler.step(p.opt); }), HasSubstr("before scale()"));
    EXPECT_THAT(ErrorOf([&] { scaler.update(); }), HasSubstr("before scale()"));
  }
  {
    GradScaler scaler;
    Problem p;
    p.Backward(scaler);
    scaler.unscale_(p.opt);
    EXPECT_THAT(ErrorOf([&] { scaler.unscale_(p.opt); }),
                HasSubstr("unscale_() has already been called on this optimizer"));
    ASSERT_TRUE(scaler.step(p.opt));
    EXPECT_THAT(ErrorOf([&] { scaler.unscale_(p.opt); }),
                HasSubstr("unscale_() is being called after step()"));
    EXPECT_THAT(ErrorOf([&] { scaler.step(p.opt); }),
                HasSubstr("step() has already been called"));
    scaler.update();
    // A new iteration starts READY.
    p.Backward(scaler);
    EXPECT_TRUE(scaler.step(p.opt));
    scaler.update();
  }
  {
    GradScaler scaler;
    Problem p;
    scaler.scale(p.Loss());  // no backward: no gradients
    EXPECT_THAT(ErrorOf([&] { scaler.step(p.opt); }),
                HasSubstr("none of the optimizer's parameters has a gradient"));
    EXPECT_THAT(ErrorOf([&] { scaler.update(); }), HasSubstr("no inf checks were recorded"));
  }
  {
    GradScaler scaler;
    Problem p;
    p.Backward(scaler);
    EXPECT_THAT(ErrorOf([&] { scaler.update(); }), HasSubstr("no inf checks were recorded"));
  }
}

TEST(GradScalerTest, EachOptimizerDecidesAloneAndUpdateCombines) {
  GradScaler scaler(GradScalerOptions().init_scale(64));
  Problem a;
  Problem b;
  a.opt.zero_grad();
  b.opt.zero_grad();
  scaler.scale(a.Loss() + b.Loss()).backward();
  b.w.mutable_grad()[0] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(scaler.step(a.opt));
  EXPECT_FALSE(scaler.step(b.opt));
  EXPECT_EQ(Values(a.w), (std::vector<float>{0, 0}));
  EXPECT_EQ(Values(b.w), (std::vector<float>{1, 2}));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 32.0);
}

TEST(GradScalerTest, DisabledIsTransparent) {
  GradScaler scaler(GradScalerOptions().enabled(false));
  Problem p;
  p.opt.zero_grad();
  at::Tensor loss = p.Loss();
  at::Tensor scaled = scaler.scale(loss);
  EXPECT_TRUE(scaled.is_same(loss));
  scaled.backward();
  scaler.unscale_(p.opt);
  EXPECT_EQ(Values(p.w.grad()), (std::vector<float>{2, 4}));
  EXPECT_TRUE(scaler.step(p.opt));
  EXPECT_EQ(Values(p.w), (std::vector<float>{0, 0}));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_FALSE(scaler.state_dict().enabled);

  GradScaler enabled;
  EXPECT_THAT(ErrorOf([&] { enabled.load_state_dict(scaler.state_dict()); }),
              HasSubstr("saved from a disabled GradScaler"));
  scaler.load_state_dict(enabled.state_dict());  // no-op on a disabled scaler
  EXPECT_EQ(scaler.get_scale(), 1.0);
}

TEST(GradScalerTest, RejectsBadOptions) {
  EXPECT_THAT(ErrorOf([] { GradScaler s(GradScalerOptions().growth_factor(1.0)); }),
              HasSubstr("growth_factor"));
  EXPECT_THAT(ErrorOf([] { GradScaler s(GradScalerOptions().backoff_factor(1.0)); }),
              HasSubstr("backoff_factor"));
  EXPECT_THAT(ErrorOf([] { GradScaler s(GradScalerOptions().backoff_factor(0.0)); }),
              HasSubstr("backoff_factor"));
  EXPECT_THAT(ErrorOf([] { GradScaler s(GradScalerOptions().growth_interval(0)); }),
              HasSubstr("growth_interval"));
  EXPECT_THAT(ErrorOf([] { GradScaler s(GradScalerOptions().init_scale(-2)); }),
              HasSubstr("init_scale"));
  GradScaler s;
  EXPECT_THAT(ErrorOf([&] { s.set_growth_factor(0.5); }), HasSubstr("growth_factor"));
  s.set_growth_interval(7);
  EXPECT_EQ(s.state_dict().growth_interval, 7);
}

// Runs `iterations` clean iterations (each from w = {1, 2}).
void Train(GradScaler& scaler, Problem& p, int iterations) {
  for (int i = 0; i < iterations; ++i) {
    p.w.data().copy_(at::tensor({1.0f, 2.0f}));
    p.Backward(scaler);
    scaler.step(p.opt);
    scaler.update();
  }
}

void ExpectSameState(const GradScalerState& a, const GradScalerState& b) {
  EXPECT_EQ(a.enabled, b.enabled);
  EXPECT_EQ(a.scale, b.scale);
  EXPECT_EQ(a.growth_factor, b.growth_factor);
  EXPECT_EQ(a.backoff_factor, b.backoff_factor);
  EXPECT_EQ(a.growth_interval, b.growth_interval);
  EXPECT_EQ(a.growth_tracker, b.growth_tracker);
}

TEST(GradScalerTest, StateDictRoundTripContinuesIdentically) {
  const auto options = GradScalerOptions().init_scale(16).growth_factor(3).growth_interval(4);
  GradScaler original(options);
  Problem p;
  Train(original, p, 6);  // grew once (16 * 3 = 48), tracker 2
  const GradScalerState saved = original.state_dict();
  EXPECT_EQ(saved.scale, 48.0);
  EXPECT_EQ(saved.growth_tracker, 2);

  GradScaler restored;  // defaults, overwritten by the state
  restored.load_state_dict(saved);
  ExpectSameState(restored.state_dict(), saved);
  Problem q;
  Train(original, p, 3);
  Train(restored, q, 3);
  ExpectSameState(restored.state_dict(), original.state_dict());
  EXPECT_EQ(original.get_scale(), 144.0);

  GradScalerState bad = saved;
  bad.growth_tracker = 4;
  EXPECT_THAT(ErrorOf([&] { restored.load_state_dict(bad); }), HasSubstr("growth tracker"));
}

TEST(GradScalerTest, FileRoundTrip) {
  GradScaler original(GradScalerOptions().init_scale(16).growth_interval(4).backoff_factor(0.25));
  Problem p;
  Train(original, p, 5);
  const std::string path = TmpPath("scaler.pt");
  save_grad_scaler(original, path);
  EXPECT_EQ(std::fopen((path + ".tmp").c_str(), "r"), nullptr);  // renamed away

  GradScaler restored;
  load_grad_scaler(restored, path);
  ExpectSameState(restored.state_dict(), original.state_dict());
  Problem q;
  Train(original, p, 2);
  Train(restored, q, 2);
  ExpectSameState(restored.state_dict(), original.state_dict());

  EXPECT_THAT(ErrorOf([&] { load_grad_scaler(restored, TmpPath("missing.pt")); }),
              HasSubstr("missing.pt"));
  // An archive that holds something else.
  torch::serialize::OutputArchive other;
  other.write("weights", at::zeros({2}));
  other.save_to(TmpPath("other.pt"));
  const std::string error = ErrorOf([&] { load_grad_scaler(restored, TmpPath("other.pt")); });
  EXPECT_THAT(error, HasSubstr("other.pt"));
  EXPECT_THAT(error, HasSubstr("not a GradScaler state"));
}

TEST(GradScalerTest, ArchiveNestsInsideAnotherArchive) {
  GradScaler original(GradScalerOptions().init_scale(4));
  Problem p;
  Train(original, p, 1);
  torch::serialize::OutputArchive outer;
  torch::serialize::OutputArchive inner;
  original.save(inner);
  outer.write("scaler", inner);
  outer.write("weights", at::full({2}, 7.0));
  const std::string path = TmpPath("outer.pt");
  outer.save_to(path);

  torch::serialize::InputArchive in;
  in.load_from(path);
  torch::serialize::InputArchive scaler_archive;
  in.read("scaler", scaler_archive);
  GradScaler restored;
  restored.load(scaler_archive);
  ExpectSameState(restored.state_dict(), original.state_dict());
}

}  // namespace
}  // namespace fairscale::amp
