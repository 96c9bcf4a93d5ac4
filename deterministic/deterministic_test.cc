// The canonical tree and the deterministic collectives against a single-process reference: the
// tree evaluated recursively over the micro-batches' own values (written here independently of
// tree.cc), across world sizes 1, 2, 3, 4, 6 and 8, dtypes, and sizes that do not divide.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "comm/communicator.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "deterministic/collectives.h"
#include "deterministic/mode.h"
#include "deterministic/tree.h"
#include "testing/bitwise.h"
#include "testing/c10_error.h"

namespace fairscale::deterministic {
namespace {

using ::fairscale::comm::testing::ExpectAllOk;
using ::fairscale::comm::testing::RunInprocRanks;
using ::fairscale::testing::Bitwise;
using ::fairscale::testing::ErrorOf;
using ::testing::HasSubstr;

// Micro-batch j's "gradient": values over many magnitudes so that a different summation order
// changes the last bits (the negative control below shows it does).
at::Tensor Leaf(int64_t j, int64_t numel, at::ScalarType dtype) {
  at::Generator gen = at::detail::createCPUGenerator(1000 + j);
  at::Tensor mag = at::randint(-6, 6, {numel}, gen, at::kDouble);
  at::Tensor v = at::randn({numel}, gen, at::kDouble) * at::pow(10.0, mag);
  return v.to(dtype);
}

// The tree by its definition: node [b, b + 2^l) = left half + right half; the total folds the
// binary digits of n, largest block first.
at::Tensor RefNode(int64_t begin, int64_t size, int64_t numel, at::ScalarType dtype) {
  if (size == 1) return Leaf(begin, numel, dtype);
  return RefNode(begin, size / 2, numel, dtype) + RefNode(begin + size / 2, size / 2, numel, dtype);
}
at::Tensor RefTotal(int64_t n, int64_t numel, at::ScalarType dtype) {
  at::Tensor total;
  int64_t begin = 0;
  for (int bit = 62; bit >= 0; --bit) {
    const int64_t size = int64_t{1} << bit;
    if ((n & size) == 0) continue;
    at::Tensor node = RefNode(begin, size, numel, dtype);
    total = total.defined() ? total + node : node;
    begin += size;
  }
  return total;
}

TEST(Tree, DecomposeByHand) {
  auto names = [](const std::vector<Node>& nodes) {
    std::string s;
    for (const Node& n : nodes) s += NodeName(n);
    return s;
  };
  EXPECT_EQ(names(Decompose(0, 24)), "[0, 16)[16, 24)");
  EXPECT_EQ(names(Decompose(6, 12)), "[6, 8)[8, 12)");
  EXPECT_EQ(names(Decompose(3, 6)), "[3, 4)[4, 6)");
  EXPECT_EQ(names(Decompose(1, 3)), "[1, 2)[2, 3)");
  EXPECT_EQ(names(Decompose(5, 5)), "");
  EXPECT_EQ(names(MergeNodes({{2, 2}, {0, 1}, {1, 1}, {4, 1}})), "[0, 4)[4, 5)");
  EXPECT_TRUE(AreSiblings({4, 2}, {6, 2}));
  EXPECT_FALSE(AreSiblings({2, 2}, {4, 2}));  // [2, 6) is not a node
  EXPECT_FALSE(AreSiblings({0, 2}, {2, 1}));
  EXPECT_THAT(ErrorOf([] { MergeNodes({{0, 2}, {1, 1}}); }), HasSubstr("overlap"));
  EXPECT_THAT(ErrorOf([] { MergeNodes({{1, 2}}); }), HasSubstr("not a node"));
}

TEST(Tree, LayoutRejectsWorldsThatDoNotDivide) {
  EXPECT_THAT(ErrorOf([] { MicroBatchLayout::Make(24, 5, 0); }),
              HasSubstr("24 micro-batches per step cannot be split evenly over 5 ranks"));
  EXPECT_THAT(ErrorOf([] { MicroBatchLayout::Make(24, 5, 0); }),
              HasSubstr("1, 2, 3, 4, 6, 8, 12, 24"));
  EXPECT_THAT(ErrorOf([] { MicroBatchLayout::Make(0, 1, 0); }), HasSubstr("at least 1"));
  const MicroBatchLayout l = MicroBatchLayout::Make(24, 4, 3);
  EXPECT_EQ(l.per_rank(), 6);
  EXPECT_EQ(l.first(), 18);
  EXPECT_EQ(l.nodes_of(1), (std::vector<Node>{{6, 2}, {8, 4}}));
}

TEST(Tree, AccumulatorAndTotalMatchTheReferenceForEverySplit) {
  for (at::ScalarType dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
    for (int64_t m : {1, 3, 7, 12, 24}) {
      const at::Tensor want = RefTotal(m, 257, dtype);
      for (int64_t world = 1; world <= m; ++world) {
        if (m % world != 0) continue;
        std::vector<Partial> all;
        const int64_t k = m / world;
        for (int r = 0; r < world; ++r) {
          Accumulator acc;
          for (int64_t j = r * k; j < (r + 1) * k; ++j) acc.Add(j, Leaf(j, 257, dtype));
          EXPECT_EQ(acc.count(), k);
          std::vector<Partial> mine = acc.Take();
          EXPECT_TRUE(acc.empty());
          ASSERT_EQ(mine.size(), Decompose(r * k, (r + 1) * k).size());
          for (Partial& p : mine) all.push_back(std::move(p));
        }
        EXPECT_TRUE(Bitwise(Total(std::move(all), m), want))
            << "m " << m << " world " << world << " dtype " << dtype;
      }
    }
  }
}

TEST(Tree, AccumulatorTakesAnyArrivalOrder) {
  // Reverse (a GPipe backward) and shuffled orders give the same partials, bitwise.
  for (int64_t k : {5, 8, 12}) {
    const int64_t first = 12;  // rank 1 of 24 / 12 ... as a block [12, 12 + k)
    Accumulator in_order, reverse, shuffled;
    for (int64_t j = first; j < first + k; ++j) in_order.Add(j, Leaf(j, 33, at::kFloat));
    for (int64_t j = first + k - 1; j >= first; --j) reverse.Add(j, Leaf(j, 33, at::kFloat));
    EXPECT_LE(reverse.partials().size(), 4u);
    for (int64_t i = 0; i < k; ++i) {
      const int64_t j = first + (i * 7) % k;  // 7 is prime to 5, 8 and 12
      shuffled.Add(j, Leaf(j, 33, at::kFloat));
    }
    std::vector<Partial> a = in_order.Take(), b = reverse.Take(), c = shuffled.Take();
    ASSERT_EQ(a.size(), Decompose(first, first + k).size());
    ASSERT_EQ(a.size(), b.size());
    ASSERT_EQ(a.size(), c.size());
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].node, Decompose(first, first + k)[i]);
      EXPECT_EQ(a[i].node, b[i].node);
      EXPECT_EQ(a[i].node, c[i].node);
      EXPECT_TRUE(Bitwise(a[i].value, b[i].value));
      EXPECT_TRUE(Bitwise(a[i].value, c[i].value));
    }
  }
}

TEST(Tree, NegativeControlOtherOrdersDiffer) {
  // A left-to-right sum of the same 24 leaves and a per-rank-then-across-ranks sum (what a
  // plain reduction does) give different bits: the tests above can fail.
  const at::Tensor want = RefTotal(24, 4096, at::kFloat);
  at::Tensor left = Leaf(0, 4096, at::kFloat);
  for (int64_t j = 1; j < 24; ++j) left = left + Leaf(j, 4096, at::kFloat);
  EXPECT_FALSE(Bitwise(left, want));
  for (int world : {2, 3, 4}) {
    at::Tensor sum;
    for (int r = 0; r < world; ++r) {
      at::Tensor local;
      for (int64_t j = r * (24 / world); j < (r + 1) * (24 / world); ++j) {
        local = local.defined() ? local + Leaf(j, 4096, at::kFloat) : Leaf(j, 4096, at::kFloat);
      }
      sum = sum.defined() ? sum + local : local;
    }
    EXPECT_FALSE(Bitwise(sum, left) && Bitwise(sum, want)) << world;
  }
}

TEST(Tree, BadInput) {
  Accumulator acc;
  acc.Add(4, at::zeros({2}));
  EXPECT_THAT(ErrorOf([&] { acc.Add(4, at::zeros({2})); }), HasSubstr("already added"));
  std::vector<Partial> gap;
  gap.push_back({{0, 1}, at::zeros({2})});
  gap.push_back({{2, 1}, at::zeros({2})});
  EXPECT_THAT(ErrorOf([&] { Total(gap, 3); }), HasSubstr("missing 1"));
  std::vector<Partial> extra;
  extra.push_back({{0, 2}, at::zeros({2})});
  extra.push_back({{2, 1}, at::zeros({2})});
  EXPECT_THAT(ErrorOf([&] { Total(extra, 2); }), HasSubstr("they reach 3"));
}

TEST(Tree, TotalOfScalarsMatchesTheTensorTree) {
  std::vector<double> v;
  for (int64_t j = 0; j < 24; ++j) v.push_back(Leaf(j, 1, at::kDouble).item<double>());
  EXPECT_EQ(TotalOf(v), RefTotal(24, 1, at::kDouble).item<double>());
}

// Every deterministic collective, on every world size that divides 24 up to 8, against the
// reference; the partials are the ones each rank's Accumulator makes.
class Collectives : public ::testing::TestWithParam<int> {};

TEST_P(Collectives, MatchTheReferenceBitwise) {
  const int world = GetParam();
  constexpr int64_t kM = 24;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (int64_t numel : {int64_t{1}, int64_t{37}, int64_t{1000}}) {
      const at::Tensor want = RefTotal(kM, numel, dtype) / static_cast<double>(kM);
      const at::Tensor padded_want = [&] {
        const int64_t shard = (numel + world - 1) / world;
        at::Tensor w = at::zeros({shard * world}, want.options());
        w.narrow(0, 0, numel).copy_(RefTotal(kM, numel, dtype));
        return w;
      }();
      ExpectAllOk(
          RunInprocRanks(world,
                         [&](int rank, int, std::shared_ptr<comm::Communicator> comm)
                             -> absl::Status {
                           const MicroBatchLayout layout = MicroBatchLayout::Make(kM, world, rank);
                           const int64_t shard = (numel + world - 1) / world;
                           auto partials = [&](bool pad) {
                             Accumulator acc;
                             for (int64_t j = layout.first(); j < layout.first() + layout.per_rank();
                                  ++j) {
                               at::Tensor leaf = Leaf(j, numel, dtype);
                               if (pad) {
                                 at::Tensor p = at::zeros({shard * world}, leaf.options());
                                 p.narrow(0, 0, numel).copy_(leaf);
                                 leaf = p;
                               }
                               acc.Add(j, leaf);
                             }
                             return acc.Take();
                           };
                           const auto nodes = layout.nodes_by_rank();
                           // AllReduce (any numel), then the mean.
                           at::Tensor all = AllReduce(*comm, partials(false), nodes, kM, "test");
                           if (!Bitwise(all / static_cast<double>(kM), want)) {
                             return absl::InternalError(absl::StrCat("all_reduce differs, numel ",
                                                                     numel));
                           }
                           // ReduceScatter: this rank's block of the padded total.
                           at::Tensor block = Total(
                               ReduceScatter(*comm, partials(true), nodes, "test"), kM);
                           if (!Bitwise(block, padded_want.narrow(0, rank * shard, shard))) {
                             return absl::InternalError("reduce_scatter differs");
                           }
                           // AllGather, Gather to the last rank.
                           if (!Bitwise(Total(AllGather(*comm, partials(false), nodes, "test"), kM),
                                        RefTotal(kM, numel, dtype))) {
                             return absl::InternalError("all_gather differs");
                           }
                           std::vector<Partial> at_root =
                               Gather(*comm, world - 1, partials(false), nodes, "test");
                           if (rank == world - 1) {
                             if (!Bitwise(Total(std::move(at_root), kM), RefTotal(kM, numel, dtype))) {
                               return absl::InternalError("gather differs");
                             }
                           } else if (!at_root.empty()) {
                             return absl::InternalError("gather returned partials off the root");
                           }
                           return absl::OkStatus();
                         }),
          absl::StrCat("world ", world, " numel ", numel));
    }
  }
}

TEST_P(Collectives, MeanOfLossesIsTheSameOnEveryWorld) {
  const int world = GetParam();
  std::vector<double> losses;
  for (int64_t j = 0; j < 24; ++j) losses.push_back(Leaf(j, 1, at::kDouble).item<double>());
  const double want = RefTotal(24, 1, at::kDouble).item<double>() / 24;
  ExpectAllOk(RunInprocRanks(world, [&](int rank, int, std::shared_ptr<comm::Communicator> comm)
                                        -> absl::Status {
    const MicroBatchLayout layout = MicroBatchLayout::Make(24, world, rank);
    std::vector<double> mine(losses.begin() + layout.first(),
                             losses.begin() + layout.first() + layout.per_rank());
    const double got = Mean(*comm, layout, mine, "loss");
    if (got != want) return absl::InternalError(absl::StrCat(got, " != ", want));
    return absl::OkStatus();
  }));
}

TEST_P(Collectives, ExactSquareSumDoesNotDependOnTheSplit) {
  const int world = GetParam();
  const at::Tensor x = Leaf(7, 10007, at::kFloat);
  ExactSquareSum whole;
  whole.Add(x);
  // Against a long-double sum (not exact, but within an ulp or two of the exact value).
  long double ref = 0;
  const at::Tensor xd = x.to(at::kDouble);
  for (int64_t i = 0; i < xd.numel(); ++i) {
    const long double v = xd.data_ptr<double>()[i];
    ref += v * v;
  }
  EXPECT_NEAR(whole.value(), static_cast<double>(ref), 1e-15 * static_cast<double>(ref));
  ExpectAllOk(RunInprocRanks(world, [&](int rank, int, std::shared_ptr<comm::Communicator> comm)
                                        -> absl::Status {
    // Uneven, interleaved pieces in another order.
    ExactSquareSum mine;
    for (int64_t i = x.numel() - 1 - rank; i >= 0; i -= world) mine.Add(x.narrow(0, i, 1));
    mine.AllReduce(*comm, "norm");
    if (mine.value() != whole.value()) {
      return absl::InternalError(absl::StrCat(mine.value(), " != ", whole.value()));
    }
    return absl::OkStatus();
  }));
}

INSTANTIATE_TEST_SUITE_P(Worlds, Collectives, ::testing::Values(1, 2, 3, 4, 6, 8),
                         [](const auto& info) { return absl::StrCat("world", info.param); });

TEST(ExactSquareSum, ByHandAndSpecialValues) {
  ExactSquareSum s;
  s.Add(at::tensor({3.0, -4.0, 0.0}, at::kDouble));
  EXPECT_EQ(s.value(), 25.0);
  EXPECT_EQ(s.norm(), 5.0);
  // Magnitudes 2^-140 and 2^120 together: the small one survives exactly in the accumulator.
  ExactSquareSum tiny;
  tiny.Add(at::tensor({std::ldexp(1.0, -140)}, at::kDouble));
  EXPECT_EQ(tiny.value(), std::ldexp(1.0, -280));
  ExactSquareSum big;
  big.Add(at::tensor({std::ldexp(1.0, 120), 1.0}, at::kFloat));
  EXPECT_EQ(big.value(), std::ldexp(1.0, 240));
  ExactSquareSum inf;
  inf.Add(at::tensor({1.0f, std::numeric_limits<float>::infinity()}));
  EXPECT_TRUE(std::isinf(inf.value()));
  ExactSquareSum nan;
  nan.Add(at::tensor({std::numeric_limits<float>::quiet_NaN(), 1.0f}));
  EXPECT_TRUE(std::isnan(nan.value()));
}

TEST(Mode, MixingModesIsAnErrorOnEveryRank) {
  ExpectAllOk(RunInprocRanks(3, [&](int rank, int, std::shared_ptr<comm::Communicator> comm)
                                    -> absl::Status {
    // Rank 2 runs the default mode.
    return ::fairscale::testing::ExpectError(
        [&] { CheckSameMode(*comm, rank != 2, rank != 2 ? 24 : 0, "fsdp"); },
        {"fsdp rank", "ranks disagree on deterministic mode",
         rank == 2 ? "rank 0 runs deterministic mode with 24 micro-batches per step"
                   : "rank 2 runs the default (non-deterministic) mode"});
  }));
  ExpectAllOk(RunInprocRanks(2, [&](int rank, int, std::shared_ptr<comm::Communicator> comm)
                                    -> absl::Status {
    return ::fairscale::testing::ExpectError(
        [&] { CheckSameMode(*comm, true, rank == 0 ? 24 : 12, "oss"); },
        {"with 12 micro-batches", "with 24 micro-batches"});
  }));
  ExpectAllOk(RunInprocRanks(2, [&](int, int, std::shared_ptr<comm::Communicator> comm)
                                    -> absl::Status {
    CheckSameMode(*comm, true, 24, "same");
    return absl::OkStatus();
  }));
}

TEST(Mode, ThreadsMustBePinned) {
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  EXPECT_THAT(ErrorOf([] { CheckThreads("fsdp"); }), HasSubstr("at::set_num_threads(1)"));
  at::set_num_threads(1);
  EXPECT_EQ(ErrorOf([] { CheckThreads("fsdp"); }), "");
  at::set_num_threads(before);
}

}  // namespace
}  // namespace fairscale::deterministic
