// Memory tests with exact byte counts (base::TrackingCpuAllocator): the peak activation memory of
// an 8-block model drops >= 3x with every block checkpointed, the tracer's per-module records,
// and the checkpoint suggestion for a budget.
#include "checkpoint/memory_tracker.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/Generator.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

#include <string>
#include <vector>

#include "base/tracking_allocator.h"
#include "checkpoint/checkpoint.h"

namespace fairscale::checkpoint {
namespace {

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(int64_t dim) {
    fc1 = register_module("fc1", torch::nn::Linear(dim, 4 * dim));
    fc2 = register_module("fc2", torch::nn::Linear(4 * dim, dim));
    drop = register_module("drop", torch::nn::Dropout(0.1));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(drop(torch::gelu(fc1(x)))) + x; }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Block);

constexpr int kBlocks = 8;
constexpr int64_t kDim = 64, kBatch = 256;

struct Measured {
  int64_t peak_activation = 0;  // peak during forward + backward - live before the forward
  std::vector<ModuleMemory> records;
  std::string table;
};

class MemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    alloc_ = base::TrackingCpuAllocator::Install();
    torch::manual_seed(0);
    for (int i = 0; i < kBlocks; ++i) {
      blocks_.push_back(Block(kDim));
      holder_->register_module("block" + std::to_string(i), blocks_.back());
    }
    x_ = torch::randn({kBatch, kDim});
    // A first step allocates the gradients, so the measured steps only add activations.
    Measure({});
  }

  // One forward + backward, block i checkpointed when checkpointed[i].
  Measured Measure(std::vector<bool> checkpointed) {
    checkpointed.resize(kBlocks, false);
    for (auto& p : holder_->parameters()) {
      if (p.grad().defined()) p.grad().zero_();
    }
    MemoryTracker tracker(alloc_);
    torch::Tensor x = x_.clone().requires_grad_();
    const int64_t before = alloc_->live_bytes();
    alloc_->reset_peak();
    torch::Tensor h = x;
    for (int i = 0; i < kBlocks; ++i) {
      Block b = blocks_[i];
      auto plain = [b](const at::Tensor& in) { return b.ptr()->forward(in); };
      h = tracker.forward("block" + std::to_string(i), *b, h,
                          checkpointed[i] ? std::function<at::Tensor(const at::Tensor&)>(
                                                [plain](const at::Tensor& in) {
                                                  return checkpoint(plain, in);
                                                })
                                          : plain);
    }
    h.sum().backward();
    h = torch::Tensor();
    Measured m;
    m.peak_activation = alloc_->peak_bytes() - before;
    m.records = tracker.records();
    m.table = tracker.table();
    return m;
  }

  base::TrackingCpuAllocator* alloc_ = nullptr;
  std::vector<Block> blocks_;
  std::shared_ptr<torch::nn::Module> holder_ = std::make_shared<torch::nn::Module>();
  torch::Tensor x_;
};

TEST_F(MemoryTest, EveryBlockCheckpointedCutsPeakActivationMemoryThreefold) {
  const Measured plain = Measure({});
  const Measured ck = Measure(std::vector<bool>(kBlocks, true));
  std::cout << "plain:\n" << plain.table << "checkpointed:\n" << ck.table;
  std::cout << "peak activation bytes: plain " << plain.peak_activation << ", checkpointed "
            << ck.peak_activation << "\n";
  ASSERT_GT(ck.peak_activation, 0);
  EXPECT_GE(plain.peak_activation, 3 * ck.peak_activation);
}

TEST_F(MemoryTest, RecordsPerModule) {
  std::vector<bool> every_other(kBlocks, false);
  for (int i = 0; i < kBlocks; i += 2) every_other[i] = true;
  const Measured m = Measure(every_other);
  ASSERT_EQ(m.records.size(), static_cast<size_t>(kBlocks));
  const int64_t out_bytes = kBatch * kDim * 4;
  const int64_t rng_state_bytes = at::detail::getDefaultCPUGenerator().get_state().nbytes();
  const int64_t param_bytes = (kDim * 4 * kDim * 2 + 4 * kDim + kDim) * 4;
  for (int i = 0; i < kBlocks; ++i) {
    const ModuleMemory& r = m.records[i];
    SCOPED_TRACE(r.name);
    EXPECT_EQ(r.name, "block" + std::to_string(i));
    EXPECT_EQ(r.param_bytes, param_bytes);
    EXPECT_EQ(r.output_bytes, out_bytes);
    if (every_other[i]) {
      // A checkpointed block keeps its output and the saved CPU RNG state only (its input is the
      // previous block's output).
      EXPECT_EQ(r.activation_bytes, out_bytes + rng_state_bytes);
    } else {
      // At least fc1's output (saved by gelu), dropout's output (saved by fc2), both [B, 4D],
      // and the block's output.
      EXPECT_GE(r.activation_bytes, 2 * 4 * out_bytes + out_bytes);
    }
    EXPECT_GE(r.fwd_peak_bytes, r.activation_bytes);
    EXPECT_GT(r.bwd_peak_bytes, 0);
  }
  EXPECT_NE(m.table.find("| block7 |"), std::string::npos);
}

TEST_F(MemoryTest, SuggestionsFitTheBudget) {
  MemoryTracker tracker(alloc_);
  torch::Tensor h = x_.clone().requires_grad_();
  for (int i = 0; i < kBlocks; ++i) {
    Block b = blocks_[i];
    h = tracker.forward("block" + std::to_string(i), *b, h,
                        [b](const at::Tensor& in) { return b.ptr()->forward(in); });
  }
  h.sum().backward();
  const CheckpointPlan all = tracker.suggest_checkpoints(0);
  EXPECT_EQ(all.checkpointed.size(), static_cast<size_t>(kBlocks));
  EXPECT_FALSE(all.fits);
  const CheckpointPlan none = tracker.suggest_checkpoints(all.plain_bytes);
  EXPECT_TRUE(none.checkpointed.empty());
  EXPECT_TRUE(none.fits);
  const int64_t budget = all.plain_bytes / 2;
  const CheckpointPlan half = tracker.suggest_checkpoints(budget);
  EXPECT_TRUE(half.fits);
  EXPECT_LE(half.estimated_bytes, budget);
  EXPECT_GT(half.checkpointed.size(), 0u);
  EXPECT_LT(half.checkpointed.size(), static_cast<size_t>(kBlocks));
  const std::string t = tracker.suggestion_table(budget);
  std::cout << tracker.table() << t;
  EXPECT_NE(t.find("| yes |"), std::string::npos);
  EXPECT_NE(t.find("| no |"), std::string::npos);

  // The plan, applied, keeps less between forward and backward than the plain model, and no
  // more than estimated (the estimate counts the recompute, which happens in backward).
  std::vector<bool> chosen(kBlocks, false);
  for (const std::string& name : half.checkpointed) chosen[std::stoi(name.substr(5))] = true;
  const Measured applied = Measure(chosen);
  int64_t kept = 0;
  for (const ModuleMemory& r : applied.records) kept += r.activation_bytes;
  EXPECT_LE(kept, half.estimated_bytes);
}

}  // namespace
}  // namespace fairscale::checkpoint
