// The looped SIGKILL test of in-process recovery (issue 25 item 5): fs_launch (argv[1]) with
// --replica_group_size starts //ft:kill_worker (argv[2]) as 2 replica groups x 2 ranks over tcp;
// a rank SIGKILLs itself at a random step (before its quorum, or after its backward, before the
// gradient average), FS_FT_KILL_TRIALS times (default 20; FS_FT_KILL_SEED to replay a seed, which
// is printed). Every trial must:
// * end (a trial past kTrialTimeout is a hang: the launcher is stopped and the test fails);
// * exit 0: no surviving rank exits (the other group's ranks finish in their first incarnation),
//   the dead group is restarted by the launcher alone and rejoins (its last incarnation received
//   the state), the run finishes;
// * agree: every committed step has one group set on every rank that ran it, steps 0..N-1 all
//   committed once;
// * match a single-process replay of that history (each step averaging the batches of every rank
//   of its groups, Adam) within 1e-6 on every rank, and all ranks hold bitwise the same
//   parameters;
// * carry the loop's state: every rank counted N x 8 rows (a joiner's count came by transfer),
//   and a joiner's generator draws what its source's draws from the join on;
// * recover fast: the survivors' next committed step within kRecoveryBound of the kill.
// Fixed cases: a joiner killed while it receives the state; 3 groups x 1 rank: the source group
// killed while it sends (the joiner fails and restarts too; the third group is the source of
// both); two groups dying at once; every group dying (the job fails with a clear error: the live
// state is lost).
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ATen/ops/mse_loss.h>
#include <torch/optim/adam.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "base/subprocess.h"
#include "ft/kill_worker_model.h"
#include "gtest/gtest.h"
#include "testing/tmp.h"

namespace fairscale::ft {
namespace {

std::string g_fs_launch;
std::string g_worker;

constexpr absl::Duration kTrialTimeout = absl::Seconds(150);
// Kill -> the survivors' next committed step: dead_after (1 s) + interval + the quorum and a new
// replicate communicator, with slack for a loaded 2-core machine.
constexpr absl::Duration kRecoveryBound = absl::Seconds(8);
constexpr int kRows = 8;  // KillBatch's rows

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct Job {
  int nproc = 4;
  int group_size = 2;
  int64_t steps = 24;  // more than the 16 rounds Membership keeps: kills after a pruning too
  int step_ms = 10;
  int max_restarts = 2;
  std::vector<std::string> kills;  // rank:incarnation:step:point
  bool no_wait = false;
};

struct Outcome {
  std::string dir;
  int status = -1;
  bool hung = false;
  absl::Duration took;
  std::string out, err;
  std::map<int, nlohmann::json> results;  // rank -> its last incarnation's result
};

Outcome RunJob(const Job& job) {
  Outcome o;
  o.dir = fairscale::testing::UniqueTmpPath("ft_kill");
  mkdir(o.dir.c_str(), 0700);
  const int out = open((o.dir + "/stdout").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  const int err = open((o.dir + "/stderr").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  std::vector<std::string> args = {
      absl::StrCat("--nproc_per_node=", job.nproc), absl::StrCat("--replica_group_size=", job.group_size),
      absl::StrCat("--max_restarts=", job.max_restarts), "--master_port=0", "--stop_timeout_s=2",
      "--", g_worker, absl::StrCat("--dir=", o.dir), absl::StrCat("--steps=", job.steps),
      absl::StrCat("--step_ms=", job.step_ms), absl::StrCat("--kills=", absl::StrJoin(job.kills, ","))};
  if (job.no_wait) args.push_back("--no_wait");
  const absl::Time start = absl::Now();
  absl::StatusOr<pid_t> pid = base::Spawn(g_fs_launch, args, {}, {{out, 1}, {err, 2}});
  close(out);
  close(err);
  EXPECT_TRUE(pid.ok()) << pid.status();
  if (!pid.ok()) return o;
  for (;;) {
    int wstatus = 0;
    const pid_t w = waitpid(*pid, &wstatus, WNOHANG);
    if (w == *pid) {
      o.status = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 128 + WTERMSIG(wstatus);
      break;
    }
    if (absl::Now() - start > kTrialTimeout) {
      o.hung = true;
      kill(*pid, SIGTERM);  // the launcher stops its ranks (SIGKILL after --stop_timeout_s)
      absl::StatusOr<int> code = base::WaitChild(*pid, absl::Seconds(20));
      o.status = code.ok() ? *code : -1;
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  o.took = absl::Now() - start;
  o.out = ReadFile(o.dir + "/stdout");
  o.err = ReadFile(o.dir + "/stderr");
  for (int r = 0; r < job.nproc; ++r) {
    const std::string text = ReadFile(absl::StrCat(o.dir, "/result.", r, ".json"));
    if (!text.empty()) o.results[r] = nlohmann::json::parse(text);
  }
  return o;
}

// The single-process replay of a committed history (step -> groups).
std::vector<std::vector<double>> Replay(const std::map<int64_t, std::vector<int>>& history,
                                        int group_size) {
  testing::KillNet net = testing::MakeKillNet();
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(testing::kKillLr));
  for (const auto& [step, groups] : history) {
    opt.zero_grad();
    at::Tensor loss;
    for (int g : groups) {
      for (int s = 0; s < group_size; ++s) {
        auto [x, y] = testing::KillBatch(step, g, s);
        at::Tensor l = at::mse_loss(net(x), y);
        loss = loss.defined() ? loss + l : l;
      }
    }
    (loss / static_cast<double>(groups.size() * group_size)).backward();
    opt.step();
  }
  std::vector<std::vector<double>> out;
  for (const at::Tensor& p : net->parameters()) {
    at::Tensor flat = p.detach().reshape({-1}).contiguous();
    out.emplace_back(flat.data_ptr<double>(), flat.data_ptr<double>() + flat.numel());
  }
  return out;
}

std::string Describe(const Outcome& o) {
  std::string history;
  for (const auto& [rank, r] : o.results) {
    absl::StrAppend(&history, "rank ", rank, " incarnation ", r["incarnation"].get<int>(), ":");
    for (const auto& a : r["attempts"]) {
      absl::StrAppend(&history, " ", a["step"].get<int64_t>(), a["committed"].get<bool>() ? "" : "(discarded)",
                      "{", absl::StrJoin(a["groups"].get<std::vector<int>>(), ","), "}",
                      a["received_state"].get<bool>() ? "<-joined" : "");
    }
    absl::StrAppend(&history, "\n");
  }
  return absl::StrCat("dir ", o.dir, ", status ", o.status, ", ", absl::FormatDuration(o.took),
                      "\n", history, "stderr (tail):\n",
                      o.err.substr(o.err.size() > 6000 ? o.err.size() - 6000 : 0));
}

// The checks of a trial that must recover (see the file comment). `victims`: the groups killed
// (restarted, must rejoin). Returns the kill -> next committed step time of the survivors.
absl::Duration CheckRecovered(const Job& job, const Outcome& o, const std::set<int>& victims) {
  const std::string why = Describe(o);
  EXPECT_FALSE(o.hung) << "hang: " << why;
  EXPECT_EQ(o.status, 0) << why;
  const int groups = job.nproc / job.group_size;
  if (static_cast<int>(o.results.size()) != job.nproc) {
    ADD_FAILURE() << "results of " << o.results.size() << " ranks: " << why;
    return absl::InfiniteDuration();
  }
  // One group set per committed step, on every rank that committed it.
  std::map<int64_t, std::vector<int>> history;
  for (const auto& [rank, r] : o.results) {
    const int g = rank / job.group_size;
    const int incarnation = r["incarnation"].get<int>();
    if (victims.count(g) == 0) {
      EXPECT_EQ(incarnation, 0) << "rank " << rank << " of a surviving group restarted: " << why;
    } else {
      EXPECT_GE(incarnation, 1) << "rank " << rank << " of a killed group: " << why;
      bool joined = false;
      for (const auto& a : r["attempts"]) joined = joined || a["received_state"].get<bool>();
      EXPECT_TRUE(joined) << "rank " << rank << " did not receive the state: " << why;
    }
    EXPECT_EQ(r["rows"].get<int64_t>(), job.steps * kRows) << "rank " << rank << ": " << why;
    for (const auto& a : r["attempts"]) {
      if (!a["committed"].get<bool>()) continue;
      const int64_t step = a["step"].get<int64_t>();
      const std::vector<int> gs = a["groups"].get<std::vector<int>>();
      auto [it, inserted] = history.emplace(step, gs);
      EXPECT_EQ(it->second, gs) << "step " << step << " rank " << rank << ": " << why;
    }
  }
  EXPECT_EQ(static_cast<int64_t>(history.size()), job.steps) << why;
  if (static_cast<int64_t>(history.size()) == job.steps) {
    EXPECT_EQ(history.rbegin()->first, job.steps - 1) << why;
  }
  // The replay, and every rank against it and against rank 0.
  const std::vector<std::vector<double>> want = Replay(history, job.group_size);
  double worst = 0;
  for (const auto& [rank, r] : o.results) {
    const auto got = r["params"].get<std::vector<std::vector<double>>>();
    EXPECT_EQ(got, o.results.at(0)["params"].get<std::vector<std::vector<double>>>())
        << "rank " << rank << " differs from rank 0 (bitwise): " << why;
    if (got.size() != want.size()) {
      ADD_FAILURE() << "rank " << rank << ": " << got.size() << " tensors, replay " << want.size();
      continue;
    }
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].size(), want[i].size());
      for (size_t j = 0; j < std::min(got[i].size(), want[i].size()); ++j) {
        worst = std::max(worst, std::abs(got[i][j] - want[i][j]));
      }
    }
  }
  EXPECT_LE(worst, 1e-6) << "max |param - replay| " << worst << ": " << why;
  // A joiner's generator continues its source's: the draws after each commit are equal from the
  // join on (when the source's incarnation that sent is the one whose result we have).
  for (const auto& [rank, r] : o.results) {
    int64_t joined_at = -1;
    int source = -1;
    std::map<int64_t, double> draws;
    for (const auto& a : r["attempts"]) {
      if (a["received_state"].get<bool>()) {
        joined_at = a["step"].get<int64_t>();
        source = a["source_group"].get<int>();
        draws.clear();
      }
      if (a["committed"].get<bool>() && joined_at >= 0) draws[a["step"].get<int64_t>()] = a["draw"].get<double>();
    }
    if (joined_at < 0 || source < 0 || source >= groups) continue;
    const nlohmann::json& src = o.results.at(source * job.group_size + rank % job.group_size);
    if (victims.count(source) != 0) continue;  // that incarnation is gone
    int compared = 0;
    for (const auto& a : src["attempts"]) {
      const int64_t step = a["step"].get<int64_t>();
      if (!a["committed"].get<bool>() || draws.count(step) == 0) continue;
      EXPECT_EQ(draws[step], a["draw"].get<double>()) << "rank " << rank << " step " << step;
      ++compared;
    }
    EXPECT_GT(compared, 0) << "rank " << rank << " joined at " << joined_at << ": " << why;
  }
  // Kill -> the survivors' next committed step.
  int64_t killed_us = 0;
  for (int r = 0; r < job.nproc; ++r) {
    const std::string t = ReadFile(absl::StrCat(o.dir, "/kill.", r, ".0"));
    int64_t us = 0;
    if (absl::SimpleAtoi(t, &us)) killed_us = std::max(killed_us, us);
  }
  // The step of the first kill (a survivor may still be finishing the step before it then).
  int64_t kill_step = -1;
  for (const std::string& k : job.kills) {
    const std::vector<std::string> p = absl::StrSplit(k, ':');
    int64_t step = -1;
    if (p.size() == 4 && p[1] == "0" && absl::SimpleAtoi(p[2], &step)) {
      kill_step = kill_step < 0 ? step : std::min(kill_step, step);
    }
  }
  int64_t next_us = 0;
  for (const auto& [rank, r] : o.results) {
    if (victims.count(rank / job.group_size) != 0) continue;
    for (const auto& a : r["attempts"]) {
      const int64_t at = a["at_us"].get<int64_t>();
      if (a["committed"].get<bool>() && a["step"].get<int64_t>() >= kill_step && at > killed_us &&
          (next_us == 0 || at < next_us)) {
        next_us = at;
      }
    }
  }
  EXPECT_GT(killed_us, 0) << why;
  EXPECT_GT(next_us, 0) << why;
  const absl::Duration recovery = absl::Microseconds(next_us - killed_us);
  EXPECT_LE(recovery, kRecoveryBound) << why;
  return recovery;
}

TEST(FaultTolerantKill, LoopedRandomKills) {
  int trials = 20;
  if (const char* t = std::getenv("FS_FT_KILL_TRIALS")) {
    ASSERT_TRUE(absl::SimpleAtoi(t, &trials)) << t;
  }
  uint64_t seed = std::random_device()();
  if (const char* s = std::getenv("FS_FT_KILL_SEED")) {
    ASSERT_TRUE(absl::SimpleAtoi(s, &seed)) << s;
  }
  std::printf("kill: %d trials, FS_FT_KILL_SEED=%llu\n", trials, static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  std::vector<double> recoveries;
  int hangs = 0;
  int diverged = 0;
  for (int trial = 0; trial < trials; ++trial) {
    Job job;
    const int victim = static_cast<int>(rng() % 4);
    const int64_t step = 1 + static_cast<int64_t>(rng() % 18);
    const std::string point = rng() % 2 == 0 ? "before" : "mid";
    job.kills = {absl::StrCat(victim, ":0:", step, ":", point)};
    // Failures are the only parts a test result records (passing expectations add none).
    const int parts_before = ::testing::UnitTest::GetInstance()->current_test_info()->result()->total_part_count();
    const Outcome o = RunJob(job);
    const absl::Duration rec = CheckRecovered(job, o, {victim / 2});
    const bool failed =
        ::testing::UnitTest::GetInstance()->current_test_info()->result()->total_part_count() != parts_before;
    hangs += o.hung;
    diverged += failed && !o.hung;
    recoveries.push_back(absl::ToDoubleSeconds(rec));
    std::printf("kill: trial %d: rank %d %s step %lld: status %d in %.1fs, kill -> next step %.2fs%s\n",
                trial, victim, point.c_str(), static_cast<long long>(step), o.status,
                absl::ToDoubleSeconds(o.took), absl::ToDoubleSeconds(rec), failed ? " FAILED" : "");
    std::fflush(stdout);
  }
  std::sort(recoveries.begin(), recoveries.end());
  std::printf("kill: %d trials, %d hangs, %d failed; kill -> next committed step: median %.2fs, max %.2fs\n",
              trials, hangs, diverged, recoveries[recoveries.size() / 2], recoveries.back());
  EXPECT_EQ(hangs, 0);
  EXPECT_EQ(diverged, 0);
}

TEST(FaultTolerantKill, JoinerKilledWhileReceivingTheState) {
  Job job;
  job.kills = {"3:0:2:before", "3:1:0:load"};  // killed again in its first transfer
  const Outcome o = RunJob(job);
  CheckRecovered(job, o, {1});
  for (const auto& [rank, r] : o.results) {
    if (rank / 2 == 1) {
      EXPECT_EQ(r["incarnation"].get<int>(), 2) << Describe(o);
    }
  }
  std::printf("kill: joiner killed in the transfer: status %d in %.1fs\n", o.status,
              absl::ToDoubleSeconds(o.took));
}

TEST(FaultTolerantKill, SourceKilledWhileSendingTheState) {
  Job job;
  job.nproc = 3;
  job.group_size = 1;
  // Group 2 dies at step 2 and comes back; its source (group 0, the first healthy group) dies
  // while sending. The joiner's transfer fails (it restarts again); group 1 is left to heal both.
  job.kills = {"2:0:2:before", "0:0:0:save"};
  const Outcome o = RunJob(job);
  CheckRecovered(job, o, {0, 2});
  std::printf("kill: source killed in the transfer: status %d in %.1fs\n", o.status,
              absl::ToDoubleSeconds(o.took));
}

TEST(FaultTolerantKill, TwoGroupsDyingAtOnce) {
  Job job;
  job.nproc = 3;
  job.group_size = 1;
  job.kills = {"1:0:3:before", "2:0:3:mid"};
  const Outcome o = RunJob(job);
  CheckRecovered(job, o, {1, 2});
  std::printf("kill: two of three groups at once: status %d in %.1fs\n", o.status,
              absl::ToDoubleSeconds(o.took));
}

// Killed at the end: the survivors finish without waiting; the restarted group either makes it
// back in time (and finishes with them) or finds everybody gone (NothingToRejoin) and exits 0.
// Either way the job succeeds.
TEST(FaultTolerantKill, GroupBackAfterTheOthersFinishedExitsCleanly) {
  Job job;
  job.no_wait = true;
  job.kills = {"2:0:22:mid"};
  const Outcome o = RunJob(job);
  const std::string why = Describe(o);
  EXPECT_FALSE(o.hung) << why;
  EXPECT_EQ(o.status, 0) << why;
  const bool back_in_time = o.results.count(2) != 0;
  if (!back_in_time) {
    EXPECT_TRUE(absl::StrContains(o.out, "nothing to rejoin: every other group finished and left"))
        << why;
  }
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(o.results.count(r), 1u) << why;
    EXPECT_EQ(o.results.at(r)["incarnation"].get<int>(), 0) << why;
  }
  std::printf("kill: group back after the others finished: status %d in %.1fs (%s)\n", o.status,
              absl::ToDoubleSeconds(o.took), back_in_time ? "back in time" : "nothing to rejoin");
}

TEST(FaultTolerantKill, EveryGroupDyingFailsTheJobClearly) {
  Job job;
  job.kills = {"0:0:3:before", "2:0:3:before"};
  const Outcome o = RunJob(job);
  EXPECT_FALSE(o.hung) << Describe(o);
  EXPECT_NE(o.status, 0) << Describe(o);
  EXPECT_TRUE(absl::StrContains(o.err, "no group of the previous round is left to copy the state "
                                       "from (every replica group died"))
      << Describe(o);
  EXPECT_TRUE(absl::StrContains(o.err, "is out of restarts")) << Describe(o);
  EXPECT_LE(o.took, absl::Seconds(60)) << Describe(o);
  std::printf("kill: every group dead: status %d in %.1fs\n", o.status, absl::ToDoubleSeconds(o.took));
}

}  // namespace
}  // namespace fairscale::ft

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (argc != 3) {
    std::fprintf(stderr, "usage: kill_test <fs_launch> <kill_worker>\n");
    return 2;
  }
  fairscale::ft::g_fs_launch = argv[1];
  fairscale::ft::g_worker = argv[2];
  return RUN_ALL_TESTS();
}
