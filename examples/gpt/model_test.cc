// The Gpt with activation checkpointing (GptConfig::checkpoint_every_k) against the plain Gpt:
// the same parameter names, bitwise the same loss and gradients in fp32 (the forward has no
// randomness, and the recompute runs the same kernels on the same inputs), and less activation
// memory, counted exactly by base::TrackingCpuAllocator: plain, and under FSDP (1 rank over
// inproc; each checkpointed block is a CheckpointWrapper inside its own unit).
#include "examples/gpt/model.h"

#include <ATen/ops/randint.h>
#include <torch/nn/functional/loss.h>
#include <torch/utils.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/tracking_allocator.h"
#include "checkpoint/checkpoint.h"
#include "comm/registry.h"
#include "comm/testing/rank_runner.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/wrap.h"
#include "gtest/gtest.h"

namespace fairscale::examples::gpt {
namespace {

constexpr int64_t kBatch = 8;

GptConfig Config(int64_t every_k) {
  return GptConfig().vocab(72).seq(64).width(64).heads(4).blocks(4).checkpoint_every_k(every_k);
}

base::TrackingCpuAllocator* Allocator() {
  static base::TrackingCpuAllocator* alloc = base::TrackingCpuAllocator::Install();
  return alloc;
}

struct StepResult {
  at::Tensor loss;
  std::vector<std::string> names;
  std::vector<at::Tensor> grads;
  int64_t activation_bytes = 0;  // peak during forward + backward - live before the forward
};

// One forward + backward of `forward` on a fixed batch; gradients of `params` (in order).
template <typename Forward>
StepResult Step(Forward forward, const std::vector<std::string>& names,
                const std::vector<at::Tensor>& params) {
  torch::manual_seed(7);
  const at::Tensor tokens = at::randint(72, {kBatch, Config(0).seq() + 1});
  const at::Tensor input = tokens.narrow(1, 0, Config(0).seq());
  const at::Tensor target = tokens.narrow(1, 1, Config(0).seq()).reshape({-1});
  base::TrackingCpuAllocator* alloc = Allocator();
  StepResult r;
  const int64_t before = alloc->live_bytes();
  alloc->reset_peak();
  {
    at::Tensor logits = forward(input);
    r.loss = torch::nn::functional::cross_entropy(logits.reshape({-1, 72}), target);
    r.loss.backward();
  }
  r.activation_bytes = alloc->peak_bytes() - before;
  r.names = names;
  for (const at::Tensor& p : params) r.grads.push_back(p.grad().clone());
  return r;
}

StepResult PlainStep(int64_t every_k) {
  Allocator();  // before the model: its tensors are counted
  torch::manual_seed(0);
  Gpt model(Config(every_k));
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  for (const auto& item : model->named_parameters()) {
    names.push_back(item.key());
    params.push_back(item.value());
  }
  return Step([&](const at::Tensor& x) { return model(x); }, names, params);
}

void ExpectBitwiseEqual(const StepResult& a, const StepResult& b, const std::string& what) {
  EXPECT_TRUE(a.loss.equal(b.loss)) << what << ": " << a.loss.item<double>() << " vs "
                                    << b.loss.item<double>();
  EXPECT_EQ(a.names, b.names) << what;
  ASSERT_EQ(a.grads.size(), b.grads.size()) << what;
  for (size_t i = 0; i < a.grads.size(); ++i) {
    EXPECT_TRUE(a.grads[i].equal(b.grads[i])) << what << ": gradient of " << a.names[i];
  }
}

TEST(GptCheckpointingTest, PlainModelSameGradientsBitwiseLessActivationMemory) {
  const StepResult none = PlainStep(0);
  const StepResult every2 = PlainStep(2);
  const StepResult all = PlainStep(1);
  ExpectBitwiseEqual(none, every2, "every 2nd block");
  ExpectBitwiseEqual(none, all, "every block");
  std::printf("activation bytes, plain model: none %lld, every 2nd block %lld, every block %lld\n",
              static_cast<long long>(none.activation_bytes),
              static_cast<long long>(every2.activation_bytes),
              static_cast<long long>(all.activation_bytes));
  EXPECT_LT(every2.activation_bytes, none.activation_bytes);
  EXPECT_LT(all.activation_bytes, every2.activation_bytes);
  // Four blocks dominate this model's activations: keeping only their inputs saves well over half.
  EXPECT_LT(2 * all.activation_bytes, none.activation_bytes);
}

// FSDP at 1 rank (so the flat gradients are comparable and the tracked bytes are one rank's):
// GptWrapPolicy puts each checkpointed block, wrapper included, in its own unit.
StepResult FsdpStep(int64_t every_k, int* units, bool* checkpointed) {
  Allocator();
  StepResult result;
  const std::vector<absl::Status> st = comm::testing::RunThreads(
      1,
      [&](int) -> absl::Status {
        absl::StatusOr<std::shared_ptr<comm::Communicator>> comm =
            comm::CreateCommunicator("inproc", comm::testing::RankConfig(absl::Seconds(30)));
        if (!comm.ok()) return comm.status();
        const auto opts = fsdp::FsdpOptions();
        torch::manual_seed(0);
        fsdp::FullyShardedDataParallel model{nullptr};
        {
          fsdp::EnableWrap scope(*comm, opts, GptWrapPolicy());
          model = fsdp::FullyShardedDataParallel(Gpt(Config(every_k)), *comm, opts);
        }
        *units = static_cast<int>(model->fsdp_units().size());
        *checkpointed = false;
        for (fsdp::FullyShardedDataParallelImpl* u : model->fsdp_units()) {
          if (dynamic_cast<checkpoint::CheckpointWrapperImpl*>(u->module().get()) != nullptr) {
            *checkpointed = true;
          }
        }
        std::vector<std::string> names;
        for (size_t i = 0; i < model->parameters().size(); ++i) names.push_back(absl::StrCat(i));
        result = Step([&](const at::Tensor& x) { return model(x); }, names, model->parameters());
        return absl::OkStatus();
      },
      absl::Seconds(60));
  EXPECT_TRUE(st[0].ok()) << st[0];
  return result;
}

TEST(GptCheckpointingTest, InsideFsdpUnitsSameGradientsBitwiseLessActivationMemory) {
  int units_none = 0, units_all = 0;
  bool ck_none = true, ck_all = false;
  const StepResult none = FsdpStep(0, &units_none, &ck_none);
  const StepResult all = FsdpStep(1, &units_all, &ck_all);
  EXPECT_EQ(units_none, 1 + 1 + 4 + 1);  // root, embeddings, 4 blocks, head
  EXPECT_EQ(units_all, units_none);
  EXPECT_FALSE(ck_none);
  EXPECT_TRUE(ck_all);
  ExpectBitwiseEqual(none, all, "FSDP, every block");
  std::printf("activation bytes, FSDP 1 rank: none %lld, every block %lld\n",
              static_cast<long long>(none.activation_bytes),
              static_cast<long long>(all.activation_bytes));
  EXPECT_LT(2 * all.activation_bytes, none.activation_bytes);
}

TEST(GptCheckpointingTest, NegativeEveryKIsRejected) {
  EXPECT_THROW(Gpt(Config(-1)), c10::Error);
}

}  // namespace
}  // namespace fairscale::examples::gpt
