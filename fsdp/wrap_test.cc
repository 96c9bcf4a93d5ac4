// fsdp::wrap under EnableWrap scopes: the size policy and the type policy wrap exactly the
// modules they should (checked through the units' prefixes and layouts), outside a scope nothing
// is wrapped, and training the auto-wrapped model matches the single-process reference over 1-4
// thread ranks.
#include "fsdp/wrap.h"

#include <ATen/ops/tanh.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/testing/inproc_ranks.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/test_util.h"
#include "gtest/gtest.h"

namespace fairscale::fsdp {
namespace {

using base::testing::IsOk;
using testing::OptimizerKind;

// testing::Net built through wrap(): same names, shapes and initial values, so the plain Net is
// its reference. fc_in 42 elements, each block 142, fc_out 24.
class AutoNetImpl : public torch::nn::Module {
 public:
  AutoNetImpl() {
    torch::nn::Linear fc_in(5, 7);
    testing::InitDeterministic(*fc_in, "fc_in.");
    fc_in_ = wrap(fc_in);
    register_module("fc_in", fc_in_.ptr());
    for (int i = 0; i < 2; ++i) {
      const std::string name = absl::StrCat("block", i);
      testing::Block block(7, 9);
      testing::InitDeterministic(*block, name + ".");
      blocks_.push_back(wrap(block));
      register_module(name, blocks_.back().ptr());
    }
    torch::nn::Linear fc_out(7, 3);
    testing::InitDeterministic(*fc_out, "fc_out.");
    fc_out_ = wrap(fc_out);
    register_module("fc_out", fc_out_.ptr());
  }
  torch::Tensor forward(torch::Tensor x) {
    x = at::tanh(fc_in_(x));
    for (Wrapped& b : blocks_) x = b(x);
    return fc_out_(x);
  }

 private:
  Wrapped fc_in_;
  std::vector<Wrapped> blocks_;
  Wrapped fc_out_;
};
TORCH_MODULE(AutoNet);

using testing::MseStep;

struct PolicyCase {
  std::string name;
  AutoWrapPolicy policy;
  std::vector<std::string> units;  // expected fsdp_units() prefixes
};

std::vector<PolicyCase> Cases() {
  return {
      {"size100", size_based_auto_wrap_policy(100), {"", "block0.", "block1."}},
      {"size30", size_based_auto_wrap_policy(30), {"", "fc_in.", "block0.", "block1."}},
      {"type_block",
       module_type_auto_wrap_policy<testing::BlockImpl>(),
       {"", "block0.", "block1."}},
      // Only modules passed to wrap() are candidates: the blocks' inner Linears are not.
      {"type_linear", module_type_auto_wrap_policy<torch::nn::Linear>(), {"", "fc_in.", "fc_out."}},
      {"always", nullptr, {"", "fc_in.", "block0.", "block1.", "fc_out."}},
  };
}

auto MakeFor(AutoWrapPolicy policy) {
  return [policy](std::shared_ptr<comm::Communicator> comm, FsdpOptions opts) {
    if (comm == nullptr) return AutoNet();
    EnableWrap scope(comm, opts, policy);
    return AutoNet();
  };
}

TEST(FsdpWrap, PoliciesWrapWhatTheySay) {
  for (const PolicyCase& c : Cases()) {
    const std::vector<absl::Status> statuses = comm::testing::RunInprocRanks(
        2, [&](int rank, int world, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
          FullyShardedDataParallel model(MakeFor(c.policy)(comm, {}), comm);
          model(at::ones({2, 5}));  // the root's first forward names the units
          std::vector<std::string> prefixes;
          for (FullyShardedDataParallelImpl* u : model->fsdp_units()) {
            prefixes.push_back(u->prefix());
            // Every unit holds exactly the parameters under its prefix that no deeper unit has.
            for (const FlatParamInfo& info : u->flat_param_info()) {
              for (const auto& e : info.params) {
                if (e.name.rfind(u->prefix(), 0) != 0) {
                  return absl::InternalError(
                      absl::StrCat(c.name, ": ", e.name, " in unit '", u->prefix(), "'"));
                }
              }
            }
          }
          if (prefixes != c.units) {
            return absl::InternalError(absl::StrCat(c.name, ": units [",
                                                    absl::StrJoin(prefixes, ", "), "], expected [",
                                                    absl::StrJoin(c.units, ", "), "]"));
          }
          return absl::OkStatus();
        });
    for (size_t r = 0; r < statuses.size(); ++r) EXPECT_THAT(statuses[r], IsOk()) << c.name;
  }
}

TEST(FsdpWrap, OutsideAScopeNothingIsWrappedAndScopesNest) {
  AutoNet plain;
  for (const auto& child : plain->children()) {
    EXPECT_EQ(std::dynamic_pointer_cast<FullyShardedDataParallelImpl>(child), nullptr);
  }
  EXPECT_EQ(unwrapped_numel(*plain), 42 + 2 * 142 + 24);
  const std::vector<absl::Status> statuses = comm::testing::RunInprocRanks(
      1, [](int, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        EnableWrap outer(comm, {}, size_based_auto_wrap_policy(1));
        {
          EnableWrap inner(comm, {}, size_based_auto_wrap_policy(1000));
          if (wrap(testing::Block(7, 9)).is_wrapped()) return absl::InternalError("inner scope");
        }
        if (!wrap(testing::Block(7, 9)).is_wrapped()) return absl::InternalError("outer scope");
        return absl::OkStatus();
      });
  EXPECT_THAT(statuses[0], IsOk());
}

TEST(FsdpWrap, AutoWrappedTrainingMatchesTheReference) {
  constexpr int kSteps = 5;
  for (const PolicyCase& c : Cases()) {
    if (c.name == "size30" || c.name == "type_block") continue;  // same shapes as the others
    const auto ref =
        testing::RunReferenceWith(MakeFor(c.policy), MseStep(), OptimizerKind::kAdam, kSteps);
    for (ShardingStrategy strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
      for (int world = 1; world <= 4; ++world) {
        const std::vector<absl::Status> statuses = comm::testing::RunInprocRanks(
            world, [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) {
              return testing::RunParityRank(MakeFor(c.policy), MseStep(), OptimizerKind::kAdam, ref,
                                            FsdpOptions().sharding_strategy(strategy),
                                            /*nested=*/true, rank, w, comm);
            });
        for (size_t r = 0; r < statuses.size(); ++r) {
          EXPECT_THAT(statuses[r], IsOk())
              << c.name << " " << ShardingStrategyName(strategy) << " world " << world;
        }
      }
    }
  }
}

}  // namespace
}  // namespace fairscale::fsdp
