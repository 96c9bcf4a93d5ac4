// mevo_cross_entropy against the plain at::linear + cross_entropy computed in the same test:
// loss, grad_input and grad_weight over chunkings that do and do not divide the sizes, ignored
// tokens, both reductions, f32 / f64 / bf16; finite differences in f64; the errors; and the
// memory claim, counted exactly by base::TrackingCpuAllocator.
#include "mevo/mevo.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "base/tracking_allocator.h"
#include "testing/c10_error.h"

namespace fairscale::mevo {
namespace {

using ::fairscale::testing::ErrorOf;
using ::testing::HasSubstr;
namespace F = torch::nn::functional;

base::TrackingCpuAllocator* Allocator() {
  static base::TrackingCpuAllocator* alloc = base::TrackingCpuAllocator::Install();
  return alloc;
}

struct Result {
  at::Tensor loss, grad_input, grad_weight;
};

// One forward + backward of `loss_fn(x, w)` on fresh leaf copies of input and weight.
template <typename LossFn>
Result RunStep(const at::Tensor& input, const at::Tensor& weight, LossFn loss_fn) {
  at::Tensor x = input.detach().clone().requires_grad_(true);
  at::Tensor w = weight.detach().clone().requires_grad_(true);
  Result r;
  r.loss = loss_fn(x, w);
  r.loss.backward();
  r.loss = r.loss.detach();
  r.grad_input = x.grad();
  r.grad_weight = w.grad();
  return r;
}

Result Plain(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& targets,
             const MevoOptions& o) {
  return RunStep(input, weight, [&](const at::Tensor& x, const at::Tensor& w) {
    const at::Tensor logits = at::linear(x, w).reshape({-1, w.size(0)});
    auto ce = F::CrossEntropyFuncOptions().ignore_index(o.ignore_index());
    if (o.reduction() == "sum") ce.reduction(torch::kSum);
    return F::cross_entropy(logits, targets.reshape({-1}), ce);
  });
}

Result Mevo(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& targets,
            const MevoOptions& o) {
  return RunStep(input, weight, [&](const at::Tensor& x, const at::Tensor& w) {
    return mevo_cross_entropy(x, w, targets, o);
  });
}

// max |a - b| / max(1, max |b|): relative to the reference's scale (a sum loss over many tokens
// is large), absolute for small values.
double Err(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor a64 = a.to(at::kDouble), b64 = b.to(at::kDouble);
  if (a64.numel() == 0) return 0;
  const double scale = std::max(1.0, b64.abs().max().item<double>());
  return (a64 - b64).abs().max().item<double>() / scale;
}

struct Case {
  int64_t tokens, dim, vocab, token_chunk, vocab_chunk;
  std::string reduction;
  double ignored;  // fraction of targets set to ignore_index
};

std::string Name(const Case& c) {
  char buf[160];
  std::snprintf(buf, sizeof(buf), "T=%ld D=%ld V=%ld Tc=%ld Vc=%ld %s ignored=%.2f",
                static_cast<long>(c.tokens), static_cast<long>(c.dim), static_cast<long>(c.vocab),
                static_cast<long>(c.token_chunk), static_cast<long>(c.vocab_chunk),
                c.reduction.c_str(), c.ignored);
  return buf;
}

const Case kCases[] = {
    {37, 16, 101, 8, 16, "mean", 0.0},      // neither chunk divides its size
    {37, 16, 101, 8, 16, "sum", 0.0},       //
    {64, 16, 128, 16, 32, "mean", 0.0},     // both divide
    {37, 16, 101, 64, 500, "mean", 0.0},    // chunks larger than T and V: one tile
    {40, 8, 1, 7, 3, "mean", 0.0},          // V = 1: loss 0, gradients 0
    {1, 16, 50, 4, 7, "mean", 0.0},         // one token
    {1, 16, 50, 4, 7, "sum", 0.0},          //
    {50, 12, 77, 9, 10, "mean", 0.3},       // some tokens ignored
    {50, 12, 77, 9, 10, "sum", 0.3},        //
    {50, 12, 77, 9, 10, "sum", 1.0},        // all ignored: sum 0
    {200, 32, 1000, 33, 129, "mean", 0.1},  // larger
};

at::Tensor Targets(int64_t tokens, int64_t vocab, double ignored, int64_t ignore_index) {
  at::Tensor t = at::randint(vocab, {tokens}, at::kLong);
  const at::Tensor drop = at::rand({tokens}) < ignored;
  return at::where(drop, at::full({}, ignore_index, at::kLong), t);
}

void CheckCase(const Case& c, at::ScalarType dtype, double tol) {
  SCOPED_TRACE(Name(c));
  torch::manual_seed(c.tokens * 1000 + c.vocab);
  const at::Tensor input = at::randn({c.tokens, c.dim}, at::kDouble).to(dtype);
  const at::Tensor weight = (at::randn({c.vocab, c.dim}, at::kDouble) * 0.5).to(dtype);
  const MevoOptions o =
      MevoOptions().token_chunk(c.token_chunk).vocab_chunk(c.vocab_chunk).reduction(c.reduction);
  const at::Tensor targets = Targets(c.tokens, c.vocab, c.ignored, o.ignore_index());
  const Result want = Plain(input, weight, targets, o);
  const Result got = Mevo(input, weight, targets, o);
  EXPECT_EQ(got.loss.scalar_type(), dtype);
  EXPECT_EQ(got.grad_input.scalar_type(), dtype);
  EXPECT_EQ(got.grad_weight.scalar_type(), dtype);
  const double e_loss = Err(got.loss, want.loss);
  const double e_gx = Err(got.grad_input, want.grad_input);
  const double e_gw = Err(got.grad_weight, want.grad_weight);
  std::printf("%s %s: loss %.3g grad_input %.3g grad_weight %.3g\n", c10::toString(dtype),
              Name(c).c_str(), e_loss, e_gx, e_gw);
  EXPECT_LE(e_loss, tol);
  EXPECT_LE(e_gx, tol);
  EXPECT_LE(e_gw, tol);
}

TEST(MevoTest, MatchesPlainF32) {
  for (const Case& c : kCases) CheckCase(c, at::kFloat, 1e-5);
}

TEST(MevoTest, MatchesPlainF64) {
  for (const Case& c : kCases) CheckCase(c, at::kDouble, 1e-12);
}

// The bias overload against at::linear(x, w, b) + cross_entropy (a torch::nn::Linear head).
TEST(MevoTest, WithBiasMatchesLinearWithBias) {
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    const double tol = dtype == at::kFloat ? 1e-5 : 1e-12;
    for (const Case& c : {kCases[0], kCases[1], kCases[3], kCases[7], kCases[10]}) {
      SCOPED_TRACE(Name(c));
      torch::manual_seed(c.tokens + c.vocab);
      const at::Tensor input = at::randn({c.tokens, c.dim}, dtype);
      const at::Tensor weight = at::randn({c.vocab, c.dim}, dtype) * 0.5;
      const at::Tensor bias = at::randn({c.vocab}, dtype);
      const MevoOptions o = MevoOptions()
                                .token_chunk(c.token_chunk)
                                .vocab_chunk(c.vocab_chunk)
                                .reduction(c.reduction);
      const at::Tensor targets = Targets(c.tokens, c.vocab, c.ignored, o.ignore_index());
      auto ce = F::CrossEntropyFuncOptions().ignore_index(o.ignore_index());
      if (c.reduction == "sum") ce.reduction(torch::kSum);
      Result got, want;
      at::Tensor gb_got, gb_want;
      for (const bool mevo : {false, true}) {
        at::Tensor b = bias.clone().requires_grad_(true);
        Result r = RunStep(input, weight, [&](const at::Tensor& x, const at::Tensor& w) {
          return mevo ? mevo_cross_entropy(x, w, b, targets, o)
                      : F::cross_entropy(at::linear(x, w, b), targets, ce);
        });
        (mevo ? got : want) = r;
        (mevo ? gb_got : gb_want) = b.grad();
      }
      const double e_loss = Err(got.loss, want.loss), e_gx = Err(got.grad_input, want.grad_input);
      const double e_gw = Err(got.grad_weight, want.grad_weight), e_gb = Err(gb_got, gb_want);
      std::printf("bias %s %s: loss %.3g grad_input %.3g grad_weight %.3g grad_bias %.3g\n",
                  c10::toString(dtype), Name(c).c_str(), e_loss, e_gx, e_gw, e_gb);
      EXPECT_LE(e_loss, tol);
      EXPECT_LE(e_gx, tol);
      EXPECT_LE(e_gw, tol);
      EXPECT_LE(e_gb, tol);
    }
  }
}

TEST(MevoTest, AllIgnoredMeanIsNanWithZeroGradientsLikePyTorch) {
  torch::manual_seed(3);
  const at::Tensor input = at::randn({6, 4}), weight = at::randn({9, 4});
  const at::Tensor targets = at::full({6}, -100, at::kLong);
  const MevoOptions o = MevoOptions().token_chunk(4).vocab_chunk(4);
  const Result want = Plain(input, weight, targets, o);
  const Result got = Mevo(input, weight, targets, o);
  EXPECT_TRUE(std::isnan(want.loss.item<double>()));
  EXPECT_TRUE(std::isnan(got.loss.item<double>()));
  EXPECT_TRUE(got.grad_input.eq(0).all().item<bool>());
  EXPECT_TRUE(got.grad_weight.eq(0).all().item<bool>());
  EXPECT_TRUE(want.grad_input.eq(0).all().item<bool>());
}

TEST(MevoTest, EmptyInputLikePyTorch) {
  const at::Tensor input = at::randn({0, 4}), weight = at::randn({9, 4});
  const at::Tensor targets = at::zeros({0}, at::kLong);
  for (const std::string r : {"mean", "sum"}) {
    SCOPED_TRACE(r);
    const MevoOptions o = MevoOptions().reduction(r);
    const Result want = Plain(input, weight, targets, o);
    const Result got = Mevo(input, weight, targets, o);
    if (r == "mean") {
      EXPECT_TRUE(std::isnan(want.loss.item<double>()));
      EXPECT_TRUE(std::isnan(got.loss.item<double>()));
    } else {
      EXPECT_EQ(want.loss.item<double>(), 0.0);
      EXPECT_EQ(got.loss.item<double>(), 0.0);
    }
    EXPECT_EQ(got.grad_input.sizes(), input.sizes());
    EXPECT_TRUE(got.grad_weight.eq(0).all().item<bool>());
  }
}

TEST(MevoTest, IgnoreIndexInsideTheVocabulary) {
  // ignore_index may be a real class (PyTorch: e.g. the padding token 0).
  torch::manual_seed(4);
  const at::Tensor input = at::randn({30, 8}), weight = at::randn({20, 8});
  const at::Tensor targets = at::randint(3, {30}, at::kLong);  // many zeros
  const MevoOptions o = MevoOptions().token_chunk(7).vocab_chunk(6).ignore_index(0);
  const Result want = Plain(input, weight, targets, o);
  const Result got = Mevo(input, weight, targets, o);
  EXPECT_LE(Err(got.loss, want.loss), 1e-5);
  EXPECT_LE(Err(got.grad_input, want.grad_input), 1e-5);
  EXPECT_LE(Err(got.grad_weight, want.grad_weight), 1e-5);
}

TEST(MevoTest, LeadingShapeAndModule) {
  torch::manual_seed(5);
  const at::Tensor input = at::randn({3, 11, 8}), weight = at::randn({40, 8});
  const at::Tensor targets = at::randint(40, {3, 11}, at::kLong);
  MevoLoss loss_fn(MevoOptions().token_chunk(5).vocab_chunk(16));
  const Result want = Plain(input, weight, targets, loss_fn->options);
  const Result got = RunStep(input, weight, [&](const at::Tensor& x, const at::Tensor& w) {
    return loss_fn(x, w, targets);
  });
  EXPECT_EQ(got.grad_input.sizes(), input.sizes());
  EXPECT_LE(Err(got.loss, want.loss), 1e-5);
  EXPECT_LE(Err(got.grad_input, want.grad_input), 1e-5);
  EXPECT_LE(Err(got.grad_weight, want.grad_weight), 1e-5);
}

TEST(MevoTest, GradientOfOneArgumentOnly) {
  torch::manual_seed(6);
  const at::Tensor input = at::randn({10, 4}), weight = at::randn({12, 4});
  const at::Tensor targets = at::randint(12, {10}, at::kLong);
  const MevoOptions o = MevoOptions().token_chunk(3).vocab_chunk(5);
  const Result want = Plain(input, weight, targets, o);
  {
    at::Tensor w = weight.clone().requires_grad_(true);  // frozen input (e.g. a probe)
    mevo_cross_entropy(input, w, targets, o).backward();
    EXPECT_LE(Err(w.grad(), want.grad_weight), 1e-5);
  }
  {
    at::Tensor x = input.clone().requires_grad_(true);  // frozen weight
    mevo_cross_entropy(x, weight, targets, o).backward();
    EXPECT_LE(Err(x.grad(), want.grad_input), 1e-5);
  }
}

TEST(MevoTest, FiniteDifferencesF64) {
  torch::manual_seed(7);
  const at::Tensor input = at::randn({5, 3}, at::kDouble);
  const at::Tensor weight = at::randn({7, 3}, at::kDouble);
  const at::Tensor targets = torch::tensor({2, -100, 6, 0, 3}, at::kLong);
  for (const std::string r : {"mean", "sum"}) {
    SCOPED_TRACE(r);
    const MevoOptions o = MevoOptions().token_chunk(2).vocab_chunk(3).reduction(r);
    const Result got = Mevo(input, weight, targets, o);
    const double eps = 1e-6;
    double worst = 0;
    for (int which = 0; which < 2; ++which) {
      const at::Tensor& base = which == 0 ? input : weight;
      const at::Tensor& grad = which == 0 ? got.grad_input : got.grad_weight;
      for (int64_t i = 0; i < base.numel(); ++i) {
        at::Tensor plus = base.clone(), minus = base.clone();
        plus.view({-1})[i] += eps;
        minus.view({-1})[i] -= eps;
        auto f = [&](const at::Tensor& b) {
          return (which == 0 ? mevo_cross_entropy(b, weight, targets, o)
                             : mevo_cross_entropy(input, b, targets, o))
              .item<double>();
        };
        const double numeric = (f(plus) - f(minus)) / (2 * eps);
        worst = std::max(worst, std::abs(numeric - grad.view({-1})[i].item<double>()));
      }
    }
    std::printf("finite differences (%s): max |numeric - analytic| %.3g\n", r.c_str(), worst);
    EXPECT_LE(worst, 1e-7);
  }
}

TEST(MevoTest, Bf16AndF16ComputeInF32) {
  for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    torch::manual_seed(8);
    const at::Tensor input = at::randn({45, 16}).to(dtype);
    const at::Tensor weight = (at::randn({90, 16}) * 0.5).to(dtype);
    const at::Tensor targets = Targets(45, 90, 0.2, -100);
    const MevoOptions o = MevoOptions().token_chunk(8).vocab_chunk(13);
    // Reference: the plain loss in f32 on the same (rounded) values.
    const Result want = Plain(input.to(at::kFloat), weight.to(at::kFloat), targets, o);
    const Result got = Mevo(input, weight, targets, o);
    EXPECT_EQ(got.loss.scalar_type(), at::kFloat);
    EXPECT_EQ(got.grad_input.scalar_type(), dtype);
    EXPECT_EQ(got.grad_weight.scalar_type(), dtype);
    const double e_loss = Err(got.loss, want.loss);
    const double e_gx = Err(got.grad_input, want.grad_input);
    const double e_gw = Err(got.grad_weight, want.grad_weight);
    std::printf("%s vs f32 plain: loss %.3g grad_input %.3g grad_weight %.3g\n",
                c10::toString(dtype), e_loss, e_gx, e_gw);
    EXPECT_LE(e_loss, 1e-5);  // the loss is f32 throughout
    EXPECT_LE(e_gx, 8e-3);    // the gradients are rounded once, at the end (bf16: 2^-8)
    EXPECT_LE(e_gw, 8e-3);
  }
}

TEST(MevoTest, Errors) {
  const at::Tensor x = at::randn({4, 3}), w = at::randn({5, 3});
  const at::Tensor t = at::randint(5, {4}, at::kLong);
  EXPECT_THAT(ErrorOf([&] {
                mevo_cross_entropy(x, at::randn({5, 2}), t);
              }),
              HasSubstr("mevo::mevo_cross_entropy: INVALID_ARGUMENT: input [4, 3] must be "
                        "[..., D] with D = weight.size(1) = 2"));
  EXPECT_THAT(ErrorOf([&] { mevo_cross_entropy(x, at::randn({5}), t); }),
              HasSubstr("weight must be [V, D], got [5]"));
  EXPECT_THAT(ErrorOf([&] { mevo_cross_entropy(x, w, at::randint(5, {3}, at::kLong)); }),
              HasSubstr("targets [3] must have input's leading shape (input [4, 3])"));
  EXPECT_THAT(ErrorOf([&] { mevo_cross_entropy(x, w, t.to(at::kInt)); }),
              HasSubstr("targets must be int64, got Int"));
  EXPECT_THAT(ErrorOf([&] { mevo_cross_entropy(x, w.to(at::kDouble), t); }),
              HasSubstr("same floating dtype, got Float and Double"));
  EXPECT_THAT(ErrorOf([&] {
                mevo_cross_entropy(x, w, torch::tensor({0, 5, 1, 2}, at::kLong));
              }),
              HasSubstr("target 5 of token 1 is outside [0, 5) and is not ignore_index -100"));
  EXPECT_THAT(ErrorOf([&] {
                mevo_cross_entropy(x, w, torch::tensor({0, 1, -1, 2}, at::kLong));
              }),
              HasSubstr("target -1 of token 2 is outside [0, 5)"));
  EXPECT_THAT(ErrorOf([&] { mevo_cross_entropy(x, w, at::randn({4}), t); }),
              HasSubstr("bias must be [V] = [5] of weight's dtype, got [4] Float"));
  EXPECT_THAT(ErrorOf([&] { mevo_cross_entropy(x, w, t, MevoOptions().vocab_chunk(0)); }),
              HasSubstr("chunk sizes must be positive: vocab_chunk 0, token_chunk 1024"));
  EXPECT_THAT(ErrorOf([&] { mevo_cross_entropy(x, w, t, MevoOptions().token_chunk(-1)); }),
              HasSubstr("token_chunk -1"));
  EXPECT_THAT(ErrorOf([&] { mevo_cross_entropy(x, w, t, MevoOptions().reduction("none")); }),
              HasSubstr("reduction must be \"mean\" or \"sum\", got \"none\""));
  EXPECT_THAT(ErrorOf([&] { MevoLoss(MevoOptions().vocab_chunk(0)); }),
              HasSubstr("mevo::MevoLoss: INVALID_ARGUMENT: chunk sizes must be positive"));
}

// Peak tensor bytes of one forward + backward above what was live before (the inputs, weight
// and targets are created before; the gradients, which both variants allocate, are counted).
template <typename LossFn>
int64_t PeakBytes(const at::Tensor& input, const at::Tensor& weight, LossFn loss_fn) {
  base::TrackingCpuAllocator* alloc = Allocator();
  at::Tensor x = input.detach().clone().requires_grad_(true);
  at::Tensor w = weight.detach().clone().requires_grad_(true);
  const int64_t before = alloc->live_bytes();
  alloc->reset_peak();
  loss_fn(x, w).backward();
  return alloc->peak_bytes() - before;
}

TEST(MevoTest, PeakMemoryIsPerTileNotPerLogits) {
  Allocator();
  const int64_t T = 512, D = 32, V = 8192, Tc = 64, Vc = 256;
  torch::manual_seed(9);
  const at::Tensor input = at::randn({T, D}), weight = at::randn({V, D}) * 0.1;
  const at::Tensor targets = at::randint(V, {T}, at::kLong);
  const MevoOptions o = MevoOptions().token_chunk(Tc).vocab_chunk(Vc);
  const int64_t plain = PeakBytes(input, weight, [&](const at::Tensor& x, const at::Tensor& w) {
    return F::cross_entropy(at::linear(x, w), targets);
  });
  const int64_t mevo = PeakBytes(input, weight, [&](const at::Tensor& x, const at::Tensor& w) {
    return mevo_cross_entropy(x, w, targets, o);
  });
  const int64_t logits = T * V * 4;           // 16 MiB
  const int64_t grads = (V * D + T * D) * 4;  // grad_weight + grad_input: both have them
  const int64_t tile = Tc * Vc * 4;           // 64 KiB
  const int64_t per_token = T * 8 * 8;        // [T] vectors: lse, masks, coefficients...
  std::printf("peak bytes: plain %ld, mevo %ld (logits %ld, grads %ld, tile %ld)\n",
              static_cast<long>(plain), static_cast<long>(mevo), static_cast<long>(logits),
              static_cast<long>(grads), static_cast<long>(tile));
  EXPECT_GE(plain, grads + 2 * logits);  // logits and log-softmax saved, then their gradient
  EXPECT_LE(mevo, grads + 4 * tile + per_token + 2 * Tc * D * 4);
  EXPECT_LT(mevo - grads, logits / 16);
}

}  // namespace
}  // namespace fairscale::mevo
