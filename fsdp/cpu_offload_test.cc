// move_params_to_cpu / move_grads_to_cpu / compute_device (FsdpOptions, FairScale's CPU
// offload). On a CPU-only machine:
// * bad combinations are errors naming the options;
// * with the compute device on the CPU the options take no copy path (an unsharded unit's
//   parameters still view its shard: no second buffer) and the model trains like the
//   single-process reference (losses, gradient and parameter shards within 1e-5; worlds 1-4,
//   every strategy, nested);
// * the offloaded path itself (separate compute buffers, copies to the compute device before
//   each all-gather, reduced gradients copied back to the CPU shard) is forced with
//   internal::SetOffloadOnCpuForTesting; each run checks that it was taken (an unsharded unit's
//   parameters no longer view its shard) and gives bitwise the results of the run without
//   offload (f32, bucketed), or of the un-offloaded bf16 run under mixed precision.
// The CudaOffload tests need LibTorch with CUDA and a GPU; without one they are skipped (see
// fsdp/README.md for the command).
#include <ATen/ops/equal.h>
#include <torch/cuda.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/testing/inproc_ranks.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/internal/flat_param.h"
#include "fsdp/test_util.h"
#include "fsdp/testing/checkpoint_helpers.h"
#include "gtest/gtest.h"

namespace fairscale::fsdp {
namespace {

using testing::Check;
using testing::ExpectAllOk;
using testing::ExpectError;
using testing::OptimizerKind;

constexpr int kSteps = 3;
constexpr ShardingStrategy kStrategies[] = {
    ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard,
    ShardingStrategy::kHybridShard};

// `base` with `strategy`; HYBRID_SHARD in groups of 2 at even world sizes (by host, one group,
// at odd ones).
FsdpOptions WithStrategy(FsdpOptions base, ShardingStrategy strategy, int world) {
  base.sharding_strategy(strategy);
  if (strategy == ShardingStrategy::kHybridShard && world % 2 == 0) {
    base.hybrid_shard_group_size(2);
  }
  return base;
}

// Losses and, per step, every flat parameter's shard and gradient.
struct Trace {
  std::vector<at::Tensor> tensors;
};

// Whether the parameters of the model's unsharded units view its flat shards (the same memory,
// as without offload) or none of them does (separate compute buffers: the offloaded path, or
// mixed precision); kInternal naming the first parameter that breaks `expect_views`, or saying
// that no unit was unsharded. Sharded units have nothing to show: their parameters view the
// gathered full buffer on either path.
absl::Status CheckComputeBuffers(FullyShardedDataParallel& model, bool expect_views,
                                 const std::string& what) {
  const std::vector<at::Tensor> shards = model->parameters();
  int checked = 0;
  for (FullyShardedDataParallelImpl* u : model->fsdp_units()) {
    if (u->shard_world_size() > 1 &&
        u->options().sharding_strategy() != ShardingStrategy::kNoShard) {
      continue;
    }
    for (const auto& item : u->module()->named_parameters()) {
      if (item.key().find("flat_param") != std::string::npos) continue;
      bool views = false;
      for (const at::Tensor& shard : shards) views = views || item.value().is_alias_of(shard);
      FS_RETURN_IF_ERROR(
          Check(views == expect_views,
                absl::StrCat(what, ": parameter '", item.key(), "' of unit '", u->prefix(),
                             views ? "' views" : "' does not view", " its shard")));
      ++checked;
    }
  }
  return Check(checked > 0, what + ": no unsharded unit to check");
}

bool Unsharded(const FsdpOptions& opts, int world) {
  return world == 1 || opts.sharding_strategy() == ShardingStrategy::kNoShard;
}

// With `expect_views` set (and an unsharded model), first checks CheckComputeBuffers.
Trace Train(std::shared_ptr<comm::Communicator> comm, const FsdpOptions& opts, bool nested,
            int rank, int world, bool expect_views, absl::Status* buffers) {
  FullyShardedDataParallel model(testing::NestedNet(nested ? comm : nullptr, opts), comm, opts);
  if (Unsharded(opts, world)) {
    *buffers = CheckComputeBuffers(model, expect_views, "compute buffers");
  }
  auto opt = testing::MakeOptimizer(OptimizerKind::kAdam, model->parameters());
  Trace t;
  for (int step = 0; step < kSteps; ++step) {
    opt->zero_grad();
    testing::Batch b = testing::GlobalBatch(step);
    at::Tensor loss = testing::Mse(model(testing::RankRows(b.x, rank, world)),
                                   testing::RankRows(b.y, rank, world));
    loss.backward();
    opt->step();
    t.tensors.push_back(loss.detach().to(at::kFloat));
    for (const at::Tensor& p : model->parameters()) {
      t.tensors.push_back(p.detach().clone());
      t.tensors.push_back(p.grad().defined() ? p.grad().clone() : at::zeros_like(p));
    }
  }
  {
    // summon_full_params(writeback) reaches the master copy, also through a separate buffer.
    auto guard = model->summon_full_params(/*writeback=*/!opts.mixed_precision().param_dtype());
    // Every unit's own parameters (a wrapped module also lists its nested units' shards,
    // which summon_full_params does not expose for writing).
    for (FullyShardedDataParallelImpl* u : model->fsdp_units()) {
      for (const auto& item : u->module()->named_parameters()) {
        if (item.key().find("flat_param") == std::string::npos) item.value().detach().mul_(0.5);
      }
    }
  }
  for (const at::Tensor& p : model->parameters()) t.tensors.push_back(p.detach().clone());
  return t;
}

absl::Status SameTrace(const Trace& a, const Trace& b, const std::string& what) {
  FS_RETURN_IF_ERROR(Check(a.tensors.size() == b.tensors.size(), what + ": sizes differ"));
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    FS_RETURN_IF_ERROR(Check(a.tensors[i].device() == b.tensors[i].device() &&
                                 at::equal(a.tensors[i], b.tensors[i]),
                             absl::StrCat(what, ": tensor #", i, " differs")));
  }
  return absl::OkStatus();
}

// With the offloaded path forced: runs Train with `base` and with `base` + move_params_to_cpu at
// worlds 1-4 for every strategy, flat and nested, and expects bitwise the same trace; where the
// model is unsharded, also that the offloaded run used separate compute buffers (and the plain
// f32 run did not), i.e. that the comparison is between two paths.
void ExpectCopyPathChangesNothing(const std::string& what, FsdpOptions base) {
  ASSERT_TRUE(internal::OffloadOnCpuForTesting());
  const bool mixed = base.mixed_precision().param_dtype().has_value();
  for (ShardingStrategy strategy : kStrategies) {
    for (bool nested : {false, true}) {
      for (int world = 1; world <= 4; ++world) {
        ExpectAllOk(
            comm::testing::RunInprocRanks(
                world,
                [&](int rank, int w, std::shared_ptr<comm::Communicator> c) -> absl::Status {
                  const FsdpOptions plain = WithStrategy(base, strategy, w);
                  FsdpOptions offload = plain;
                  offload.move_params_to_cpu(true).compute_device(c10::Device(c10::kCPU));
                  absl::Status plain_buffers, offload_buffers;
                  const Trace a = Train(c, plain, nested, rank, w, !mixed, &plain_buffers);
                  const Trace b = Train(c, offload, nested, rank, w, false, &offload_buffers);
                  FS_RETURN_IF_ERROR(plain_buffers);
                  FS_RETURN_IF_ERROR(offload_buffers);
                  return SameTrace(a, b, "offloaded vs not");
                }),
            absl::StrCat(what, " ", ShardingStrategyName(strategy), nested ? " nested" : " flat",
                         " world ", world));
      }
    }
  }
}

TEST(CpuOffload, BadCombinationsAreNamedErrors) {
  ExpectAllOk(
      comm::testing::RunInprocRanks(
          1,
          [](int, int, std::shared_ptr<comm::Communicator> c) -> absl::Status {
            auto make = [c](FsdpOptions opts) {
              return [c, opts] { FullyShardedDataParallel m(testing::Net(), c, opts); };
            };
            FS_RETURN_IF_ERROR(ExpectError(make(FsdpOptions().move_grads_to_cpu(true)),
                                           {"move_grads_to_cpu(1) with move_params_to_cpu(0)"}));
            FS_RETURN_IF_ERROR(
                ExpectError(make(FsdpOptions().move_params_to_cpu(true).move_grads_to_cpu(false)),
                            {"move_grads_to_cpu(0) with move_params_to_cpu(1)"}));
            if (!at::hasCUDA()) {
              FS_RETURN_IF_ERROR(ExpectError(
                  make(FsdpOptions().move_params_to_cpu(true).compute_device(
                      c10::Device(c10::kCUDA, 0))),
                  {"compute_device cuda:0 is not available"}));
            }
            // Consistent values are accepted.
            FullyShardedDataParallel ok(
                testing::Net(), c,
                FsdpOptions().move_params_to_cpu(true).move_grads_to_cpu(true));
            return absl::OkStatus();
          }),
      "bad options");
}

// Without the test hook the CPU compute device takes no copy path: the unsharded units'
// parameters view their shards as without the options, and every strategy trains like the
// single-process reference.
TEST(CpuOffload, OnTheCpuTheOptionsTakeNoCopyPathAndTrainLikeTheReference) {
  ASSERT_FALSE(internal::OffloadOnCpuForTesting());
  const auto ref = testing::RunReference(OptimizerKind::kAdam, kSteps);
  for (ShardingStrategy strategy : kStrategies) {
    for (bool nested : {false, true}) {
      for (int world = 1; world <= 4; ++world) {
        ExpectAllOk(
            comm::testing::RunInprocRanks(
                world,
                [&](int rank, int w, std::shared_ptr<comm::Communicator> c) -> absl::Status {
                  const FsdpOptions opts = WithStrategy(
                      FsdpOptions().move_params_to_cpu(true).compute_device(c10::Device(c10::kCPU)),
                      strategy, w);
                  FullyShardedDataParallel model(testing::NestedNet(nested ? c : nullptr, opts), c,
                                                 opts);
                  if (Unsharded(opts, w)) {
                    FS_RETURN_IF_ERROR(CheckComputeBuffers(model, true, "compute buffers"));
                  }
                  auto opt = testing::MakeOptimizer(OptimizerKind::kAdam, model->parameters());
                  return testing::TrainMatchesReference(model, *opt, ref, rank, w);
                }),
            absl::StrCat(ShardingStrategyName(strategy), nested ? " nested" : " flat", " world ",
                         world));
      }
    }
  }
}

// Restores the hook when the test ends.
struct ForceOffloadPath {
  ForceOffloadPath() { internal::SetOffloadOnCpuForTesting(true); }
  ~ForceOffloadPath() { internal::SetOffloadOnCpuForTesting(false); }
};

TEST(CpuOffload, TheCopyPathGivesBitwiseTheSameResults) {
  ForceOffloadPath force;
  ExpectCopyPathChangesNothing("forced copy path f32", FsdpOptions());
  ExpectCopyPathChangesNothing(
      "forced copy path bf16",
      FsdpOptions().mixed_precision(MixedPrecision().param_dtype(at::kBFloat16)));
  ExpectCopyPathChangesNothing("forced copy path bucketed", FsdpOptions().bucket_cap_mb(1.0));
  // The per-parameter layout has no offloaded path (yet): a clear error.
  ExpectAllOk(comm::testing::RunInprocRanks(
                  1,
                  [](int, int, std::shared_ptr<comm::Communicator> c) -> absl::Status {
                    return ExpectError(
                        [c] {
                          FullyShardedDataParallel m(
                              testing::Net(), c,
                              FsdpOptions().flatten_parameters(false).move_params_to_cpu(true));
                        },
                        {"implemented for the flat layout only"});
                  }),
              "per-parameter layout");
  // The hook really separates the compute buffer: an unsharded unit's parameters no longer
  // view its shard.
  ExpectAllOk(comm::testing::RunInprocRanks(
                  1,
                  [](int, int, std::shared_ptr<comm::Communicator> c) -> absl::Status {
                    FullyShardedDataParallel m(testing::Net(), c,
                                               FsdpOptions().move_params_to_cpu(true));
                    const at::Tensor shard = m->parameters()[0];
                    for (const at::Tensor& p : m->module()->parameters()) {
                      FS_RETURN_IF_ERROR(Check(!p.is_alias_of(shard), "parameter views the shard"));
                    }
                    return absl::OkStatus();
                  }),
              "separate buffers");
}

// GPU only (skipped without CUDA): world size 1 (one GPU), the model on the GPU or on the CPU
// with compute_device cuda:0; shards and gradients stay in pinned CPU memory; Adam steps them
// there; the losses and parameters follow the plain GPU model within 1e-5.
TEST(CudaOffload, ShardsOnCpuComputeOnGpuMatchesThePlainGpuModel) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs LibTorch with CUDA and a GPU";
  const c10::Device gpu(c10::kCUDA, 0);
  for (bool params_on_gpu : {true, false}) {
    ExpectAllOk(
        comm::testing::RunInprocRanks(
            1,
            [&](int, int, std::shared_ptr<comm::Communicator> c) -> absl::Status {
              testing::Net plain_net;
              plain_net->to(gpu);
              auto plain_opt = testing::MakeOptimizer(OptimizerKind::kAdam,
                                                      testing::DistinctParameters(*plain_net));
              testing::Net net;
              if (params_on_gpu) net->to(gpu);
              FullyShardedDataParallel model(
                  net, c, FsdpOptions().move_params_to_cpu(true).compute_device(gpu));
              auto opt = testing::MakeOptimizer(OptimizerKind::kAdam, model->parameters());
              for (const at::Tensor& p : model->parameters()) {
                FS_RETURN_IF_ERROR(Check(p.device().is_cpu() && p.is_pinned(), "shard not pinned CPU"));
              }
              for (int step = 0; step < kSteps; ++step) {
                testing::Batch b = testing::GlobalBatch(step);
                plain_opt->zero_grad();
                at::Tensor want = testing::Mse(plain_net(b.x.to(gpu)), b.y.to(gpu));
                want.backward();
                plain_opt->step();
                opt->zero_grad();
                at::Tensor got = testing::Mse(model(b.x.to(gpu)), b.y.to(gpu));
                got.backward();
                for (const at::Tensor& p : model->parameters()) {
                  FS_RETURN_IF_ERROR(Check(p.grad().device().is_cpu(), "gradient not on the CPU"));
                }
                opt->step();
                FS_RETURN_IF_ERROR(testing::ExpectClose(absl::StrCat("loss ", step), got.cpu(),
                                                        want.cpu(), 1e-5));
              }
              std::map<std::string, at::Tensor> expected;
              for (const auto& item : plain_net->named_parameters()) {
                expected[item.key()] = item.value().detach().cpu();
              }
              return testing::CheckShards(model, expected, false, "params", 1e-5);
            }),
        params_on_gpu ? "params on the GPU" : "params on the CPU");
  }
}

}  // namespace
}  // namespace fairscale::fsdp
