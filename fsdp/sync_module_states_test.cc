// FsdpOptions::sync_module_states: ranks that start from different parameters fail at wrap time
// with the first differing parameter named (default), or get rank 0's (sync_module_states(true));
// ranks that agree pay two small all-gathers per unit and nothing else.
#include <ATen/ops/arange.h>
#include <ATen/ops/full.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/testing/counting_communicator.h"
#include "comm/testing/inproc_ranks.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/internal/param_sync.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::fsdp {
namespace {

using ::testing::HasSubstr;

// Two parameters and a buffer with values the test sets: a = arange(6) viewed [2, 3] (+ `shift`
// in element `at` of the named parameter), b = 7s. Deterministic, so every rank can compute what
// rank 0 holds.
class NetImpl : public torch::nn::Module {
 public:
  NetImpl(const std::string& shifted = "", double shift = 0, bool transposed_b = false) {
    a_ = register_parameter("a", at::arange(6, at::kFloat).view({2, 3}));
    // A non-contiguous parameter (a transposed view) exercises the broadcast's copy path.
    at::Tensor b = at::full({3, 4}, 7.0);
    b_ = register_parameter("b", transposed_b ? b.t() : b);
    stat_ = register_buffer("stat", at::zeros({2}));
    c10::NoGradGuard no_grad;
    if (shifted == "a") a_.view({-1})[5].add_(shift);  // the last element: the hash's tail
    if (shifted == "b") b_[0][0].add_(shift);
  }
  torch::Tensor forward(torch::Tensor x) { return x.matmul(a_).matmul(b_.reshape({3, 4})); }
  at::Tensor a_, b_, stat_;
};
TORCH_MODULE(Net);

// A parent unit holding a nested unit over `inner`.
class ParentImpl : public torch::nn::Module {
 public:
  ParentImpl(std::shared_ptr<comm::Communicator> comm, Net inner, FsdpOptions o) {
    w_ = register_parameter("w", at::ones({2}));
    inner_ = register_module("inner", FullyShardedDataParallel(inner, comm, o));
  }
  torch::Tensor forward(torch::Tensor x) { return inner_(x * w_.sum()); }
  at::Tensor w_;
  FullyShardedDataParallel inner_{nullptr};
};
TORCH_MODULE(Parent);

// Runs `body` on 1..4 ranks; returns the statuses of each world size.
template <typename Body>
std::vector<std::vector<absl::Status>> ForWorlds(Body body) {
  std::vector<std::vector<absl::Status>> out;
  for (int world = 1; world <= 4; ++world) out.push_back(comm::testing::RunInprocRanks(world, body));
  return out;
}

TEST(SyncModuleStates, DifferentValuesFailNamingTheFirstParameterOnEveryRank) {
  // Rank 2 (or the last rank) shifts one element of "b"; "a" agrees.
  for (int world = 2; world <= 4; ++world) {
    const int odd = world - 1;
    std::vector<absl::Status> st = comm::testing::RunInprocRanks(
        world, [odd](int rank, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
          Net net(rank == odd ? "b" : "", 1e-6);
          FullyShardedDataParallel model(net, comm);
          return absl::OkStatus();
        });
    for (int r = 0; r < world; ++r) {
      EXPECT_THAT(st[r].message(),
                  HasSubstr(absl::StrCat("parameter 'b' holds different values on rank 0 and rank ",
                                         odd)))
          << "world " << world << " rank " << r;
      EXPECT_THAT(st[r].message(), HasSubstr("sync_module_states(true)"));
      EXPECT_THAT(st[r].message(), HasSubstr(absl::StrCat("rank ", r, "/", world)));
    }
  }
}

TEST(SyncModuleStates, TheFirstDifferingParameterIsNamedWhenSeveralDiffer) {
  std::vector<absl::Status> st = comm::testing::RunInprocRanks(
      2, [](int rank, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        Net net(rank == 1 ? "a" : "", 1.0);
        if (rank == 1) {
          c10::NoGradGuard no_grad;
          net->b_.add_(1.0);
        }
        FullyShardedDataParallel model(net, comm);
        return absl::OkStatus();
      });
  for (const absl::Status& s : st) {
    EXPECT_THAT(s.message(), HasSubstr("parameter 'a' holds different values"));
  }
}

TEST(SyncModuleStates, BroadcastGivesEveryRankRankZerosParameters) {
  for (const bool transposed : {false, true}) {
    for (const bool flatten : {true, false}) {
      auto worlds = ForWorlds([=](int rank, int world,
                                  std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        // Every rank but 0 starts from other values of both parameters; rank 0's are Net()'s.
        Net net(rank == 0 ? "" : "a", rank * 10.0, transposed);
        if (rank != 0) {
          c10::NoGradGuard no_grad;
          net->b_.mul_(rank + 1.0);
        }
        const Net reference("", 0, transposed);
        FullyShardedDataParallel model(
            net, comm, FsdpOptions().sync_module_states(true).flatten_parameters(flatten));
        auto full = model->summon_full_params(/*writeback=*/false);
        for (const char* name : {"a", "b"}) {
          const at::Tensor got = net->named_parameters()[name];
          const at::Tensor want = reference->named_parameters()[name];
          if (!got.equal(want)) {
            return absl::InternalError(absl::StrCat("world ", world, " rank ", rank, " param ",
                                                    name, " is not rank 0's"));
          }
        }
        return absl::OkStatus();
      });
      for (const auto& st : worlds) {
        for (const absl::Status& s : st) EXPECT_TRUE(s.ok()) << s;
      }
    }
  }
}

TEST(SyncModuleStates, NestedUnitsAreCheckedWithTheirOwnNames) {
  std::vector<absl::Status> st = comm::testing::RunInprocRanks(
      3, [](int rank, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        Parent p(comm, Net(rank == 2 ? "a" : "", 0.5), FsdpOptions());
        FullyShardedDataParallel model(p, comm);
        return absl::OkStatus();
      });
  for (const absl::Status& s : st) {
    EXPECT_THAT(s.message(), HasSubstr("NetImpl)"));
    EXPECT_THAT(s.message(), HasSubstr("parameter 'a' holds different values on rank 0 and rank 2"));
  }
}

TEST(SyncModuleStates, ShapeOrCountDifferencesFailEvenWithBroadcast) {
  for (const bool broadcast : {false, true}) {
    std::vector<absl::Status> st = comm::testing::RunInprocRanks(
        2, [=](int rank, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
          Net net;
          if (rank == 1) net->a_.set_data(at::zeros({3, 2}));  // same name, other shape
          FullyShardedDataParallel model(net, comm, FsdpOptions().sync_module_states(broadcast));
          return absl::OkStatus();
        });
    for (const absl::Status& s : st) {
      EXPECT_THAT(s.message(), HasSubstr("name, shape or dtype differs between rank 0 and rank 1"));
    }
    st = comm::testing::RunInprocRanks(
        2, [=](int rank, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
          Net net;
          if (rank == 0) net->register_parameter("extra", at::zeros({1}));
          FullyShardedDataParallel model(net, comm, FsdpOptions().sync_module_states(broadcast));
          return absl::OkStatus();
        });
    EXPECT_THAT(st[0].message(), HasSubstr("rank 1 has 2 parameters in this unit, rank 0 has 3"));
    EXPECT_THAT(st[1].message(), HasSubstr("rank 0 has 3 parameters in this unit, rank 1 has 2"));
  }
}

TEST(SyncModuleStates, AgreeingRanksCostTwoAllGathersAndNoBroadcastOfParameters) {
  for (int world = 1; world <= 4; ++world) {
    for (const bool broadcast : {false, true}) {
      std::vector<absl::Status> st = comm::testing::RunInprocRanks(
          world, [=](int, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
            auto counting = std::make_shared<comm::testing::CountingCommunicator>(comm);
            FullyShardedDataParallel model(Net(), counting,
                                           FsdpOptions().sync_module_states(broadcast));
            const int64_t gathers = counting->count(comm::OpType::kAllGather).ops;
            const int64_t broadcasts = counting->count(comm::OpType::kBroadcast).ops;
            // world 1: nothing to compare; else the count and the hashes. One broadcast: the
            // buffer.
            const int64_t want_gathers = world == 1 ? 0 : 2;
            const int64_t want_broadcasts = world == 1 ? 0 : 1;
            if (gathers != want_gathers || broadcasts != want_broadcasts) {
              return absl::InternalError(absl::StrCat("world ", world, ": ", gathers,
                                                      " all-gathers, ", broadcasts,
                                                      " broadcasts"));
            }
            return absl::OkStatus();
          });
      for (const absl::Status& s : st) EXPECT_TRUE(s.ok()) << s;
    }
  }
}

TEST(SyncModuleStates, HashSeesValuesShapeAndDtypeNotStrides) {
  const at::Tensor x = at::arange(12, at::kFloat).view({3, 4});
  const internal::TensorHash h = internal::HashTensor(x);
  // The same values laid out differently (a transposed copy, transposed back) hash the same.
  const internal::TensorHash same = internal::HashTensor(x.t().contiguous().t());
  EXPECT_EQ(h.shape, same.shape);
  EXPECT_EQ(h.values, same.values);
  // One changed element: the first, the last (in the bytewise tail of an odd byte count, too).
  for (const int64_t i : {int64_t{0}, int64_t{11}}) {
    at::Tensor y = x.clone();
    y.view({-1})[i].add_(1e-6);
    EXPECT_NE(internal::HashTensor(y).values, h.values) << i;
  }
  const at::Tensor odd = at::arange(3, at::kHalf);  // 6 bytes: no whole word
  at::Tensor odd2 = odd.clone();
  odd2[2].add_(1);
  EXPECT_NE(internal::HashTensor(odd).values, internal::HashTensor(odd2).values);
  EXPECT_NE(internal::HashTensor(x.view({4, 3})).shape, h.shape);
  EXPECT_NE(internal::HashTensor(x.to(at::kDouble)).shape, h.shape);
}

}  // namespace
}  // namespace fairscale::fsdp
