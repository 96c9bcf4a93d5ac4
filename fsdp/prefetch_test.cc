// Forward prefetch: with FsdpOptions::forward_prefetch (the default), the all-gather of the unit
// that runs next is issued before the current unit computes, so it overlaps with that compute;
// without it, each unit's all-gather is issued only when that unit's forward starts.
//
// Observed through CountingCommunicator: each nested unit's wrapped module records, when its
// forward body runs (its own parameters gathered and waited for), how many all-gathers this
// forward has issued so far. Units: root, unit0, unit1, in that order. With prefetch, when unit0
// computes, unit1's all-gather has already been issued (unit0 sees the same count as unit1);
// without it, unit1's all-gather comes later (unit0 sees one fewer). The first iteration only
// records the order, so it is checked from the second on; results must match either way.
#include <ATen/ops/arange.h>
#include <ATen/ops/sin.h>
#include <ATen/ops/tanh.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/registry.h"
#include "comm/testing/rank_runner.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/test_util.h"
#include "fsdp/testing/counting_communicator.h"
#include "gtest/gtest.h"

namespace fairscale::fsdp {
namespace {

using base::testing::IsOk;
using testing::CountingCommunicator;

int64_t AllGathers(const CountingCommunicator& c) { return c.count(comm::OpType::kAllGather).ops; }

// tanh(fc(x)); records the all-gathers issued so far each time it computes.
class ProbeImpl : public torch::nn::Module {
 public:
  ProbeImpl(const CountingCommunicator* counter, std::vector<int64_t>* seen)
      : counter_(counter), seen_(seen) {
    fc = register_module("fc", torch::nn::Linear(6, 6));
    testing::InitDeterministic(*this, "probe.");
  }
  torch::Tensor forward(torch::Tensor x) {
    seen_->push_back(AllGathers(*counter_));
    return at::tanh(fc(x));
  }
  torch::nn::Linear fc{nullptr};

 private:
  const CountingCommunicator* counter_;
  std::vector<int64_t>* seen_;
};
TORCH_MODULE(Probe);

// fc_out(unit1(unit0(fc_in(x)))), unit0 and unit1 nested FSDP units.
class ChainImpl : public torch::nn::Module {
 public:
  ChainImpl(std::shared_ptr<CountingCommunicator> comm, FsdpOptions options,
            std::vector<int64_t>* seen0, std::vector<int64_t>* seen1)
      : unit0_(Probe(comm.get(), seen0), comm, options),
        unit1_(Probe(comm.get(), seen1), comm, options) {
    fc_in_ = register_module("fc_in", torch::nn::Linear(4, 6));
    register_module("unit0", unit0_);
    register_module("unit1", unit1_);
    fc_out_ = register_module("fc_out", torch::nn::Linear(6, 2));
    testing::InitDeterministic(*fc_in_, "fc_in.");
    testing::InitDeterministic(*fc_out_, "fc_out.");
  }
  torch::Tensor forward(torch::Tensor x) { return fc_out_(unit1_(unit0_(fc_in_(x)))); }

 private:
  torch::nn::Linear fc_in_{nullptr}, fc_out_{nullptr};
  FullyShardedDataParallel unit0_, unit1_;
};
TORCH_MODULE(Chain);

constexpr int kSteps = 3;

// Trains kSteps steps; returns the losses and fills the counts each unit saw per step.
absl::Status RunRank(int rank, int world, std::shared_ptr<comm::Communicator> inner, bool prefetch,
                     std::vector<int64_t>* seen0, std::vector<int64_t>* seen1,
                     std::vector<double>* losses) {
  auto counting = std::make_shared<CountingCommunicator>(inner);
  const auto opts = FsdpOptions()
                        .sharding_strategy(ShardingStrategy::kFullShard)
                        .forward_prefetch(prefetch)
                        .disable_reshard_on_root(false);
  FullyShardedDataParallel model(Chain(counting, opts, seen0, seen1), counting, opts);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    counting->Reset();
    at::Tensor x = at::sin(at::arange(8 * 4, at::kFloat).view({8, 4}) * (0.3 + step) + rank);
    at::Tensor loss = model(x).pow(2).mean();
    loss.backward();
    opt.step();
    losses->push_back(loss.item<double>());
  }
  if (seen0->size() != kSteps || seen1->size() != kSteps) {
    return absl::InternalError(absl::StrCat("units ran ", seen0->size(), " and ", seen1->size(),
                                            " times, expected ", kSteps));
  }
  return absl::OkStatus();
}

TEST(PrefetchTest, NextUnitAllGatherIssuedBeforeCurrentUnitComputes) {
  for (int world : {2, 3}) {
    // [prefetch][rank]
    std::vector<std::vector<int64_t>> seen0[2], seen1[2];
    std::vector<std::vector<double>> losses[2];
    for (int prefetch = 0; prefetch < 2; ++prefetch) {
      seen0[prefetch].assign(world, {});
      seen1[prefetch].assign(world, {});
      losses[prefetch].assign(world, {});
      std::vector<absl::Status> statuses = testing::RunRanks(
          world, [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
            return RunRank(rank, w, comm, prefetch == 1, &seen0[prefetch][rank],
                           &seen1[prefetch][rank], &losses[prefetch][rank]);
          });
      for (int r = 0; r < world; ++r) {
        ASSERT_THAT(statuses[r], IsOk()) << "world " << world << " prefetch " << prefetch;
      }
    }
    for (int r = 0; r < world; ++r) {
      SCOPED_TRACE(absl::StrCat("world ", world, " rank ", r));
      for (int step = 1; step < kSteps; ++step) {
        SCOPED_TRACE(absl::StrCat("step ", step));
        // Prefetch: unit1's gather was issued before unit0 computed.
        EXPECT_EQ(seen0[1][r][step], seen1[1][r][step]);
        // No prefetch: it was issued after unit0 computed, when unit1's forward started.
        EXPECT_EQ(seen0[0][r][step] + 1, seen1[0][r][step]);
        // Prefetch changes when gathers are issued, not how many.
        EXPECT_EQ(seen1[0][r][step], seen1[1][r][step]);
      }
      // The first forward records the order and cannot prefetch.
      EXPECT_EQ(seen0[1][r][0] + 1, seen1[1][r][0]);
      for (int step = 0; step < kSteps; ++step) {
        EXPECT_DOUBLE_EQ(losses[0][r][step], losses[1][r][step]) << "step " << step;
      }
    }
  }
}

}  // namespace
}  // namespace fairscale::fsdp
