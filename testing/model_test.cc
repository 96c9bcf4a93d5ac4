// The shared test model: its values do not depend on wrapping or on the RNG, frozen and unused
// parameters are where NetConfig says, wrap_block's module and forward are the ones used, and
// the global batch splits into rank rows; ErrorOf / ExpectError.
#include "testing/model.h"

#include <ATen/ops/equal.h>
#include <torch/utils.h>

#include <string>
#include <vector>

#include "base/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/c10_error.h"

namespace fairscale::testing {
namespace {

using ::fairscale::base::testing::IsOk;
using ::fairscale::base::testing::StatusIs;
using ::testing::HasSubstr;

TEST(Net, ValuesDependOnNamesOnly) {
  torch::manual_seed(1);
  Net a;
  torch::manual_seed(2);
  Net b;
  const auto pa = a->named_parameters();
  const auto pb = b->named_parameters();
  ASSERT_EQ(pa.keys(), pb.keys());
  int64_t numel = 0;
  for (const auto& item : pa) {
    EXPECT_TRUE(at::equal(item.value(), pb[item.key()])) << item.key();
    numel += item.value().numel();
  }
  EXPECT_EQ(numel, 350);
  EXPECT_TRUE(at::equal(a(GlobalBatch(0).x), b(GlobalBatch(0).x)));
}

TEST(Net, FrozenUnusedAndSkippedBlocks) {
  NetConfig config;
  config.frozen = {"fc_in.weight", "block1.fc2.bias"};
  config.with_unused = true;
  Net net(config);
  for (const auto& item : net->named_parameters()) {
    EXPECT_EQ(item.value().requires_grad(), config.frozen.count(item.key()) == 0) << item.key();
  }
  EXPECT_TRUE(net->named_parameters().contains("unused.weight"));
  const at::Tensor x = GlobalBatch(1).x;
  const at::Tensor both = net(x);
  net->skip_block = 1;
  EXPECT_FALSE(at::equal(net(x), both));
}

TEST(Net, WrapBlockRegistersAndCallsTheWrapper) {
  int calls = 0;
  NetConfig config;
  config.wrap_block = [&calls](Block block) {
    return WrappedBlock{block.ptr(), [block, &calls](torch::Tensor x) mutable {
                          ++calls;
                          return block(x);
                        }};
  };
  Net wrapped(config);
  Net plain;
  EXPECT_EQ(wrapped->named_parameters().keys(), plain->named_parameters().keys());
  const at::Tensor x = GlobalBatch(2).x;
  EXPECT_TRUE(at::equal(wrapped(x), plain(x)));
  EXPECT_EQ(calls, 2);
}

TEST(Batches, RankRowsSplitTheGlobalBatch) {
  const Batch b = GlobalBatch(3);
  ASSERT_EQ(b.x.size(0), kBatchRows);
  for (int world = 1; world <= 4; ++world) {
    std::vector<at::Tensor> parts;
    for (int r = 0; r < world; ++r) parts.push_back(RankRows(b.x, r, world));
    EXPECT_TRUE(at::equal(at::cat(parts), b.x)) << world;
  }
  EXPECT_FALSE(at::equal(GlobalBatch(0).x, GlobalBatch(1).x));
}

TEST(Optimizers, DistinctParametersDropTiedRepeats) {
  Net net;
  net->register_parameter("tied", net->named_parameters()["fc_in.weight"]);
  EXPECT_EQ(net->parameters().size(), DistinctParameters(*net).size() + 1);
  for (OptimizerKind kind :
       {OptimizerKind::kSgdMomentum, OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    EXPECT_NE(MakeOptimizer(kind, DistinctParameters(*net)), nullptr) << OptimizerName(kind);
  }
}

TEST(C10Error, ErrorOfAndExpectError) {
  auto raise = [] { TORCH_CHECK(false, "shard 3 is missing"); };
  EXPECT_EQ(ErrorOf([] {}), "");
  EXPECT_THAT(ErrorOf(raise), HasSubstr("shard 3 is missing"));
  EXPECT_THAT(ExpectError(raise, {"shard 3", "missing"}), IsOk());
  EXPECT_THAT(ExpectError(raise, {"shard 4"}),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("lacks 'shard 4'")));
  EXPECT_THAT(ExpectError([] {}, {}), StatusIs(absl::StatusCode::kInternal, "no error"));
}

}  // namespace
}  // namespace fairscale::testing
