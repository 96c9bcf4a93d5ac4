// AdaScaleSdp: AdaScale over oss::ShardedDataParallel against the single-process simulation of
// N workers (test_util.h), in the user's usual loop: the step's earlier backward passes under
// no_sync() while ada.is_accumulation_step(), the last one synchronised (it reduces each
// gradient to its owner and frees the rest), then ada.step(). World 1 (c = 2) and 2-4 ranks,
// c = 1 and 2, kGreedy and kFlat (parameters split between ranks), SGD with momentum and Adam,
// two param groups; and the route with every backward under no_sync() and sdp->reduce().
// Parameters, per-group and overall gains and progress within 1e-6 at every step. Then the
// inputs and misuse the adapter refuses.
#include "adascale/sdp_adapter.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "adascale/test_util.h"
#include "base/status_macros.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "testing/c10_error.h"

namespace fairscale::adascale {
namespace {

using comm::testing::ExpectAllOk;
using comm::testing::RunInprocRanks;
using fairscale::testing::CatchErrors;
using fairscale::testing::ExpectError;
using testing::Kind;

std::shared_ptr<oss::OSS> MakeOss(Kind kind, testing::PlainLinear& net,
                                  std::shared_ptr<comm::Communicator> comm,
                                  oss::PartitionMode mode, bool deterministic = false) {
  return std::make_shared<oss::OSS>(
      testing::MakeGroups(kind, {{net->w}, {net->b}}),
      [kind](std::vector<torch::optim::OptimizerParamGroup> g) {
        return testing::MakeInner(kind, std::move(g));
      },
      comm, oss::OssOptions().partition(mode).deterministic(deterministic));
}

at::Tensor Loss(oss::ShardedDataParallel& sdp, int step, int rank, int micro) {
  const testing::Batch d = testing::Data(step, rank, micro);
  return torch::mse_loss(sdp->forward(d.x), d.y);
}

struct SdpCase {
  Kind kind;
  int world;
  int accum;
  oss::PartitionMode mode;
  bool reduce_route = false;  // every backward under no_sync(), then sdp->reduce()
};

class AdaScaleSdpAdapterTest : public ::testing::TestWithParam<SdpCase> {};

TEST_P(AdaScaleSdpAdapterTest, MatchesSimulation) {
  const SdpCase c = GetParam();
  constexpr int kSteps = 5;
  const double smoothing = c.kind == Kind::kSgd ? 1.0 - c.world * c.accum / 1000.0 : 0.5;
  const std::vector<testing::StepRecord> ref =
      testing::Simulate(c.kind, c.world, c.accum, smoothing, kSteps);
  std::vector<double> max_err(c.world, 0.0);
  ExpectAllOk(RunInprocRanks(
      c.world, [&](int rank, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        return CatchErrors([&]() -> absl::Status {
          testing::PlainLinear net;
          auto opt = MakeOss(c.kind, net, comm, c.mode);
          oss::ShardedDataParallel sdp(torch::nn::AnyModule(net), opt,
                                       oss::ShardedDataParallelOptions().reduce_bucket_numel(8));
          AdaScaleOptions options = AdaScaleSdp::options_for(
              sdp, AdaScaleOptions().num_gradients_to_accumulate(c.accum));
          if (c.kind == Kind::kAdam) options.smoothing(smoothing);
          AdaScale ada(*opt, comm, options);
          AdaScaleSdp adapter(sdp, ada);
          for (int step = 0; step < kSteps; ++step) {
            ada.zero_grad();
            for (int micro = 0; micro < c.accum; ++micro) {
              if (ada.is_accumulation_step() || c.reduce_route) {
                auto no_sync = sdp->no_sync();
                Loss(sdp, step, rank, micro).backward();
              } else {
                Loss(sdp, step, rank, micro).backward();
              }
            }
            if (c.reduce_route) sdp->reduce();
            ada.step();
            FS_RETURN_IF_ERROR(testing::CompareStep(
                absl::StrCat("rank ", rank, " step ", step), net->w, net->b, ada, ref[step], 1e-6,
                &max_err[rank]));
          }
          return absl::OkStatus();
        });
      }));
  const double worst = *std::max_element(max_err.begin(), max_err.end());
  std::cout << "[measured] AdaScaleSdp "
            << (c.mode == oss::PartitionMode::kFlat ? "kFlat" : "kGreedy") << ", world "
            << c.world << " accum " << c.accum << " " << testing::KindName(c.kind)
            << (c.reduce_route ? " (no_sync + reduce)" : "") << ": max |error| " << worst
            << "; final gain " << ref.back().gain << "\n";
  EXPECT_GT(ref.back().gain, 1.0 + 1e-3);
}

INSTANTIATE_TEST_SUITE_P(
    Sdp, AdaScaleSdpAdapterTest,
    ::testing::Values(SdpCase{Kind::kSgd, 1, 2, oss::PartitionMode::kGreedy},
                      SdpCase{Kind::kAdam, 1, 2, oss::PartitionMode::kFlat},
                      SdpCase{Kind::kSgd, 2, 1, oss::PartitionMode::kGreedy},
                      SdpCase{Kind::kAdam, 2, 1, oss::PartitionMode::kFlat},
                      SdpCase{Kind::kSgd, 2, 2, oss::PartitionMode::kFlat},
                      SdpCase{Kind::kAdam, 2, 2, oss::PartitionMode::kGreedy},
                      SdpCase{Kind::kSgd, 3, 1, oss::PartitionMode::kFlat},
                      SdpCase{Kind::kAdam, 3, 2, oss::PartitionMode::kFlat},
                      SdpCase{Kind::kSgd, 3, 2, oss::PartitionMode::kGreedy},
                      SdpCase{Kind::kAdam, 4, 1, oss::PartitionMode::kGreedy},
                      SdpCase{Kind::kSgd, 4, 2, oss::PartitionMode::kFlat},
                      SdpCase{Kind::kAdam, 4, 2, oss::PartitionMode::kFlat},
                      SdpCase{Kind::kSgd, 3, 2, oss::PartitionMode::kFlat, true}),
    [](const ::testing::TestParamInfo<SdpCase>& info) {
      return absl::StrCat(testing::KindName(info.param.kind), "World", info.param.world, "Accum",
                          info.param.accum,
                          info.param.mode == oss::PartitionMode::kFlat ? "Flat" : "Greedy",
                          info.param.reduce_route ? "NoSyncReduce" : "");
    });

// Each misuse raises a c10::Error naming who refused and why.
TEST(AdaScaleSdpAdapterTest, BadInput) {
  ExpectAllOk(RunInprocRanks(
      2, [&](int rank, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        return CatchErrors([&]() -> absl::Status {
          testing::PlainLinear net;
          auto opt = MakeOss(Kind::kSgd, net, comm, oss::PartitionMode::kFlat);
          oss::ShardedDataParallel sdp(torch::nn::AnyModule(net), opt);
          {
            AdaScale ada(*opt, comm);  // sharded_gradients(false)
            FS_RETURN_IF_ERROR(ExpectError([&] { AdaScaleSdp adapter(sdp, ada); },
                                           {"adascale::AdaScaleSdp rank", "/2",
                                            "sharded_gradients(true)"}));
          }
          {
            AdaScale ada(*opt, comm, AdaScaleSdp::options_for(sdp).gradient_replicas(2));
            FS_RETURN_IF_ERROR(ExpectError([&] { AdaScaleSdp adapter(sdp, ada); },
                                           {"AdaScaleSdp", "gradient_replicas is 2"}));
          }
          {
            auto other = testing::MakeInner(Kind::kSgd,
                                            testing::MakeGroups(Kind::kSgd, {{net->w}, {net->b}}));
            AdaScale ada(*other, comm, AdaScaleSdp::options_for(sdp));
            FS_RETURN_IF_ERROR(ExpectError([&] { AdaScaleSdp adapter(sdp, ada); },
                                           {"AdaScaleSdp", "does not wrap the model's oss::OSS"}));
          }
          AdaScale ada(*opt, comm, AdaScaleSdp::options_for(sdp));
          AdaScaleSdp adapter(sdp, ada);
          FS_RETURN_IF_ERROR(ExpectError([&] { AdaScaleSdp second(sdp, ada); },
                                         {"AdaScaleSdp", "local gradient hook already"}));
          // The old manual call with the adapter attached: refused, not counted twice.
          ada.zero_grad();
          Loss(sdp, 0, rank, 0).backward();
          FS_RETURN_IF_ERROR(ExpectError(
              [&] { ada.accumulate_local_gradients(); },
              {"adascale::AdaScale::accumulate_local_gradients rank", "FAILED_PRECONDITION",
               "one source", "do not call accumulate_local_gradients()"}));
          // One backward too many (c = 1): raised out of backward() by the hook.
          FS_RETURN_IF_ERROR(ExpectError([&] { Loss(sdp, 0, rank, 1).backward(); },
                                         {"accumulate_local_grad_sqr", "already 1 backward"}));
          return absl::OkStatus();
        });
      }));
}

TEST(AdaScaleSdpAdapterTest, RefusesDeterministicMode) {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  ExpectAllOk(RunInprocRanks(
      2, [&](int, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        return CatchErrors([&]() -> absl::Status {
          testing::PlainLinear net;
          auto opt = MakeOss(Kind::kSgd, net, comm, oss::PartitionMode::kGreedy, true);
          oss::ShardedDataParallel sdp(
              torch::nn::AnyModule(net), opt,
              oss::ShardedDataParallelOptions().deterministic(true).micro_batches(2));
          AdaScale ada(*opt, comm, AdaScaleSdp::options_for(sdp));
          return ExpectError([&] { AdaScaleSdp adapter(sdp, ada); },
                             {"adascale::AdaScaleSdp rank", "deterministic mode",
                              "not supported"});
        });
      }));
  at::set_num_threads(threads);
}

}  // namespace
}  // namespace fairscale::adascale
