// The point of //offload: a model whose parameters + gradients + Adam state exceed a memory
// budget trains with the tracked peak of CPU tensor memory (base::TrackingCpuAllocator, exact
// bytes) under the budget, and ends with the same parameters as in-memory training.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "base/tracking_allocator.h"
#include "offload/offload_model.h"
#include "testing/tmp.h"

namespace fairscale::offload {
namespace {

constexpr int64_t kWidth = 256;
constexpr int64_t kLayers = 8;
constexpr int64_t kBudget = 4 << 20;  // bytes

torch::nn::Sequential MakeModel() {
  torch::manual_seed(3);
  torch::nn::Sequential seq;
  for (int64_t i = 0; i < kLayers; ++i) {
    seq->push_back(torch::nn::Linear(kWidth, kWidth));
    seq->push_back(torch::nn::Tanh());
  }
  return seq;
}

at::Tensor Input(int step) {
  torch::manual_seed(100 + step);
  return torch::randn({32, kWidth});
}

TEST(OffloadModelMemoryTest, TrainsUnderABudgetSmallerThanItsState) {
  base::TrackingCpuAllocator* alloc = base::TrackingCpuAllocator::Install();
  const std::string dir = fairscale::testing::TmpPath("budget");
  std::vector<std::pair<std::string, at::Tensor>> offloaded;
  int64_t param_bytes = 0;
  {
    alloc->reset_peak();
    const int64_t live_before = alloc->live_bytes();
    OffloadModel model(MakeModel(),
                       OffloadModelOptions(dir)
                           .num_slices(kLayers)  // one Linear + Tanh per slice
                           .num_microbatches(2)
                           .checkpoint_activation(true)
                           .chunk_bytes(64 << 10),
                       torch::optim::AdamOptions(1e-3));
    // The construction holds the whole model once (it is built in memory, then moved to the
    // tier); training holds a slice or two.
    const int64_t construction_peak = alloc->peak_bytes() - live_before;
    alloc->reset_peak();
    for (int step = 0; step < 3; ++step) {
      model->zero_grad();
      torch::nn::functional::mse_loss(model(Input(step)), Input(50 + step)).backward();
      model->step();
    }
    const int64_t training_peak = alloc->peak_bytes() - live_before;
    const int64_t peak = std::max(construction_peak, training_peak);
    offloaded = model->parameters_snapshot();
    for (const auto& [name, t] : offloaded) param_bytes += t.numel() * 4;
    const int64_t state_bytes = 4 * param_bytes;  // parameters + gradients + exp_avg + exp_avg_sq
    std::printf("parameters %lld B; params+grads+Adam state %lld B; budget %lld B; "
                "tracked peak %lld B (construction %lld B, training %lld B)\n",
                static_cast<long long>(param_bytes), static_cast<long long>(state_bytes),
                static_cast<long long>(kBudget), static_cast<long long>(peak),
                static_cast<long long>(construction_peak), static_cast<long long>(training_peak));
    EXPECT_GT(state_bytes, kBudget);
    EXPECT_LT(peak, kBudget);
  }
  // The same training in memory: its peak is above the budget, its parameters are ours.
  alloc->reset_peak();
  const int64_t live_before = alloc->live_bytes();
  torch::nn::Sequential ref = MakeModel();
  torch::optim::Adam opt(ref->parameters(), torch::optim::AdamOptions(1e-3));
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    torch::nn::functional::mse_loss(ref->forward(Input(step)), Input(50 + step)).backward();
    opt.step();
  }
  const int64_t ref_peak = alloc->peak_bytes() - live_before;
  std::printf("in-memory tracked peak %lld B\n", static_cast<long long>(ref_peak));
  EXPECT_GT(ref_peak, kBudget);
  auto want = ref->named_parameters();
  ASSERT_EQ(offloaded.size(), want.size());
  // Not bitwise: the offloaded model sums each gradient over 2 micro-batches (another f32
  // order), and Adam's normalised first steps turn the rounding of near-zero gradients into
  // updates of up to lr. Measured max 2.1e-6 (2026-12-02, after 1.0e-6 had held: 8 of 16 tensors
  // now between 1.05e-6 and 2.13e-6 on every run); a real divergence is >= lr = 1e-3.
  for (size_t i = 0; i < offloaded.size(); ++i) {
    EXPECT_LE((offloaded[i].second - want[i].value().detach()).abs().max().item<double>(), 5e-6)
        << offloaded[i].first;
  }
}

}  // namespace
}  // namespace fairscale::offload
