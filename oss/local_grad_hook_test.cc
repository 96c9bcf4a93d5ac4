// ShardedDataParallelImpl::register_local_grad_hook against plain autograd gradients: at 1-3
// ranks, kGreedy and kFlat (parameters split between ranks), small buckets, a parameter no
// forward uses, backward passes under no_sync() and synchronised ones without zero_grad in
// between, and deterministic mode. Each report must list every trainable parameter in
// OSS::shards() order once per backward, with that backward's local squared norm (1e-9
// relative; AdaScale's SDP test checks the reductions with a hook end to end). Then the hook's
// bad input.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "oss/sharded_data_parallel.h"
#include "testing/c10_error.h"
#include "testing/model.h"

namespace fairscale::oss {
namespace {

using comm::testing::ExpectAllOk;
using comm::testing::RunInprocRanks;
using fairscale::testing::CatchErrors;
using fairscale::testing::ExpectError;
using fairscale::testing::GlobalBatch;
using fairscale::testing::Mse;
using fairscale::testing::Net;
using fairscale::testing::NetConfig;
using fairscale::testing::RankRows;

OptimizerFactory Sgd() {
  return [](std::vector<torch::optim::OptimizerParamGroup> groups) {
    return std::make_unique<torch::optim::SGD>(std::move(groups), torch::optim::SGDOptions(0.1));
  };
}

// Backward `b` of rank `rank`: its rows of global batch b.
at::Tensor Loss(torch::nn::Module& net, const std::function<at::Tensor(at::Tensor)>& forward,
                int b, int rank, int world) {
  const fairscale::testing::Batch batch = GlobalBatch(b);
  return Mse(forward(RankRows(batch.x, rank, world)), RankRows(batch.y, rank, world));
}

// Per parameter name: |grad|^2 of a plain Net's loss of backward `b` on `rank`.
std::map<std::string, double> Reference(int b, int rank, int world) {
  Net net(NetConfig{.with_unused = true});
  Loss(*net, [&](at::Tensor x) { return net->forward(x); }, b, rank, world).backward();
  std::map<std::string, double> out;
  for (const auto& item : net->named_parameters()) {
    const at::Tensor& g = item.value().grad();
    out[item.key()] = g.defined() ? g.to(at::kDouble).pow(2).sum().item<double>() : 0.0;
  }
  return out;
}

struct HookCase {
  int world;
  PartitionMode mode;
  bool deterministic = false;
};

class SdpLocalGradHookTest : public ::testing::TestWithParam<HookCase> {};

TEST_P(SdpLocalGradHookTest, MatchesAutogradGradients) {
  const HookCase c = GetParam();
  const int threads = at::get_num_threads();
  if (c.deterministic) at::set_num_threads(1);
  constexpr int kBackwards = 4;  // no_sync, sync, sync (no zero_grad), sync after zero_grad
  double worst = 0;
  std::vector<double> max_err(c.world, 0.0);
  ExpectAllOk(RunInprocRanks(
      c.world, [&](int rank, int world, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        return CatchErrors([&]() -> absl::Status {
          Net net(NetConfig{.with_unused = true});
          auto opt = std::make_shared<OSS>(
              fairscale::testing::DistinctParameters(*net), Sgd(), comm,
              OssOptions().partition(c.mode).deterministic(c.deterministic));
          ShardedDataParallel sdp(torch::nn::AnyModule(net), opt,
                                  ShardedDataParallelOptions()
                                      .reduce_bucket_numel(40)
                                      .deterministic(c.deterministic)
                                      .micro_batches(c.deterministic ? world : 0));
          std::map<const void*, std::string> name_of;
          for (const auto& item : net->named_parameters()) {
            name_of[item.value().unsafeGetTensorImpl()] = item.key();
          }
          std::vector<std::vector<LocalGradSqr>> reports;
          sdp->register_local_grad_hook(
              [&](const std::vector<LocalGradSqr>& r) { reports.push_back(r); });
          auto forward = [&](at::Tensor x) { return sdp->forward(x); };
          for (int b = 0; b < kBackwards; ++b) {
            if (b == 3) opt->zero_grad();
            if (b == 0 && !c.deterministic) {
              auto no_sync = sdp->no_sync();
              Loss(*net, forward, b, rank, world).backward();
            } else {
              Loss(*net, forward, b, rank, world).backward();
            }
            if (reports.size() != static_cast<size_t>(b + 1)) {
              return absl::InternalError(absl::StrCat("backward ", b, ": ", reports.size(),
                                                      " reports, want ", b + 1));
            }
            // One entry per distinct trainable parameter, in shards() order.
            std::vector<const void*> want_order;
            std::set<const void*> seen;
            for (const ParamShard& s : opt->shards()) {
              if (seen.insert(s.param.unsafeGetTensorImpl()).second) {
                want_order.push_back(s.param.unsafeGetTensorImpl());
              }
            }
            const std::vector<LocalGradSqr>& r = reports.back();
            if (r.size() != want_order.size()) {
              return absl::InternalError(absl::StrCat("backward ", b, ": ", r.size(),
                                                      " entries, want ", want_order.size()));
            }
            const std::map<std::string, double> ref = Reference(b, rank, world);
            for (size_t i = 0; i < r.size(); ++i) {
              const std::string& name = name_of.at(r[i].param.unsafeGetTensorImpl());
              if (r[i].param.unsafeGetTensorImpl() != want_order[i]) {
                return absl::InternalError(absl::StrCat("entry ", i, " (", name, ") out of order"));
              }
              const double want = ref.at(name);
              const double err = std::abs(r[i].sum_sqr - want) / std::max(want, 1e-30);
              max_err[rank] = std::max(max_err[rank], want == 0 ? r[i].sum_sqr : err);
              if (!(err <= 1e-9) && !(want == 0 && r[i].sum_sqr == 0)) {
                return absl::InternalError(absl::StrCat("rank ", rank, " backward ", b, " '",
                                                        name, "': reported ", r[i].sum_sqr,
                                                        ", autograd ", want));
              }
              if (name.rfind("unused", 0) == 0 && r[i].sum_sqr != 0) {
                return absl::InternalError("the unused parameter reported a square");
              }
            }
          }
          sdp->remove_local_grad_hook();
          Loss(*net, forward, 0, rank, world).backward();
          if (c.deterministic) opt->zero_grad();
          if (reports.size() != kBackwards) {
            return absl::InternalError("a removed hook was called");
          }
          return absl::OkStatus();
        });
      }));
  at::set_num_threads(threads);
  for (double e : max_err) worst = std::max(worst, e);
  std::cout << "[measured] SDP local grad hook, world " << c.world
            << (c.mode == PartitionMode::kFlat ? " kFlat" : " kGreedy")
            << (c.deterministic ? " deterministic" : "") << ": max relative error " << worst
            << "\n";
}

INSTANTIATE_TEST_SUITE_P(
    Hook, SdpLocalGradHookTest,
    ::testing::Values(HookCase{1, PartitionMode::kGreedy}, HookCase{2, PartitionMode::kGreedy},
                      HookCase{2, PartitionMode::kFlat}, HookCase{3, PartitionMode::kFlat},
                      HookCase{3, PartitionMode::kGreedy},
                      HookCase{2, PartitionMode::kGreedy, true}),
    [](const ::testing::TestParamInfo<HookCase>& info) {
      return absl::StrCat("World", info.param.world,
                          info.param.mode == PartitionMode::kFlat ? "Flat" : "Greedy",
                          info.param.deterministic ? "Deterministic" : "");
    });

TEST(SdpLocalGradHookTest, BadInput) {
  ExpectAllOk(RunInprocRanks(
      2, [&](int, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        return CatchErrors([&]() -> absl::Status {
          Net net;
          auto opt = std::make_shared<OSS>(fairscale::testing::DistinctParameters(*net), Sgd(),
                                           comm);
          ShardedDataParallel sdp(torch::nn::AnyModule(net), opt);
          FS_RETURN_IF_ERROR(ExpectError([&] { sdp->register_local_grad_hook(nullptr); },
                                         {"register_local_grad_hook", "the hook is empty"}));
          sdp->register_local_grad_hook([](const std::vector<LocalGradSqr>&) {});
          FS_RETURN_IF_ERROR(ExpectError(
              [&] { sdp->register_local_grad_hook([](const std::vector<LocalGradSqr>&) {}); },
              {"oss::ShardedDataParallel::register_local_grad_hook rank", "registered already"}));
          // A hook that raises: the error comes out of backward().
          sdp->remove_local_grad_hook();
          sdp->register_local_grad_hook([](const std::vector<LocalGradSqr>&) {
            TORCH_CHECK(false, "observer refused");
          });
          FS_RETURN_IF_ERROR(ExpectError(
              [&] {
                Loss(*net, [&](at::Tensor x) { return sdp->forward(x); }, 0, 0, 2).backward();
              },
              {"observer refused"}));
          return absl::OkStatus();
        });
      }));
}

}  // namespace
}  // namespace fairscale::oss
