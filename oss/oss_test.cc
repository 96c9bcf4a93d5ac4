// OSS against the unsharded optimizer on a single-process reference: parity over 10 steps at 1-4
// ranks for every elementwise LibTorch optimizer, both partition modes, two param groups and an LR
// schedule; exact optimizer-state accounting; clip_grad_norm; state dicts across world sizes.
#include "oss/oss.h"

#include <ATen/ops/full_like.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/types.h>  // clip_grad.h uses torch::stack, torch::max ... without including them
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "oss/test_util.h"
#include "testing/c10_error.h"
#include "testing/model.h"

namespace fairscale::oss {
namespace {

using comm::Communicator;
using comm::testing::ExpectAllOk;
using comm::testing::RunInprocRanks;
using fairscale::testing::GlobalBatch;
using fairscale::testing::Mse;
using fairscale::testing::RankRows;
using testing::AllReduceGrads;
using testing::ExpectParams;
using testing::Factory;
using testing::Kind;
using testing::ModeName;
using testing::Net;
using testing::TwoGroups;

constexpr double kTol = 1e-6;

// Forward and backward of this rank's rows, then the DDP-style mean of the gradients.
absl::Status LocalBackward(Net& net, int step, int rank, int world, comm::Communicator& comm) {
  fairscale::testing::Batch b = GlobalBatch(step);
  Mse(net(RankRows(b.x, rank, world)), RankRows(b.y, rank, world)).backward();
  return AllReduceGrads(net, comm);
}

using ParityParam = std::tuple<Kind, PartitionMode, int>;

class OssParityTest : public ::testing::TestWithParam<ParityParam> {};

TEST_P(OssParityTest, MatchesUnshardedOptimizerWithGroupsAndSchedule) {
  const auto [kind, mode, world] = GetParam();
  const testing::Trajectory ref = testing::RunReference(kind, 0, 10, /*schedule=*/true);
  ExpectAllOk(RunInprocRanks(world, [&, kind = kind, mode = mode](
                                  int rank, int world, std::shared_ptr<comm::Communicator> comm)
                                  -> absl::Status {
    Net net;
    OSS opt(TwoGroups(net, kind), Factory(kind), comm, OssOptions().partition(mode));
    torch::optim::StepLR sched(opt, 3, 0.5);
    for (int step = 0; step < 10; ++step) {
      opt.zero_grad();
      absl::Status s = LocalBackward(net, step, rank, world, *comm);
      if (!s.ok()) return s;
      opt.step();
      sched.step();
      s = ExpectParams(absl::StrCat("step ", step, " rank ", rank), net, ref.params[step], kTol);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }));
}

INSTANTIATE_TEST_SUITE_P(
    All, OssParityTest,
    ::testing::Combine(::testing::ValuesIn(testing::kAllKinds),
                       ::testing::Values(PartitionMode::kGreedy, PartitionMode::kFlat),
                       ::testing::Values(1, 2, 3, 4)),
    [](const ::testing::TestParamInfo<ParityParam>& info) {
      return absl::StrCat(testing::KindName(std::get<0>(info.param)),
                          ModeName(std::get<1>(info.param)), std::get<2>(info.param));
    });

TEST(OssTest, MakeAndSmallBucketsMatchReference) {
  // One param group through OSS::make, one-element buckets: many broadcasts / all-gathers.
  for (PartitionMode mode : {PartitionMode::kGreedy, PartitionMode::kFlat}) {
    Net ref_net;
    torch::optim::Adam ref_opt(ref_net->parameters(), torch::optim::AdamOptions(0.01));
    std::vector<std::map<std::string, at::Tensor>> ref;
    for (int step = 0; step < 3; ++step) {
      ref_opt.zero_grad();
      fairscale::testing::Batch b = GlobalBatch(step);
      Mse(ref_net(b.x), b.y).backward();
      ref_opt.step();
      ref.push_back(testing::Snapshot(ref_net));
    }
    ExpectAllOk(RunInprocRanks(3, [&](int rank, int world, std::shared_ptr<comm::Communicator> comm)
                                -> absl::Status {
      Net net;
      auto opt = OSS::make<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(0.01),
                                               comm, OssOptions().partition(mode).bucket_numel(1));
      for (int step = 0; step < 3; ++step) {
        opt->zero_grad();
        absl::Status s = LocalBackward(net, step, rank, world, *comm);
        if (!s.ok()) return s;
        opt->step();
        s = ExpectParams(absl::StrCat(ModeName(mode), " step ", step), net, ref[step], kTol);
        if (!s.ok()) return s;
      }
      return absl::OkStatus();
    }));
  }
}

TEST(OssTest, Bf16BroadcastOwnerExactOthersRoundedOnce) {
  for (PartitionMode mode : {PartitionMode::kGreedy, PartitionMode::kFlat}) {
    const testing::Trajectory ref = testing::RunReference(Kind::kSgd, 0, 1, false);
    ExpectAllOk(RunInprocRanks(2, [&](int rank, int world, std::shared_ptr<comm::Communicator> comm)
                                -> absl::Status {
      Net net;
      OSS opt(TwoGroups(net, Kind::kSgd), Factory(Kind::kSgd), comm,
              OssOptions().partition(mode).broadcast_dtype(at::kBFloat16));
      absl::Status s = LocalBackward(net, 0, rank, world, *comm);
      if (!s.ok()) return s;
      opt.step();
      for (const ParamShard& shard : opt.shards()) {
        std::string name;
        for (const auto& item : net->named_parameters()) {
          if (item.value().is_same(shard.param)) name = item.key();
        }
        at::Tensor got = shard.param.detach().reshape({-1}).narrow(0, shard.offset, shard.numel);
        at::Tensor want = ref.params[0].at(name).reshape({-1}).narrow(0, shard.offset, shard.numel);
        const double diff = (got - want).abs().max().item<double>();
        // Owner: the f32 master. Others: bf16 rounding, at most half an ulp (2^-9 relative).
        const double tol =
            shard.rank == rank ? kTol : want.abs().max().item<double>() * std::ldexp(1.0, -8);
        if (!(diff <= tol)) {
          return absl::InternalError(absl::StrCat(ModeName(mode), " ", name, " owner ", shard.rank,
                                                  " rank ", rank, ": diff ", diff, " > ", tol));
        }
        if (shard.rank != rank && !at::equal(got, got.to(at::kBFloat16).to(at::kFloat))) {
          return absl::InternalError(absl::StrCat(name, ": not a bf16 value on rank ", rank));
        }
      }
      return absl::OkStatus();
    }));
  }
}

// Optimizer-state bytes per rank: the partition's share of the unsharded optimizer's, exactly.
TEST(OssTest, StateBytesPerRankAreTheShareOfThePartition) {
  Net ref_net;
  auto ref_opt = Factory(Kind::kAdam)(TwoGroups(ref_net, Kind::kAdam));
  int64_t total_numel = 0;
  for (const auto& p : ref_net->parameters()) total_numel += p.numel();
  const int64_t bytes_per_element = 2 * sizeof(float);  // exp_avg, exp_avg_sq
  for (PartitionMode mode : {PartitionMode::kGreedy, PartitionMode::kFlat}) {
    for (int world = 1; world <= 4; ++world) {
      std::vector<int64_t> bytes(world), owned(world);
      int64_t largest = 0, group_count = 0;
      ExpectAllOk(RunInprocRanks(world, [&](int rank, int world, std::shared_ptr<Communicator> comm)
                                      -> absl::Status {
        Net net;
        OSS opt(TwoGroups(net, Kind::kAdam), Factory(Kind::kAdam), comm,
                OssOptions().partition(mode));
        absl::Status s = LocalBackward(net, 0, rank, world, *comm);
        if (!s.ok()) return s;
        opt.step();
        bytes[rank] = opt.local_state_bytes();
        for (const ParamShard& shard : opt.shards()) {
          if (shard.rank == rank) owned[rank] += shard.numel;
          if (rank == 0) largest = std::max(largest, shard.param.numel());
        }
        if (rank == 0) group_count = static_cast<int64_t>(opt.param_groups().size());
        return absl::OkStatus();
      }));
      SCOPED_TRACE(absl::StrCat(ModeName(mode), " world ", world));
      EXPECT_EQ(std::accumulate(bytes.begin(), bytes.end(), int64_t{0}),
                bytes_per_element * total_numel);
      for (int r = 0; r < world; ++r) EXPECT_EQ(bytes[r], bytes_per_element * owned[r]);
      const int64_t lo = *std::min_element(owned.begin(), owned.end());
      const int64_t hi = *std::max_element(owned.begin(), owned.end());
      if (mode == PartitionMode::kFlat) {
        // Each group splits into ceil(T/N)-element ranges: ranks differ by the padding only.
        EXPECT_LE(hi - lo, group_count * (world - 1));
        EXPECT_LE(hi, (total_numel + world - 1) / world + group_count);
      } else {
        EXPECT_LE(hi, total_numel / world + largest);
      }
    }
  }
}

TEST(OssTest, FlatStateIsExactlyOneNthWhenDivisible) {
  // 2 groups of 12 elements: every rank of 1, 2, 3, 4 holds exactly 24/N elements of state.
  for (int world = 1; world <= 4; ++world) {
    std::vector<int64_t> bytes(world);
    ExpectAllOk(RunInprocRanks(world, [&](int rank, int world, std::shared_ptr<Communicator> comm)
                                    -> absl::Status {
      at::Tensor a = at::ones({3, 4}).requires_grad_();
      at::Tensor b = at::ones({5}).requires_grad_();
      at::Tensor c = at::ones({7}).requires_grad_();
      std::vector<torch::optim::OptimizerParamGroup> groups;
      groups.emplace_back(std::vector<at::Tensor>{a});
      groups.emplace_back(std::vector<at::Tensor>{b, c});
      auto opt = OSS::make<torch::optim::Adam>(groups, torch::optim::AdamOptions(0.1), comm,
                                               OssOptions().partition(PartitionMode::kFlat));
      for (const at::Tensor& t : {a, b, c}) t.mutable_grad() = at::full_like(t, 0.5);
      opt->step();
      bytes[rank] = opt->local_state_bytes();
      return absl::OkStatus();
    }));
    for (int r = 0; r < world; ++r) EXPECT_EQ(bytes[r], 2 * 4 * 24 / world) << world << " " << r;
  }
}

TEST(OssTest, ClipGradNormIsExactFromOwnedPartsOnly) {
  for (double norm_type : {2.0, 1.0, std::numeric_limits<double>::infinity()}) {
    for (PartitionMode mode : {PartitionMode::kGreedy, PartitionMode::kFlat}) {
      Net ref_net;
      fairscale::testing::Batch b = GlobalBatch(0);
      Mse(ref_net(b.x), b.y).backward();
      const double ref_norm =
          torch::nn::utils::clip_grad_norm_(ref_net->parameters(), 0.01, norm_type);
      std::map<std::string, at::Tensor> ref_grads;
      for (const auto& item : ref_net->named_parameters()) {
        ref_grads[item.key()] = item.value().grad().clone();
      }
      ExpectAllOk(RunInprocRanks(3, [&](int rank, int world, std::shared_ptr<Communicator> comm)
                                  -> absl::Status {
        Net net;
        OSS opt(TwoGroups(net, Kind::kSgd), Factory(Kind::kSgd), comm,
                OssOptions().partition(mode));
        absl::Status s = LocalBackward(net, 0, rank, world, *comm);
        if (!s.ok()) return s;
        // What other ranks own is garbage here (as with ShardedDataParallel): it must not count.
        for (const ParamShard& shard : opt.shards()) {
          if (shard.rank == rank) continue;
          shard.param.grad().view({-1}).narrow(0, shard.offset, shard.numel).fill_(1e3);
        }
        const double norm = opt.clip_grad_norm(0.01, norm_type);
        if (std::abs(norm - ref_norm) > 1e-6 * ref_norm) {
          return absl::InternalError(absl::StrCat("norm ", norm, " want ", ref_norm));
        }
        for (const ParamShard& shard : opt.shards()) {
          if (shard.rank != rank) continue;
          std::string name;
          for (const auto& item : net->named_parameters()) {
            if (item.value().is_same(shard.param)) name = item.key();
          }
          at::Tensor got = shard.param.grad().reshape({-1}).narrow(0, shard.offset, shard.numel);
          at::Tensor want = ref_grads.at(name).reshape({-1}).narrow(0, shard.offset, shard.numel);
          if ((got - want).abs().max().item<double>() > 1e-7) {
            return absl::InternalError(absl::StrCat(name, ": clipped gradient differs"));
          }
        }
        return absl::OkStatus();
      }));
    }
  }
}

// Trains 5 steps at 4 ranks, consolidates on `recipient`, saves; returns the archive's bytes and
// the parameters.
std::pair<std::string, std::map<std::string, at::Tensor>> TrainAndSave(Kind kind,
                                                                       PartitionMode mode,
                                                                       int recipient) {
  std::string bytes;
  std::map<std::string, at::Tensor> params;
  ExpectAllOk(RunInprocRanks(4, [&](int rank, int world, std::shared_ptr<comm::Communicator> comm)
                              -> absl::Status {
    Net net;
    OSS opt(TwoGroups(net, kind), Factory(kind), comm, OssOptions().partition(mode));
    for (int step = 0; step < 5; ++step) {
      opt.zero_grad();
      absl::Status s = LocalBackward(net, step, rank, world, *comm);
      if (!s.ok()) return s;
      opt.step();
    }
    opt.consolidate_state_dict(recipient);
    if (rank == recipient) {
      bytes = testing::SaveToBytes(opt);
      params = testing::Snapshot(net);
    } else {
      if (fairscale::testing::ErrorOf([&] { testing::SaveToBytes(opt); }).empty()) {
        return absl::InternalError("save on a non-recipient did not raise");
      }
    }
    return absl::OkStatus();
  }));
  return {bytes, params};
}

using StateDictParam = std::tuple<Kind, PartitionMode>;
class OssStateDictTest : public ::testing::TestWithParam<StateDictParam> {};

TEST_P(OssStateDictTest, SaveAtFourLoadAtOneTwoThreeAndPlainContinues) {
  const auto [kind, mode] = GetParam();
  const testing::Trajectory ref = testing::RunReference(kind, 0, 10, false);
  auto [bytes, params] = TrainAndSave(kind, mode, /*recipient=*/3);
  ASSERT_FALSE(bytes.empty());
  // The archive is the unsharded optimizer's: a plain LibTorch optimizer continues from it.
  const testing::Trajectory plain = testing::RunReference(kind, 5, 10, false, &params, &bytes);
  for (int s = 0; s < 5; ++s) {
    for (const auto& [name, value] : plain.params[s]) {
      EXPECT_LE((value - ref.params[5 + s].at(name)).abs().max().item<double>(), kTol)
          << "plain step " << 5 + s << " " << name;
    }
  }
  // Any world size, either partition mode, continues the same trajectory.
  for (int world : {1, 2, 3}) {
    for (PartitionMode load_mode : {PartitionMode::kGreedy, PartitionMode::kFlat}) {
      ExpectAllOk(RunInprocRanks(world, [&, kind = kind](int rank, int world,
                                                   std::shared_ptr<comm::Communicator> comm)
                                      -> absl::Status {
        Net net;
        testing::Restore(net, params);
        OSS opt(TwoGroups(net, kind), Factory(kind), comm, OssOptions().partition(load_mode));
        testing::LoadFromBytes(opt, bytes);
        for (int step = 5; step < 10; ++step) {
          opt.zero_grad();
          absl::Status s = LocalBackward(net, step, rank, world, *comm);
          if (!s.ok()) return s;
          opt.step();
          s = ExpectParams(absl::StrCat("world ", world, " ", ModeName(load_mode), " step ", step),
                           net, ref.params[step], kTol);
          if (!s.ok()) return s;
        }
        return absl::OkStatus();
      }));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, OssStateDictTest,
    ::testing::Combine(::testing::ValuesIn(testing::kAllKinds),
                       ::testing::Values(PartitionMode::kGreedy, PartitionMode::kFlat)),
    [](const ::testing::TestParamInfo<StateDictParam>& info) {
      return absl::StrCat(testing::KindName(std::get<0>(info.param)),
                          ModeName(std::get<1>(info.param)));
    });

TEST(OssTest, AddParamGroupIsPartitionedAndStepped) {
  for (PartitionMode mode : {PartitionMode::kGreedy, PartitionMode::kFlat}) {
    ExpectAllOk(RunInprocRanks(3, [&](int rank, int world, std::shared_ptr<comm::Communicator> comm)
                                -> absl::Status {
      at::Tensor a = at::ones({4}).requires_grad_();
      at::Tensor b = at::ones({6}).requires_grad_();
      auto opt = OSS::make<torch::optim::SGD>(std::vector<at::Tensor>{a},
                                              torch::optim::SGDOptions(0.1), comm,
                                              OssOptions().partition(mode));
      opt->add_param_group(torch::optim::OptimizerParamGroup(
          {b}, std::make_unique<torch::optim::SGDOptions>(0.5)));
      a.mutable_grad() = at::ones_like(a);
      b.mutable_grad() = at::ones_like(b);
      opt->step();
      if (!at::allclose(a, at::full_like(a, 0.9)) || !at::allclose(b, at::full_like(b, 0.5))) {
        return absl::InternalError(absl::StrCat(ModeName(mode), ": wrong update"));
      }
      return absl::OkStatus();
    }));
  }
}

TEST(OssTest, ErrorsNameTheOperation) {
  ExpectAllOk(RunInprocRanks(2, [](int rank, int world, std::shared_ptr<comm::Communicator> comm)
                              -> absl::Status {
    at::Tensor a = at::ones({4}).requires_grad_();
    auto opt = OSS::make<torch::optim::SGD>(std::vector<at::Tensor>{a},
                                            torch::optim::SGDOptions(0.1), comm);
    FS_RETURN_IF_ERROR(fairscale::testing::ExpectError([&] { opt->consolidated(); },
                                                       {"consolidate_state_dict"}));
    FS_RETURN_IF_ERROR(fairscale::testing::ExpectError([&] { opt->consolidate_state_dict(7); },
                                                       {"recipient_rank 7"}));
    FS_RETURN_IF_ERROR(fairscale::testing::ExpectError(
        [&] { opt->add_param_group(torch::optim::OptimizerParamGroup({a})); }, {"appears twice"}));
    return absl::OkStatus();
  }));
}

}  // namespace
}  // namespace fairscale::oss
