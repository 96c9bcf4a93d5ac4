// Automatic balances: the partition solver against hand-solved cases, balance_by_size on a
// model with two heavy layers, and balance_by_time's contract (a valid partition; it leaves no
// gradients). Times are not asserted.
#include <c10/util/Exception.h>
#include <torch/nn/modules/linear.h>

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipe/balance.h"
#include "pipe/test_util.h"

namespace fairscale::pipe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

TEST(BalanceTest, ByCostMinimisesTheLargestStage) {
  EXPECT_THAT(balance_by_cost(2, {1, 1, 1, 1}), ElementsAre(2, 2));
  EXPECT_THAT(balance_by_cost(2, {5, 1, 1, 1, 1, 1}), ElementsAre(1, 5));
  // {1, 2, 3} {4, 5} {6}: largest 9, the only split that reaches it.
  EXPECT_THAT(balance_by_cost(3, {1, 2, 3, 4, 5, 6}), ElementsAre(3, 2, 1));
  EXPECT_THAT(balance_by_cost(3, {1, 1, 1}), ElementsAre(1, 1, 1));
  EXPECT_THAT(balance_by_cost(1, {1, 2, 3}), ElementsAre(3));
  // Zero costs still give every stage a layer.
  EXPECT_THAT(balance_by_cost(3, {0, 0, 0, 10}), ElementsAre(1, 1, 2));
  EXPECT_THAT([] { balance_by_cost(0, {1}); },
              ThrowsMessage<c10::Error>(
                  HasSubstr("pipe::balance_by_cost: INVALID_ARGUMENT: 0 partitions for 1 layers")));
  EXPECT_THAT([] { balance_by_cost(3, {1, 1}); },
              ThrowsMessage<c10::Error>(
                  HasSubstr("pipe::balance_by_cost: INVALID_ARGUMENT: 3 partitions for 2 layers")));
}

torch::nn::Sequential HeavyMiddle() {
  return torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::Linear(4, 400),
                               torch::nn::Linear(400, 4), torch::nn::Linear(4, 4));
}

TEST(BalanceTest, BySizeSeparatesHeavyLayers) {
  // Costs for 8-row micro-batches, param_scale 2 (f32): 2 * 20 * 4 + 8 * 4 * 4 = 288;
  // 2 * 2000 * 4 + 8 * 400 * 4 = 28800; 2 * 1604 * 4 + 128 = 12960; 288.
  const at::Tensor sample = testing::Inputs(16, 1);
  EXPECT_THAT(balance_by_size(2, HeavyMiddle(), sample, 2), ElementsAre(2, 2));
  EXPECT_THAT(balance_by_size(3, HeavyMiddle(), sample, 2), ElementsAre(1, 1, 2));
  EXPECT_THAT(balance_by_cost(3, {288, 28800, 12960, 288}), ElementsAre(1, 1, 2));
  EXPECT_THAT([&] { balance_by_size(5, HeavyMiddle(), sample); },
              ThrowsMessage<c10::Error>(
                  HasSubstr("pipe::balance_by_size: INVALID_ARGUMENT: 5 partitions for 4 layers")));
  EXPECT_THAT([] { balance_by_size(2, HeavyMiddle(), at::Tensor()); },
              ThrowsMessage<c10::Error>(HasSubstr("pipe::balance_by_size: INVALID_ARGUMENT")));
}

TEST(BalanceTest, ByTimeGivesAValidPartition) {
  torch::nn::Sequential model = HeavyMiddle();
  const std::vector<int64_t> balance = balance_by_time(3, model, testing::Inputs(16, 1), 2);
  ASSERT_EQ(balance.size(), 3u);
  int64_t sum = 0;
  for (int64_t b : balance) {
    EXPECT_GE(b, 1);
    sum += b;
  }
  EXPECT_EQ(sum, 4);
  for (const at::Tensor& p : model->parameters()) EXPECT_FALSE(p.grad().defined());
}

}  // namespace
}  // namespace fairscale::pipe
