// ft::FaultTolerantHsdp: 2 replica groups x 2 ranks as threads over //comm/inproc and a shared
// HashStore (FSDP FULL_SHARD inside each group, Adam, f64), against a single-process replay of
// the same steps with the recorded effective batches:
// * no failure: every step averages all 4 ranks' batches;
// * group 1 dies at step kDieAt (its objects destroyed, no Leave: a dead process): group 0 is
//   dropped to alone within the membership bound and continues on its own batches;
// * group 1 comes back with a fresh random init: admitted as a joiner, it receives group 0's
//   shards and Adam state by broadcast, and both train together (bitwise equal to each other).
// Errors and times are printed ("hsdp: ...").
#include "ft/hsdp.h"

#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "comm/registry.h"
#include "comm/testing/rank_runner.h"
#include "ft/test_options.h"
#include "gtest/gtest.h"

namespace fairscale::ft {
namespace {

using comm::testing::Check;
using comm::testing::CurrentRank;
using comm::testing::ExpectAllOk;

constexpr int kGroups = 2;
constexpr int kGroupSize = 2;
constexpr double kLr = 0.05;
using testing::kDeadAfter;
using testing::kInterval;
// The membership bound (dead_after + interval + poll) plus slack for a loaded machine.
const absl::Duration kDetectBound = kDeadAfter + kInterval + absl::Seconds(1);

struct NetImpl : torch::nn::Module {
  NetImpl() {
    l1 = register_module("l1", torch::nn::Linear(6, 8));
    l2 = register_module("l2", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return l2(torch::tanh(l1(x))); }
  torch::nn::Linear l1{nullptr}, l2{nullptr};
};
TORCH_MODULE(Net);

// Threads share torch's global generator: every random tensor comes from a private one.
Net MakeNet(uint64_t seed) {
  Net net;
  net->to(torch::kDouble);
  at::Generator gen = at::detail::createCPUGenerator(seed);
  torch::NoGradGuard no_grad;
  for (auto& p : net->parameters()) {
    p.copy_(at::randn(p.sizes(), gen, torch::TensorOptions().dtype(torch::kDouble)) * 0.5);
  }
  return net;
}

std::pair<torch::Tensor, torch::Tensor> Batch(int64_t step, int group, int shard) {
  at::Generator gen = at::detail::createCPUGenerator(1000 + step * 100 + group * 10 + shard);
  auto opts = torch::TensorOptions().dtype(torch::kDouble);
  torch::Tensor x = at::randn({4, 6}, gen, opts);
  torch::Tensor y = at::randn({4, 3}, gen, opts);
  return {x, y};
}

// What one rank (its last incarnation) ends with.
struct Outcome {
  std::vector<HsdpStepRecord> history;
  std::vector<torch::Tensor> full_params;  // the Net's named_parameters() order
  std::vector<torch::Tensor> shards_after_transfer;  // parameters() after a transfer step began
  // The loop's own state (add_state): rows trained on, counted on each commit; a joiner's
  // fresh incarnation starts at 0 and must receive its source's.
  int64_t samples = 0;
};

class Outcomes {
 public:
  void Put(int rank, Outcome o) {
    absl::MutexLock lock(&mu_);
    by_rank_[rank] = std::move(o);
  }
  Outcome Get(int rank) {
    absl::MutexLock lock(&mu_);
    return by_rank_[rank];
  }

 private:
  absl::Mutex mu_;
  std::map<int, Outcome> by_rank_ ABSL_GUARDED_BY(mu_);
};

struct Scenario {
  int64_t num_steps = 5;
  int64_t die_at = -1;     // group 1 stops before this step
  int64_t rejoin_at = -1;  // group 0 waits at this step until group 1 is back and announcing
};

// One incarnation of a rank: trains until step() reaches `until` (or `stop_at`, then dies
// without a clean exit: before that step, or with `mid_step` after its backward, before
// end_step, so its peers' gradient all-reduce fails).
absl::Status Train(int rank, int incarnation, uint64_t seed, int64_t until, int64_t stop_at,
                   const std::function<void(int64_t step)>& before_step,
                   const std::function<void()>& ready, Outcome* out, bool mid_step = false) {
  const int g = rank / kGroupSize;
  const int s = rank % kGroupSize;
  std::shared_ptr<comm::Store> store = CurrentRank()->store;
  comm::CommConfig group_config = comm::testing::RankConfig(absl::Seconds(20));
  group_config.rank = s;
  group_config.size = kGroupSize;
  group_config.timeout = absl::Seconds(10);
  group_config.name = absl::StrCat("shard/g", g, "/inc", incarnation);
  FS_ASSIGN_OR_RETURN(std::shared_ptr<comm::Communicator> group_comm,
                      comm::CreateCommunicator("inproc", group_config));
  FS_ASSIGN_OR_RETURN(std::unique_ptr<Membership> m, Membership::Create(store, testing::FastOptions(kGroups, kGroupSize, rank)));
  fsdp::FullyShardedDataParallel model(
      MakeNet(seed), group_comm,
      fsdp::FsdpOptions().sharding_strategy(fsdp::ShardingStrategy::kFullShard));
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(kLr));
  comm::CommConfig base = comm::testing::RankConfig(absl::Seconds(20));
  base.timeout = absl::Seconds(10);
  base.name = "hsdp/";
  auto hsdp = std::make_unique<FaultTolerantHsdp>(
      model, opt, *m,
      HsdpOptions().backend("inproc").comm_config(base).quorum_timeout(absl::Seconds(20))
          .commit_timeout(absl::Seconds(20)).collective_timeout(absl::Seconds(3)));
  int64_t samples = 0;
  hsdp->add_state(
      "samples", [&] { return std::to_string(samples); },
      [&](const std::string& bytes) { samples = std::stoll(bytes); });
  if (ready) ready();
  while (hsdp->step() < until) {
    if (hsdp->step() == stop_at) {
      if (mid_step) {
        hsdp->begin_step();
        opt.zero_grad();
        auto [x, y] = Batch(hsdp->step(), g, s);
        torch::mse_loss(model(x), y).backward();
      }
      *out = Outcome{hsdp->history(), {}, {}};
      hsdp.reset();  // dies: no Leave, the heartbeats stop with the Membership
      m.reset();
      return absl::OkStatus();
    }
    if (before_step) before_step(hsdp->step());
    const Quorum& q = hsdp->begin_step();
    if (!q.joiners.empty()) {
      for (const auto& p : model->parameters()) out->shards_after_transfer.push_back(p.clone());
    }
    opt.zero_grad();
    auto [x, y] = Batch(hsdp->step(), g, s);
    torch::Tensor loss = torch::mse_loss(model(x), y);
    loss.backward();
    if (hsdp->end_step()) samples += x.size(0);
  }
  out->samples = samples;
  {
    auto guard = model->summon_full_params(/*writeback=*/false);
    for (const auto& p : model->module()->parameters()) out->full_params.push_back(p.clone());
  }
  out->history = hsdp->history();
  hsdp.reset();
  m->Leave();
  return absl::OkStatus();
}

// The single-process replay: group 0's committed steps, each averaging the recorded groups'
// batches (all their ranks).
std::vector<torch::Tensor> Replay(const std::vector<HsdpStepRecord>& history) {
  Net net = MakeNet(/*seed=*/0);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(kLr));
  for (const HsdpStepRecord& r : history) {
    if (!r.committed) continue;
    opt.zero_grad();
    torch::Tensor loss;
    for (int g : r.groups) {
      for (int s = 0; s < kGroupSize; ++s) {
        auto [x, y] = Batch(r.step, g, s);
        torch::Tensor l = torch::mse_loss(net(x), y);
        loss = loss.defined() ? loss + l : l;
      }
    }
    (loss / static_cast<double>(r.groups.size() * kGroupSize)).backward();
    opt.step();
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

double MaxError(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return 1e30;
  double err = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    err = std::max(err, (a[i] - b[i]).abs().max().item<double>());
  }
  return err;
}

bool BitwiseEqual(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return true;
}

std::string Describe(const std::vector<HsdpStepRecord>& history) {
  std::vector<std::string> parts;
  for (const auto& r : history) {
    parts.push_back(absl::StrCat(r.step, r.committed ? "" : "(discarded)", ":{",
                                 absl::StrJoin(r.groups, ","), "}",
                                 r.received_state ? " joined" : "",
                                 r.error.empty() ? "" : absl::StrCat(" [", r.error, "]")));
  }
  return absl::StrJoin(parts, " ");
}

TEST(FaultTolerantHsdp, TwoGroupsMatchSingleProcessReference) {
  const absl::Time start = absl::Now();
  Outcomes outcomes;
  constexpr int64_t kSteps = 5;
  ExpectAllOk(comm::testing::RunThreads(kGroups * kGroupSize, [&](int rank) -> absl::Status {
    Outcome out;
    FS_RETURN_IF_ERROR(Train(rank, 0, /*seed=*/0, kSteps, -1, nullptr, nullptr, &out));
    outcomes.Put(rank, std::move(out));
    return absl::OkStatus();
  }, absl::Seconds(60)), "train");
  const Outcome o0 = outcomes.Get(0);
  ASSERT_EQ(o0.history.size(), kSteps) << Describe(o0.history);
  for (const auto& r : o0.history) {
    EXPECT_TRUE(r.committed);
    EXPECT_EQ(r.groups, (std::vector<int>{0, 1}));
  }
  const std::vector<torch::Tensor> want = Replay(o0.history);
  double worst = 0;
  for (int rank = 0; rank < kGroups * kGroupSize; ++rank) {
    const double err = MaxError(outcomes.Get(rank).full_params, want);
    worst = std::max(worst, err);
    EXPECT_LE(err, 1e-6) << "rank " << rank;
  }
  EXPECT_TRUE(BitwiseEqual(outcomes.Get(0).full_params, outcomes.Get(2).full_params));
  std::printf("hsdp: no failure, %lld steps: max |param - reference| %.3g, %.2fs\n",
              static_cast<long long>(kSteps), worst, absl::ToDoubleSeconds(absl::Now() - start));
}

// Group 1 dies before step kDieAt; with `rejoin`, it comes back while group 0 is still stepping
// alone (group 0 waits at kRejoinAt at the latest), gets the state from group 0 and both train
// to kSteps.

void RunFailure(bool rejoin, bool mid_step = false) {
  constexpr int64_t kDieAt = 2;
  constexpr int64_t kRejoinAt = 5;
  const int64_t kSteps = rejoin ? 9 : 6;
  const absl::Time start = absl::Now();
  Outcomes outcomes;
  std::atomic<int64_t> group0_step{0};
  std::atomic<int> back{0};
  std::atomic<int64_t> died_us{0};
  ExpectAllOk(comm::testing::RunThreads(kGroups * kGroupSize, [&](int rank) -> absl::Status {
    const int g = rank / kGroupSize;
    Outcome out;
    if (g == 0) {
      auto before = [&](int64_t step) {
        group0_step = std::max<int64_t>(group0_step, step);
        if (rejoin && step == kRejoinAt) {
          const absl::Time until = absl::Now() + absl::Seconds(20);
          while (back < kGroupSize && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
          // Let group 1's quorum() calls announce themselves for the next round.
          absl::SleepFor(absl::Milliseconds(300));
        }
      };
      FS_RETURN_IF_ERROR(Train(rank, 0, /*seed=*/0, kSteps, -1, before, nullptr, &out));
      outcomes.Put(rank, std::move(out));
      return absl::OkStatus();
    }
    FS_RETURN_IF_ERROR(Train(rank, 0, /*seed=*/0, kSteps, kDieAt, nullptr, nullptr, &out, mid_step));
    died_us = absl::ToUnixMicros(absl::Now());
    if (!rejoin) {
      outcomes.Put(rank, std::move(out));
      return absl::OkStatus();
    }
    // Restarted once group 0 trains alone (step kDieAt + 1), while it keeps stepping: a new
    // incarnation with a fresh random init, admitted at whichever boundary it reaches first
    // (group 0 waits at kRejoinAt at the latest). This used to drop the joiner again right
    // after its admission about every other run: a deciding rank judged it on a heartbeat
    // sample taken before the new incarnation beat (steps are shorter than the heartbeat
    // interval here); a rank now re-samples before it declares a group dead.
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (group0_step < kDieAt + 1 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
    Outcome again;
    FS_RETURN_IF_ERROR(Train(rank, 1, /*seed=*/100 + g, kSteps, -1, nullptr,
                             [&] { ++back; }, &again));
    outcomes.Put(rank, std::move(again));
    return absl::OkStatus();
  }, absl::Seconds(60)), "train");

  const Outcome o0 = outcomes.Get(0);
  const std::string described = Describe(o0.history);
  std::printf("hsdp: group 0's steps: %s\n", described.c_str());
  // The effective batches: both groups before kDieAt, group 0 alone from kDieAt (a discarded
  // attempt is retried), both again from the step group 1 joined at.
  int64_t joined_at = -1;
  if (rejoin) {
    const Outcome o2 = outcomes.Get(2);
    std::printf("hsdp: group 1's steps after restarting: %s\n", Describe(o2.history).c_str());
    ASSERT_FALSE(o2.history.empty());
    EXPECT_TRUE(o2.history.front().received_state) << Describe(o2.history);
    EXPECT_EQ(o2.history.front().source_group, 0);
    joined_at = o2.history.front().step;
    EXPECT_GT(joined_at, kDieAt);
    EXPECT_LE(joined_at, kRejoinAt);  // group 0 waits there for it at the latest
    std::printf("hsdp: group 1 rejoined at step %lld, transfer %.1f ms\n",
                static_cast<long long>(joined_at),
                absl::ToDoubleMilliseconds(o2.history.front().transfer_time));
  }
  absl::Duration detection;
  for (const auto& r : o0.history) {
    std::vector<int> want = {0, 1};
    if (r.step >= kDieAt && (joined_at < 0 || r.step < joined_at)) want = {0};
    if (r.committed) {
      EXPECT_EQ(r.groups, want) << "step " << r.step << ": " << described;
    }
    if (r.step == kDieAt && r.committed) detection = r.quorum_wait;
  }
  int64_t committed = 0;
  for (const auto& r : o0.history) committed += r.committed;
  EXPECT_EQ(committed, kSteps);
  if (mid_step) {
    // Group 1 died inside step kDieAt: that attempt (both groups) is discarded on group 0 too,
    // and retried by group 0 alone.
    ASSERT_GT(o0.history.size(), static_cast<size_t>(kDieAt + 1)) << described;
    const HsdpStepRecord& failed = o0.history[kDieAt];
    EXPECT_FALSE(failed.committed) << described;
    EXPECT_EQ(failed.groups, (std::vector<int>{0, 1}));
    const HsdpStepRecord& retry = o0.history[kDieAt + 1];
    EXPECT_EQ(retry.step, kDieAt);
    EXPECT_TRUE(retry.committed);
    EXPECT_GT(retry.epoch, failed.epoch);
    std::printf("hsdp: discarded step %lld: reduction %.2fs (%s); retry's quorum wait %.2fs\n",
                static_cast<long long>(kDieAt), absl::ToDoubleSeconds(failed.reduce_time),
                failed.error.c_str(), absl::ToDoubleSeconds(retry.quorum_wait));
  }
  EXPECT_LE(detection, kDetectBound);
  std::printf("hsdp: group 0's quorum wait at step %lld (group 1 dead): %.2fs (bound %.2fs)\n",
              static_cast<long long>(kDieAt), absl::ToDoubleSeconds(detection),
              absl::ToDoubleSeconds(kDetectBound));

  const std::vector<torch::Tensor> want = Replay(o0.history);
  double worst = 0;
  const int ranks = rejoin ? kGroups * kGroupSize : kGroupSize;
  for (int rank = 0; rank < ranks; ++rank) {
    const double err = MaxError(outcomes.Get(rank).full_params, want);
    worst = std::max(worst, err);
    EXPECT_LE(err, 1e-6) << "rank " << rank;
    // Every committed step trained 4 rows on each rank (the joiner got the count by transfer).
    EXPECT_EQ(outcomes.Get(rank).samples, kSteps * 4) << "rank " << rank;
  }
  if (rejoin) {
    for (int s = 0; s < kGroupSize; ++s) {
      const Outcome a = outcomes.Get(s);
      const Outcome b = outcomes.Get(kGroupSize + s);
      EXPECT_TRUE(BitwiseEqual(a.full_params, b.full_params)) << "shard " << s;
      EXPECT_FALSE(b.shards_after_transfer.empty());
      EXPECT_TRUE(BitwiseEqual(a.shards_after_transfer, b.shards_after_transfer))
          << "shard " << s << " right after the transfer";
    }
  }
  std::printf("hsdp: %s: max |param - replay| %.3g over %d ranks, %.2fs\n",
              rejoin ? "die and rejoin" : mid_step ? "die mid-step" : "die", worst, ranks,
              absl::ToDoubleSeconds(absl::Now() - start));
}

TEST(FaultTolerantHsdp, AddStateRefusesDuplicatesAndEmptyNames) {
  ExpectAllOk(comm::testing::RunThreads(1, [&](int) -> absl::Status {
    comm::CommConfig config = comm::testing::RankConfig(absl::Seconds(10));
    FS_ASSIGN_OR_RETURN(std::shared_ptr<comm::Communicator> c,
                        comm::CreateCommunicator("inproc", config));
    FS_ASSIGN_OR_RETURN(std::unique_ptr<Membership> m,
                        Membership::Create(CurrentRank()->store, testing::FastOptions(1, 1, 0)));
    fsdp::FullyShardedDataParallel model(MakeNet(0), c, fsdp::FsdpOptions());
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(kLr));
    FaultTolerantHsdp hsdp(model, opt, *m, HsdpOptions().backend("inproc").comm_config(config));
    auto save = [] { return std::string(); };
    auto load = [](const std::string&) {};
    hsdp.add_state("a", save, load);
    try {
      hsdp.add_state("a", save, load);
      return absl::InternalError("a duplicate name was accepted");
    } catch (const c10::Error& e) {
      FS_RETURN_IF_ERROR(Check(absl::StrContains(e.what(), "state 'a' added twice"), e.what()));
    }
    try {
      hsdp.add_state("", save, load);
      return absl::InternalError("an empty name was accepted");
    } catch (const c10::Error& e) {
      FS_RETURN_IF_ERROR(Check(absl::StrContains(e.what(), "add_state needs a name"), e.what()));
    }
    m->Leave();
    return absl::OkStatus();
  }, absl::Seconds(30)), "add_state");
}

TEST(FaultTolerantHsdp, SurvivorsContinueWhenAGroupDies) { RunFailure(/*rejoin=*/false); }

TEST(FaultTolerantHsdp, ReturningGroupReceivesStateAndTrains) { RunFailure(/*rejoin=*/true); }

TEST(FaultTolerantHsdp, StepOfTheDeathIsDiscardedAndRetried) {
  RunFailure(/*rejoin=*/false, /*mid_step=*/true);
}

}  // namespace
}  // namespace fairscale::ft
