// OffloadModel against the same Sequential trained in memory with torch::optim::Adam: parameters
// within 1e-6 over 10 steps for 1, 2 and 3 (odd) slices, 1 and 3 micro-batches, with and without
// activation checkpointing; gradients of the input; gradient accumulation; bad options.
#include "offload/offload_model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdlib>
#include <sstream>
#include <string>
#include <tuple>

#include "testing/c10_error.h"
#include "testing/tmp.h"

namespace fairscale::offload {
namespace {

using ::fairscale::testing::TmpPath;

// 7 modules, so 2 and 3 slices cut unevenly.
torch::nn::Sequential MakeModel() {
  torch::manual_seed(7);
  return torch::nn::Sequential(torch::nn::Linear(6, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 16), torch::nn::ReLU(),
                               torch::nn::Linear(16, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 4));
}

at::Tensor Input(int step) {
  torch::manual_seed(1000 + step);
  return torch::randn({6, 6});
}
at::Tensor Target(int step) {
  torch::manual_seed(2000 + step);
  return torch::randn({6, 4});
}

double MaxDiff(OffloadModel& model, torch::nn::Sequential& ref) {
  auto snap = model->parameters_snapshot();
  auto want = ref->named_parameters();
  EXPECT_EQ(snap.size(), want.size());
  double d = 0;
  for (size_t i = 0; i < snap.size(); ++i) {
    EXPECT_EQ(snap[i].first, want[i].key());
    d = std::max(d, (snap[i].second - want[i].value().detach()).abs().max().item<double>());
  }
  return d;
}

class OffloadModelTest
    : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, bool>> {};

TEST_P(OffloadModelTest, TrainsLikeTheInMemoryModel) {
  const auto [slices, microbatches, ckpt] = GetParam();
  torch::nn::Sequential ref = MakeModel();
  torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(0.01));
  OffloadModel model(MakeModel(),
                     OffloadModelOptions(TmpPath("m"))
                         .num_slices(slices)
                         .num_microbatches(microbatches)
                         .checkpoint_activation(ckpt)
                         .chunk_bytes(256),
                     torch::optim::AdamOptions(0.01));
  ASSERT_EQ(model->num_slices(), slices);
  EXPECT_EQ(MaxDiff(model, ref), 0);
  for (int step = 0; step < 10; ++step) {
    ref_opt.zero_grad();
    at::Tensor x = Input(step);
    torch::nn::functional::mse_loss(ref->forward(x), Target(step)).backward();
    ref_opt.step();

    model->zero_grad();
    at::Tensor loss = torch::nn::functional::mse_loss(model(x), Target(step));
    loss.backward();
    model->step();
    ASSERT_LE(MaxDiff(model, ref), 1e-6) << "step " << step;
  }
  // Outside forward/backward/step only the last slice used stays resident.
  int64_t empty = 0;
  for (const auto& p : model->parameters()) empty += p.numel() == 0;
  if (slices > 1) {
    EXPECT_GT(empty, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(All, OffloadModelTest,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Values(1, 3),
                                            ::testing::Bool()));

TEST(OffloadModelOtherTest, InputGradientsAndAccumulationMatch) {
  for (bool ckpt : {false, true}) {
    torch::nn::Sequential ref = MakeModel();
    torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(0.01));
    OffloadModel model(MakeModel(),
                       OffloadModelOptions(TmpPath("acc"))
                           .balance({1, 4, 2})
                           .num_microbatches(2)
                           .checkpoint_activation(ckpt),
                       torch::optim::AdamOptions(0.01));
    for (int step = 0; step < 4; ++step) {
      ref_opt.zero_grad();
      model->zero_grad();
      for (int k = 0; k < 2; ++k) {  // two backward passes accumulate before the step
        at::Tensor x1 = Input(10 * step + k).requires_grad_(true);
        at::Tensor x2 = x1.detach().clone().requires_grad_(true);
        torch::nn::functional::mse_loss(ref->forward(x1), Target(step)).backward();
        torch::nn::functional::mse_loss(model(x2), Target(step)).backward();
        ASSERT_TRUE(x2.grad().defined());
        EXPECT_LE((x1.grad() - x2.grad()).abs().max().item<double>(), 1e-6);
      }
      ref_opt.step();
      model->step();
      ASSERT_LE(MaxDiff(model, ref), 1e-6) << "step " << step << " ckpt " << ckpt;
    }
  }
}

TEST(OffloadModelOtherTest, DropoutMatchesWithAndWithoutCheckpointing) {
  auto make = [] {
    torch::manual_seed(11);
    return torch::nn::Sequential(torch::nn::Linear(6, 16), torch::nn::Dropout(0.3),
                                 torch::nn::Linear(16, 16), torch::nn::Dropout(0.3),
                                 torch::nn::Linear(16, 4));
  };
  for (bool ckpt : {false, true}) {
    torch::nn::Sequential ref = make();
    torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(0.01));
    OffloadModel model(
        make(), OffloadModelOptions(TmpPath("drop")).num_slices(3).checkpoint_activation(ckpt),
        torch::optim::AdamOptions(0.01));
    for (int step = 0; step < 4; ++step) {
      const at::Tensor x = Input(step), y = Target(step);
      torch::manual_seed(500 + step);  // the same dropout masks in both forwards
      ref_opt.zero_grad();
      torch::nn::functional::mse_loss(ref->forward(x), y).backward();
      ref_opt.step();
      torch::manual_seed(500 + step);
      model->zero_grad();
      torch::nn::functional::mse_loss(model(x), y).backward();
      model->step();
      ASSERT_LE(MaxDiff(model, ref), 1e-6) << "step " << step << " ckpt " << ckpt;
    }
  }
}

TEST(OffloadModelOtherTest, InferenceRunsSliceBySlice) {
  torch::nn::Sequential ref = MakeModel();
  OffloadModel model(MakeModel(), OffloadModelOptions(TmpPath("inf")).num_slices(3));
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(model(Input(0)).equal(ref->forward(Input(0))));
}

TEST(OffloadModelOtherTest, ArchiveIsTheSequentials) {
  OffloadModel model(MakeModel(), OffloadModelOptions(TmpPath("arch")).num_slices(3));
  for (int step = 0; step < 2; ++step) {
    model->zero_grad();
    torch::nn::functional::mse_loss(model(Input(step)), Target(step)).backward();
    model->step();
  }
  // OffloadModel -> plain Sequential.
  std::stringstream buf;
  {
    torch::serialize::OutputArchive out;
    model->save(out);
    out.save_to(buf);
  }
  torch::manual_seed(99);
  torch::nn::Sequential plain(torch::nn::Linear(6, 16), torch::nn::Tanh(),
                              torch::nn::Linear(16, 16), torch::nn::ReLU(),
                              torch::nn::Linear(16, 16), torch::nn::Tanh(),
                              torch::nn::Linear(16, 4));
  {
    torch::serialize::InputArchive in;
    in.load_from(buf);
    plain->load(in);
  }
  EXPECT_EQ(MaxDiff(model, plain), 0);
  // Plain Sequential (changed) -> OffloadModel, which then trains from there.
  {
    torch::NoGradGuard no_grad;
    for (auto& p : plain->parameters()) p.mul_(0.5);
  }
  std::stringstream buf2;
  {
    torch::serialize::OutputArchive out;
    plain->save(out);
    out.save_to(buf2);
  }
  {
    torch::serialize::InputArchive in;
    in.load_from(buf2);
    model->load(in);
  }
  EXPECT_EQ(MaxDiff(model, plain), 0);
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(model(Input(5)).equal(plain->forward(Input(5))));
}

TEST(OffloadModelOtherTest, BadOptions) {
  EXPECT_THROW(OffloadModel(MakeModel(), OffloadModelOptions(TmpPath("b1")).balance({1, 2})),
               c10::Error);
  EXPECT_THROW(OffloadModel(MakeModel(), OffloadModelOptions(TmpPath("b2")).num_slices(8)),
               c10::Error);
  EXPECT_THROW(OffloadModel(MakeModel(), OffloadModelOptions("")), c10::Error);
  torch::nn::Linear shared(4, 4);
  EXPECT_THROW(OffloadModel(torch::nn::Sequential(shared, shared),
                            OffloadModelOptions(TmpPath("b3")).num_slices(2)),
               c10::Error);
  // Two models on one file.
  OffloadModel first(MakeModel(), OffloadModelOptions(TmpPath("b4")));
  EXPECT_THAT(fairscale::testing::ErrorOf([&] {
                OffloadModel second(MakeModel(), OffloadModelOptions(TmpPath("b4")));
              }),
              ::testing::HasSubstr("in use"));
}

}  // namespace
}  // namespace fairscale::offload
