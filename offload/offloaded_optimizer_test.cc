// OffloadedAdam against torch::optim::Adam / AdamW in memory: bit-identical parameters over 10
// steps, for odd sizes and chunks that cut parameters, two groups with different learning rates
// changed mid-run, bf16 parameters with f32 masters, and checkpoints both ways.
#include "offload/offloaded_optimizer.h"

#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "testing/tmp.h"

namespace fairscale::offload {
namespace {

using ::fairscale::testing::TmpPath;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// Sizes 0, 1, odd, 2-D, and large enough to span many 16-element chunks.
std::vector<at::Tensor> MakeParams(c10::ScalarType dtype = c10::kFloat) {
  torch::manual_seed(1);
  std::vector<std::vector<int64_t>> shapes = {{0}, {1}, {7}, {3, 5}, {1000}, {16}, {17}};
  std::vector<at::Tensor> out;
  for (const auto& s : shapes) out.push_back(torch::randn(s).to(dtype).requires_grad_(true));
  return out;
}

std::vector<at::Tensor> Clone(const std::vector<at::Tensor>& ps, c10::ScalarType dtype) {
  std::vector<at::Tensor> out;
  for (const auto& p : ps) out.push_back(p.detach().to(dtype).clone().requires_grad_(true));
  return out;
}

// Deterministic gradients of step `step`, in the parameters' dtype; parameter 2 has none on
// odd steps (its step count must lag).
void SetGrads(std::vector<at::Tensor>& ps, int step, c10::ScalarType dtype) {
  torch::manual_seed(100 + step);
  for (size_t i = 0; i < ps.size(); ++i) {
    at::Tensor g = torch::randn(ps[i].sizes()).to(dtype);
    if (i == 2 && step % 2 == 1) g = at::Tensor();
    ps[i].mutable_grad() = g.defined() ? g.to(ps[i].scalar_type()) : g;
  }
}

std::vector<torch::optim::OptimizerParamGroup> Groups(const std::vector<at::Tensor>& ps,
                                                      bool adamw) {
  std::vector<at::Tensor> a(ps.begin(), ps.begin() + 4), b(ps.begin() + 4, ps.end());
  std::vector<torch::optim::OptimizerParamGroup> g;
  if (adamw) {
    g.emplace_back(a, std::make_unique<torch::optim::AdamWOptions>(
                          torch::optim::AdamWOptions(0.01).weight_decay(0.1)));
    g.emplace_back(b, std::make_unique<torch::optim::AdamWOptions>(
                          torch::optim::AdamWOptions(0.003).betas({0.8, 0.99})));
  } else {
    g.emplace_back(a, std::make_unique<torch::optim::AdamOptions>(
                          torch::optim::AdamOptions(0.01).weight_decay(0.1)));
    g.emplace_back(b, std::make_unique<torch::optim::AdamOptions>(
                          torch::optim::AdamOptions(0.003).betas({0.8, 0.99}).eps(1e-6)));
  }
  return g;
}

void SetLr(torch::optim::Optimizer& opt, size_t group, double lr, bool adamw) {
  if (adamw) {
    static_cast<torch::optim::AdamWOptions&>(opt.param_groups()[group].options()).lr(lr);
  } else {
    static_cast<torch::optim::AdamOptions&>(opt.param_groups()[group].options()).lr(lr);
  }
}

double MaxDiff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].numel() == 0) continue;
    d = std::max(d, (a[i].detach().to(at::kFloat) - b[i].detach().to(at::kFloat))
                        .abs()
                        .max()
                        .item<double>());
  }
  return d;
}

std::unique_ptr<torch::optim::Optimizer> Reference(const std::vector<at::Tensor>& ps, bool adamw) {
  if (adamw) return std::make_unique<torch::optim::AdamW>(Groups(ps, true));
  return std::make_unique<torch::optim::Adam>(Groups(ps, false));
}

std::unique_ptr<OffloadedAdam> Offloaded(const std::vector<at::Tensor>& ps, bool adamw,
                                         OffloadOptions o) {
  if (adamw) {
    return std::make_unique<OffloadedAdam>(Groups(ps, true), torch::optim::AdamWOptions(), o);
  }
  return std::make_unique<OffloadedAdam>(Groups(ps, false), torch::optim::AdamOptions(), o);
}

struct Case {
  bool adamw;
  bool prefetch;
};

class MatchesTorchTest : public ::testing::TestWithParam<Case> {};

TEST_P(MatchesTorchTest, TenStepsEqualInMemoryOptimizer) {
  const Case c = GetParam();
  std::vector<at::Tensor> ref = MakeParams(), off = Clone(ref, c10::kFloat);
  auto ref_opt = Reference(ref, c.adamw);
  auto off_opt =
      Offloaded(off, c.adamw,
                OffloadOptions(TmpPath(c.adamw ? "w" : "a")).chunk_bytes(64).prefetch(c.prefetch));
  for (int step = 0; step < 10; ++step) {
    if (step == 5) {  // an LR scheduler changes the group lr between steps
      SetLr(*ref_opt, 1, 0.02, c.adamw);
      SetLr(*off_opt, 1, 0.02, c.adamw);
    }
    SetGrads(ref, step, c10::kFloat);
    SetGrads(off, step, c10::kFloat);
    ref_opt->step();
    off_opt->step();
    ASSERT_EQ(MaxDiff(ref, off), 0) << "step " << step;
  }
  EXPECT_EQ(off_opt->step_count(2), 5);
  EXPECT_EQ(off_opt->step_count(4), 10);
}

INSTANTIATE_TEST_SUITE_P(All, MatchesTorchTest,
                         ::testing::Values(Case{false, true}, Case{true, true},
                                           Case{false, false}, Case{true, false}));

TEST(OffloadedAdamTest, Bf16ParamsWithF32MasterMatchF32Reference) {
  for (bool adamw : {false, true}) {
    std::vector<at::Tensor> off = MakeParams(c10::kBFloat16);
    std::vector<at::Tensor> ref = Clone(off, c10::kFloat);  // the f32 master reference
    auto ref_opt = Reference(ref, adamw);
    auto off_opt =
        Offloaded(off, adamw, OffloadOptions(TmpPath(adamw ? "bf16w" : "bf16")).chunk_bytes(40));
    for (int step = 0; step < 10; ++step) {
      SetGrads(off, step, c10::kBFloat16);  // bf16 gradients ...
      SetGrads(ref, step, c10::kBFloat16);  // ... and the same values in f32
      ref_opt->step();
      off_opt->step();
      for (size_t i = 0; i < off.size(); ++i) {
        ASSERT_TRUE(off[i].equal(ref[i].detach().to(c10::kBFloat16))) << "param " << i;
      }
    }
  }
}

TEST(OffloadedAdamTest, SaveLoadRoundTripContinuesIdentically) {
  std::vector<at::Tensor> ref = MakeParams(c10::kBFloat16), a = Clone(ref, c10::kBFloat16);
  auto ref_opt = Offloaded(ref, false, OffloadOptions(TmpPath("rt_ref")).chunk_bytes(64));
  auto a_opt = Offloaded(a, false, OffloadOptions(TmpPath("rt_a")).chunk_bytes(64));
  for (int step = 0; step < 5; ++step) {
    SetGrads(ref, step, c10::kBFloat16);
    SetGrads(a, step, c10::kBFloat16);
    ref_opt->step();
    a_opt->step();
  }
  SetLr(*a_opt, 0, 0.05, false);
  SetLr(*ref_opt, 0, 0.05, false);
  const std::string ckpt = TmpPath("rt_ckpt.fso");
  a_opt->save(ckpt);
  // A new optimizer (new parameters with the saved values, default lr) resumes from the file.
  // ... with another chunk size than the file's.
  std::vector<at::Tensor> b = Clone(a, c10::kBFloat16);
  auto b_opt = Offloaded(b, false, OffloadOptions(TmpPath("rt_b")).chunk_bytes(36));
  b_opt->load(ckpt);
  EXPECT_EQ(static_cast<torch::optim::AdamOptions&>(b_opt->param_groups()[0].options()).lr(),
            0.05);
  EXPECT_EQ(b_opt->step_count(4), 5);
  for (int step = 5; step < 10; ++step) {
    SetGrads(ref, step, c10::kBFloat16);
    SetGrads(b, step, c10::kBFloat16);
    ref_opt->step();
    b_opt->step();
    ASSERT_EQ(MaxDiff(ref, b), 0) << "step " << step;
  }
}

TEST(OffloadedAdamTest, LoadRejectsBadFiles) {
  std::vector<at::Tensor> a = MakeParams();
  auto a_opt = Offloaded(a, false, OffloadOptions(TmpPath("bad_a")).chunk_bytes(64));
  const std::string ckpt = TmpPath("bad_ckpt.fso");
  a_opt->save(ckpt);
  // Another layout (one parameter fewer): INVALID_ARGUMENT naming the file and tensor.
  std::vector<at::Tensor> fewer(a.begin(), a.end() - 1);
  OffloadedAdam f_opt({torch::optim::OptimizerParamGroup(Clone(fewer, c10::kFloat))},
                      torch::optim::AdamOptions(),
                      OffloadOptions(TmpPath("bad_f")).chunk_bytes(64));
  EXPECT_THAT([&] { f_opt.load(ckpt); },
              ThrowsMessage<c10::Error>(
                  AllOf(HasSubstr("OffloadedAdam::load: INVALID_ARGUMENT"), HasSubstr(ckpt))));
  // Truncated: DATA_LOSS.
  ASSERT_EQ(::truncate(ckpt.c_str(), 5000), 0);
  EXPECT_THAT([&] { a_opt->load(ckpt); },
              ThrowsMessage<c10::Error>(AllOf(HasSubstr("OffloadedAdam::load: DATA_LOSS"),
                                              HasSubstr(ckpt), HasSubstr("truncated"))));
  EXPECT_THAT([&] { a_opt->load(TmpPath("missing.fso")); },
              ThrowsMessage<c10::Error>(HasSubstr("OffloadedAdam::load: NOT_FOUND")));
}

TEST(OffloadedAdamTest, ArchiveLayoutIsTorchAdams) {
  for (bool adamw : {false, true}) {
    std::vector<at::Tensor> off = MakeParams(), ref = Clone(off, c10::kFloat);
    auto off_opt = Offloaded(off, adamw, OffloadOptions(TmpPath("arch")).chunk_bytes(64));
    for (int step = 0; step < 3; ++step) {
      SetGrads(off, step, c10::kFloat);
      off_opt->step();
    }
    // offloaded -> torch: torch's optimizer loads our archive and continues identically.
    std::stringstream buf;
    {
      torch::serialize::OutputArchive out;
      off_opt->save(out);
      out.save_to(buf);
    }
    for (size_t i = 0; i < ref.size(); ++i) {
      ref[i].detach().copy_(off[i].detach());
    }
    auto ref_opt = Reference(ref, adamw);
    {
      torch::serialize::InputArchive in;
      in.load_from(buf);
      ref_opt->load(in);
    }
    for (int step = 3; step < 6; ++step) {
      SetGrads(off, step, c10::kFloat);
      SetGrads(ref, step, c10::kFloat);
      off_opt->step();
      ref_opt->step();
      ASSERT_EQ(MaxDiff(ref, off), 0) << "step " << step;
    }
    // torch -> offloaded.
    std::stringstream buf2;
    {
      torch::serialize::OutputArchive out;
      ref_opt->save(out);
      out.save_to(buf2);
    }
    std::vector<at::Tensor> off2 = Clone(ref, c10::kFloat);
    auto off2_opt = Offloaded(off2, adamw, OffloadOptions(TmpPath("arch2")).chunk_bytes(64));
    {
      torch::serialize::InputArchive in;
      in.load_from(buf2);
      off2_opt->load(in);
    }
    EXPECT_EQ(off2_opt->step_count(2), 3);  // parameter 2 had no gradient at steps 3 and 5
    for (int step = 6; step < 9; ++step) {
      SetGrads(off2, step, c10::kFloat);
      SetGrads(ref, step, c10::kFloat);
      off2_opt->step();
      ref_opt->step();
      ASSERT_EQ(MaxDiff(ref, off2), 0) << "step " << step;
    }
  }
}

TEST(OffloadedAdamTest, Errors) {
  std::vector<at::Tensor> ps = MakeParams();
  auto create = [](std::vector<at::Tensor> params, torch::optim::AdamOptions adam,
                   OffloadOptions options) {
    OffloadedAdam({torch::optim::OptimizerParamGroup(std::move(params))}, adam, options);
  };
  EXPECT_THAT([&] { create(ps, torch::optim::AdamOptions().amsgrad(true), TmpPath("e1")); },
              ThrowsMessage<c10::Error>(
                  AllOf(HasSubstr("OffloadedAdam: INVALID_ARGUMENT"), HasSubstr("amsgrad"))));
  EXPECT_THAT([&] { create(ps, torch::optim::AdamOptions(), OffloadOptions("")); },
              ThrowsMessage<c10::Error>(
                  AllOf(HasSubstr("OffloadedAdam: INVALID_ARGUMENT"), HasSubstr("dir"))));
  std::vector<at::Tensor> dbl = {torch::zeros({3}, at::kDouble).requires_grad_(true)};
  EXPECT_THAT([&] { create(dbl, torch::optim::AdamOptions(), TmpPath("e2")); },
              ThrowsMessage<c10::Error>(
                  AllOf(HasSubstr("OffloadedAdam: INVALID_ARGUMENT"), HasSubstr("Double"))));
  auto first = Offloaded(ps, false, OffloadOptions(TmpPath("e3")));
  // The same file twice: the second is refused while the first holds it.
  EXPECT_THAT([&] { create(Clone(ps, c10::kFloat), torch::optim::AdamOptions(), TmpPath("e3")); },
              ThrowsMessage<c10::Error>(
                  AllOf(HasSubstr("OffloadedAdam: FAILED_PRECONDITION"), HasSubstr("in use"))));
  // A parameter whose shape changed since the optimizer was created.
  SetGrads(ps, 0, c10::kFloat);
  ps[3].set_data(torch::zeros({5, 3}));
  ps[3].mutable_grad() = torch::zeros({5, 3});
  EXPECT_THAT([&] { first->step(); },
              ThrowsMessage<c10::Error>(AllOf(HasSubstr("OffloadedAdam::step: INVALID_ARGUMENT"),
                                              HasSubstr("parameter 3"), HasSubstr("Float[5, 3]"))));
  EXPECT_THAT([&] { first->step_group(2); },
              ThrowsMessage<c10::Error>(
                  HasSubstr("OffloadedAdam::step_group: INVALID_ARGUMENT: no param group 2")));
}

TEST(OffloadedAdamTest, CorruptStateFileFailsTheStep) {
  std::vector<at::Tensor> ps = MakeParams();
  auto opt = Offloaded(ps, false, OffloadOptions(TmpPath("corrupt")).chunk_bytes(64));
  SetGrads(ps, 0, c10::kFloat);
  opt->step();
  // Overwrite the tail of the data region (the last tensors' chunks) behind the optimizer's back.
  {
    FILE* f = std::fopen(opt->path().c_str(), "r+b");
    ASSERT_NE(f, nullptr);
    std::fseek(f, 8192, SEEK_SET);
    const char junk[64] = {1, 2, 3};
    std::fwrite(junk, 1, sizeof(junk), f);
    std::fclose(f);
  }
  SetGrads(ps, 1, c10::kFloat);
  EXPECT_THAT([&] { opt->step(); }, ThrowsMessage<c10::Error>(AllOf(
                                        HasSubstr("OffloadedAdam::step: DATA_LOSS"),
                                        HasSubstr(opt->path()), HasSubstr("checksum mismatch"))));
}

TEST(OffloadedAdamTest, ReplacedStateFileFailsTheStep) {
  std::vector<at::Tensor> ps = MakeParams();
  auto opt = Offloaded(ps, false, OffloadOptions(TmpPath("replaced")));
  const std::string other = TmpPath("replaced_other.fso");
  opt->save(other);
  ASSERT_EQ(std::rename(other.c_str(), opt->path().c_str()), 0);
  SetGrads(ps, 0, c10::kFloat);
  EXPECT_THAT([&] { opt->step(); },
              ThrowsMessage<c10::Error>(AllOf(HasSubstr("OffloadedAdam::step: FAILED_PRECONDITION"),
                                              HasSubstr(opt->path()), HasSubstr("replaced"))));
}

}  // namespace
}  // namespace fairscale::offload
