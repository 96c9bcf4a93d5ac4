// The local gradient hook (register_local_grad_hook): after every backward it reports, for each
// trainable tensor the optimizer steps, this rank's squared norm of that backward's unsharded
// gradient, before any reduction. Checked against a plain Net's autograd gradients of the same
// rank's rows (f64 sums of squares, 1e-9 relative), for the flat and the per-parameter layout,
// sharded and unsharded (kNoShard accumulates through views of the shard's .grad), nested
// units, CPU offload (its offloaded path, forced on the CPU), world sizes 1-3, and two backward
// passes under no_sync() then one more without zero_grad (each reports its own gradient, not
// the accumulated one); plus the misuse errors.
#include <torch/nn/module.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/internal/flat_param.h"
#include "fsdp/test_util.h"
#include "gtest/gtest.h"
#include "testing/c10_error.h"

namespace fairscale::fsdp {
namespace {

using comm::testing::Check;
using fairscale::testing::ExpectError;

// Each parameter's gradient (by full name) of a plain Net on rank `rank`'s rows of step `step`.
std::map<std::string, at::Tensor> LocalGrads(int step, int rank, int world) {
  testing::Net net = testing::NestedNet(nullptr);
  testing::Batch b = testing::GlobalBatch(step);
  testing::Mse(net(testing::RankRows(b.x, rank, world)), testing::RankRows(b.y, rank, world))
      .backward();
  std::map<std::string, at::Tensor> out;
  for (const auto& p : net->named_parameters()) out[p.key()] = p.value().grad().clone();
  return out;
}

double SumSqr(const at::Tensor& t) { return t.to(at::kDouble).pow(2).sum().item<double>(); }

// What the hook must report for `model`'s trainable tensors after the backward of `step`.
std::map<const c10::TensorImpl*, double> Expected(FullyShardedDataParallel& model, int step,
                                                  int rank, int world) {
  const auto grads = LocalGrads(step, rank, world);
  std::map<const c10::TensorImpl*, double> out;
  for (FullyShardedDataParallelImpl* u : model->fsdp_units()) {
    const auto info = u->flat_param_info();
    const auto shards = u->flat_shards();
    for (size_t f = 0; f < info.size(); ++f) {
      if (!info[f].requires_grad) continue;
      double flat = 0;
      for (size_t i = 0; i < info[f].params.size(); ++i) {
        const double s = SumSqr(grads.at(info[f].params[i].name));
        flat += s;
        if (info[f].per_parameter) out[shards[f].params[i].unsafeGetTensorImpl()] = s;
      }
      if (!info[f].per_parameter) out[shards[f].shard.unsafeGetTensorImpl()] = flat;
    }
  }
  return out;
}

absl::Status CheckReport(const std::vector<LocalGradSqr>& got,
                         const std::map<const c10::TensorImpl*, double>& want,
                         const std::string& what) {
  FS_RETURN_IF_ERROR(Check(got.size() == want.size(), absl::StrCat(what, ": ", got.size(),
                                                                   " entries, want ", want.size())));
  for (const LocalGradSqr& e : got) {
    auto it = want.find(e.param.unsafeGetTensorImpl());
    FS_RETURN_IF_ERROR(Check(it != want.end(), what + ": a tensor the optimizer does not step"));
    FS_RETURN_IF_ERROR(Check(it->second > 0 && std::abs(e.sum_sqr - it->second) <=
                                                   1e-9 * it->second,
                             absl::StrCat(what, ": sum_sqr ", e.sum_sqr, " want ", it->second)));
  }
  return absl::OkStatus();
}

struct HookCase {
  ShardingStrategy strategy;
  bool flatten;
  bool nested;
  bool offload = false;  // move_params_to_cpu on its offloaded path (the CPU test hook)
};

// Makes move_params_to_cpu take its offloaded path while alive (read at construction).
class ForceOffloadPath {
 public:
  explicit ForceOffloadPath(bool on) : on_(on) {
    if (on_) internal::SetOffloadOnCpuForTesting(true);
  }
  ~ForceOffloadPath() {
    if (on_) internal::SetOffloadOnCpuForTesting(false);
  }

 private:
  bool on_;
};

class LocalGradHookTest : public ::testing::TestWithParam<HookCase> {};

TEST_P(LocalGradHookTest, ReportsEachBackwardsLocalGradient) {
  const HookCase c = GetParam();
  ForceOffloadPath offload(c.offload);
  for (int world = 1; world <= 3; ++world) {
    comm::testing::ExpectAllOk(
        comm::testing::RunInprocRanks(
            world,
            [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
             return fairscale::testing::CatchErrors([&]() -> absl::Status {
              const auto opts = FsdpOptions()
                                    .sharding_strategy(c.strategy)
                                    .flatten_parameters(c.flatten)
                                    .move_params_to_cpu(c.offload);
              FullyShardedDataParallel model(testing::NestedNet(c.nested ? comm : nullptr, opts),
                                             comm, opts);
              std::vector<std::vector<LocalGradSqr>> reports;
              model->register_local_grad_hook(
                  [&](const std::vector<LocalGradSqr>& r) { reports.push_back(r); });
              auto backward = [&](int step) {
                testing::Batch b = testing::GlobalBatch(step);
                testing::Mse(model(testing::RankRows(b.x, rank, w)),
                             testing::RankRows(b.y, rank, w))
                    .backward();
              };
              {
                auto guard = model->no_sync();
                backward(0);
              }
              backward(1);  // accumulates onto step 0's gradient and reduces the sum
              backward(2);  // no zero_grad: accumulates again
              FS_RETURN_IF_ERROR(Check(reports.size() == 3, "one report per backward"));
              for (int step = 0; step < 3; ++step) {
                FS_RETURN_IF_ERROR(CheckReport(reports[step], Expected(model, step, rank, w),
                                               absl::StrCat("rank ", rank, "/", w, " backward ",
                                                            step)));
              }
              model->remove_local_grad_hook();
              backward(3);
              return Check(reports.size() == 3 && !model->has_local_grad_hook(),
                           "the removed hook was called");
             });
            }),
        absl::StrCat("world ", world));
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, LocalGradHookTest,
    ::testing::Values(HookCase{ShardingStrategy::kFullShard, true, true},
                      HookCase{ShardingStrategy::kFullShard, false, true},
                      HookCase{ShardingStrategy::kShardGradOp, true, false},
                      HookCase{ShardingStrategy::kNoShard, true, true},
                      HookCase{ShardingStrategy::kNoShard, false, false},
                      HookCase{ShardingStrategy::kFullShard, true, true, true},
                      HookCase{ShardingStrategy::kNoShard, true, false, true}),
    [](const ::testing::TestParamInfo<HookCase>& info) {
      return absl::StrCat(ShardingStrategyName(info.param.strategy),
                          info.param.flatten ? "_Flat" : "_PerParam",
                          info.param.nested ? "_Nested" : "", info.param.offload ? "_Offload" : "");
    });

TEST(LocalGradHookErrorTest, Misuse) {
  comm::testing::ExpectAllOk(comm::testing::RunInprocRanks(
      2, [&](int, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        FullyShardedDataParallel model(testing::NestedNet(comm), comm);
        FS_RETURN_IF_ERROR(ExpectError([&] { model->register_local_grad_hook(nullptr); },
                                       {"register_local_grad_hook: the hook is empty"}));
        model->register_local_grad_hook([](const std::vector<LocalGradSqr>&) {});
        FS_RETURN_IF_ERROR(ExpectError(
            [&] { model->register_local_grad_hook([](const std::vector<LocalGradSqr>&) {}); },
            {"registered already", "remove_local_grad_hook() first"}));
        // A nested unit is not a root.
        FullyShardedDataParallelImpl* nested = model->fsdp_units().at(1);
        FS_RETURN_IF_ERROR(ExpectError(
            [&] { nested->register_local_grad_hook([](const std::vector<LocalGradSqr>&) {}); },
            {"register_local_grad_hook is for the root unit"}));
        // An exception from the hook leaves backward.
        model->remove_local_grad_hook();
        model->register_local_grad_hook([](const std::vector<LocalGradSqr>&) {
          TORCH_CHECK(false, "hook refused");
        });
        testing::Batch b = testing::GlobalBatch(0);
        return ExpectError([&] { testing::Mse(model(b.x), b.y).backward(); }, {"hook refused"});
      }));
}

}  // namespace
}  // namespace fairscale::fsdp
