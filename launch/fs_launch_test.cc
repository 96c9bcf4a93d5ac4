// fs_launch as a real process (argv[1]) starting fake_rank (argv[2]) as its ranks: the
// environment every rank gets, prefixed output, a failing or killed rank, SIGTERM to the
// launcher, restarts, port 0 with a real all-reduce, and two nodes on one host.
//
// Every wait is bounded (tens of seconds, far above what each step needs); nothing asserts on
// how fast something happened: a launcher that did not stop its sleeping ranks would still be
// waiting on them (they sleep 120 s) when the bound expires.
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/status_matchers.h"
#include "base/subprocess.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "launch/launcher.h"
#include "testing/tmp.h"

namespace fairscale::launch {
namespace {

using ::fairscale::base::testing::StatusIs;
using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::Not;

std::string g_fs_launch;
std::string g_fake_rank;

constexpr absl::Duration kJobTimeout = absl::Seconds(90);

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> out = absl::StrSplit(text, '\n');
  if (!out.empty() && out.back().empty()) out.pop_back();
  return out;
}

// A fresh directory under TEST_TMPDIR.
std::string NewDir() {
  const std::string dir = fairscale::testing::UniqueTmpPath("fs_launch_test");
  mkdir(dir.c_str(), 0700);
  return dir;
}

// One fs_launch process, its stdout / stderr going to files.
class Launcher {
 public:
  // fs_launch <launcher_flags> -- fake_rank <rank_flags>
  void Start(const std::vector<std::string>& launcher_flags,
             const std::vector<std::string>& rank_flags, const std::vector<std::string>& env = {}) {
    std::vector<std::string> args = launcher_flags;
    args.push_back("--");
    args.push_back(g_fake_rank);
    args.insert(args.end(), rank_flags.begin(), rank_flags.end());
    StartRaw(args, env);
  }

  void StartRaw(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
    dir_ = NewDir();
    const int out =
        open((dir_ + "/stdout").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    const int err =
        open((dir_ + "/stderr").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    ASSERT_GE(out, 0);
    ASSERT_GE(err, 0);
    absl::StatusOr<pid_t> pid = base::Spawn(g_fs_launch, args, env, {{out, 1}, {err, 2}});
    close(out);
    close(err);
    ASSERT_TRUE(pid.ok()) << pid.status();
    pid_ = *pid;
  }

  // The launcher's exit status (-1 if it had to be killed at the deadline).
  int Wait(absl::Duration timeout = kJobTimeout) {
    absl::StatusOr<int> code = base::WaitChild(pid_, timeout);
    EXPECT_TRUE(code.ok()) << code.status() << "\nstderr:\n" << err();
    return code.ok() ? *code : -1;
  }

  pid_t pid() const { return pid_; }
  std::string out() const { return ReadFile(dir_ + "/stdout"); }
  std::string err() const { return ReadFile(dir_ + "/stderr"); }

 private:
  std::string dir_;
  pid_t pid_ = -1;
};

using EnvReport = std::map<std::string, std::string>;

// "KEY=VALUE ..." after "ENV " on the lines of each rank, in order: rank -> incarnations.
std::map<int, std::vector<EnvReport>> AllEnvReports(const std::string& out) {
  std::map<int, std::vector<EnvReport>> reports;
  for (const std::string& line : Lines(out)) {
    const size_t at = line.find("] ENV ");
    if (at == std::string::npos) continue;
    std::map<std::string, std::string> kv;
    for (absl::string_view item : absl::StrSplit(line.substr(at + 6), ' ')) {
      std::pair<std::string, std::string> p = absl::StrSplit(item, absl::MaxSplits('=', 1));
      kv[p.first] = p.second;
    }
    int rank = -1;
    EXPECT_TRUE(absl::SimpleAtoi(kv["RANK"], &rank)) << line;
    EXPECT_TRUE(absl::StartsWith(line, absl::StrCat("[rank ", rank, "] "))) << line;
    reports[rank].push_back(kv);
  }
  return reports;
}

// The last report of each rank: rank -> (key -> value).
std::map<int, EnvReport> EnvReports(const std::string& out) {
  std::map<int, EnvReport> last;
  for (auto& [rank, reports] : AllEnvReports(out)) last[rank] = reports.back();
  return last;
}

// Waits (bounded) until every rank wrote its pid file; returns the pids.
std::vector<pid_t> AwaitPids(const std::string& dir, int n) {
  std::vector<pid_t> pids;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  for (int r = 0; r < n; ++r) {
    const std::string path = absl::StrCat(dir, "/rank_", r, ".pid");
    while (access(path.c_str(), F_OK) != 0 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    int pid = 0;
    EXPECT_TRUE(absl::SimpleAtoi(absl::StripTrailingAsciiWhitespace(ReadFile(path)), &pid)) << path;
    pids.push_back(pid);
  }
  return pids;
}

// The launcher has exited, so it reaped its ranks: none of these pids may still be running.
void ExpectGone(const std::vector<pid_t>& pids) {
  for (pid_t pid : pids) {
    ASSERT_GT(pid, 0);
    EXPECT_NE(kill(pid, 0), 0) << "rank process " << pid << " still exists";
  }
}

TEST(FsLaunch, EveryRankGetsTheEnvironmentContract) {
  Launcher l;
  l.Start({"--nproc_per_node=3", "--master_port=0"}, {"--report_env", "--store"});
  ASSERT_EQ(l.Wait(), 0) << l.err();
  const auto reports = EnvReports(l.out());
  ASSERT_EQ(reports.size(), 3u) << l.out();
  std::string port;
  for (int r = 0; r < 3; ++r) {
    auto kv = reports.at(r);
    EXPECT_EQ(kv["LOCAL_RANK"], absl::StrCat(r));
    EXPECT_EQ(kv["WORLD_SIZE"], "3");
    EXPECT_EQ(kv["LOCAL_WORLD_SIZE"], "3");
    EXPECT_EQ(kv["GROUP_RANK"], "0");
    EXPECT_EQ(kv["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(kv["TORCHELASTIC_USE_AGENT_STORE"], "True");
    EXPECT_EQ(kv["FS_RESTART_COUNT"], "0");
    EXPECT_EQ(kv["FS_STORE_PREFIX"], "fs_launch/0/job");
    EXPECT_EQ(kv["FS_STORE_TOKEN_LEN"], "32");
    if (r == 0) port = kv["MASTER_PORT"];
    EXPECT_EQ(kv["MASTER_PORT"], port);
  }
  int p = 0;
  ASSERT_TRUE(absl::SimpleAtoi(port, &p));
  EXPECT_GT(p, 0) << "port 0 must be replaced by the store's real port";
  // Each rank reached the launcher's store with the token it was given.
  for (int r = 0; r < 3; ++r) {
    EXPECT_THAT(l.out(), HasSubstr(absl::StrCat("[rank ", r, "] STORE OK hello from ", r)));
  }
}

TEST(FsLaunch, AcceptsTorchrunSpellingsWithoutDashDash) {
  Launcher l;
  l.StartRaw({"--standalone", "--nproc-per-node", "2", "--store-bind-addr", "127.0.0.1",
              g_fake_rank, "--report_env"});
  ASSERT_EQ(l.Wait(), 0) << l.err();
  EXPECT_EQ(EnvReports(l.out()).size(), 2u) << l.out();
}

TEST(FsLaunch, EveryOutputLineIsPrefixedWithItsRank) {
  Launcher l;
  l.Start({"--nproc_per_node=2", "--master_port=0"}, {"--lines=50"});
  ASSERT_EQ(l.Wait(), 0) << l.err();
  const std::vector<std::string> out = Lines(l.out());
  std::map<int, int> count;
  for (const std::string& line : out) {
    // "[rank R] line I of rank R" or the flushed partial "[rank R] tail of rank R".
    bool matched = false;
    for (int r = 0; r < 2 && !matched; ++r) {
      const std::string prefix = absl::StrCat("[rank ", r, "] ");
      if (absl::StartsWith(line, prefix) && (absl::EndsWith(line, absl::StrCat(" of rank ", r)))) {
        matched = true;
        ++count[r];
      }
    }
    EXPECT_TRUE(matched) << "unexpected line: '" << line << "'";
  }
  EXPECT_EQ(count[0], 51);
  EXPECT_EQ(count[1], 51);
  EXPECT_THAT(out, Contains("[rank 1] line 49 of rank 1"));
  EXPECT_THAT(out, Contains("[rank 0] tail of rank 0"));
  EXPECT_THAT(Lines(l.err()), Contains("[rank 1] stderr of rank 1"));
  EXPECT_THAT(Lines(l.err()), Contains("[rank 0] stderr of rank 0"));
}

TEST(FsLaunch, PrefixCanBeTurnedOff) {
  Launcher l;
  l.Start({"--nproc_per_node=1", "--master_port=0", "--prefix_output=false"}, {"--lines=1"});
  ASSERT_EQ(l.Wait(), 0) << l.err();
  EXPECT_THAT(Lines(l.out()), Contains("line 0 of rank 0"));
}

TEST(FsLaunch, AFailingRankStopsItsSiblingsAndGivesItsExitCode) {
  const std::string pids = NewDir();
  Launcher l;
  l.Start({"--nproc_per_node=3", "--master_port=0"},
          {"--pid_dir=" + pids, "--fail_rank=1", "--fail_code=7", "--sleep"});
  EXPECT_EQ(l.Wait(), 7) << l.err();
  EXPECT_THAT(l.err(), HasSubstr("fs_launch: rank 1 (local rank 1 on node 0, pid "));
  EXPECT_THAT(l.err(), HasSubstr("exited with code 7; stopping the other 2 rank(s)"));
  EXPECT_THAT(l.err(), HasSubstr("fs_launch: job failed: rank 1 exited with code 7; exit "
                                 "status 7"));
  ExpectGone(AwaitPids(pids, 3));
}

TEST(FsLaunch, SiblingsThatIgnoreSigtermAreKilledAfterTheStopTimeout) {
  const std::string pids = NewDir();
  Launcher l;
  l.Start({"--nproc_per_node=2", "--master_port=0", "--stop_timeout_s=0.5"},
          {"--pid_dir=" + pids, "--fail_rank=0", "--fail_code=4", "--sleep", "--ignore_sigterm"});
  EXPECT_EQ(l.Wait(), 4) << l.err();
  EXPECT_THAT(l.err(), HasSubstr("still running 500ms after SIGTERM; sending SIGKILL"));
  ExpectGone(AwaitPids(pids, 2));
}

TEST(FsLaunch, ARankKilledByASignalGives128PlusTheSignal) {
  const std::string pids = NewDir();
  Launcher l;
  l.Start({"--nproc_per_node=2", "--master_port=0"},
          {"--pid_dir=" + pids, "--fail_rank=1", "--fail_signal", "--sleep"});
  EXPECT_EQ(l.Wait(), 128 + SIGKILL) << l.err();
  EXPECT_THAT(l.err(), HasSubstr("rank 1 was killed by SIGKILL (status 137)"));
  ExpectGone(AwaitPids(pids, 2));
}

// A stopped rank (SIGSTOP from outside: a debugger, a stuck cgroup freezer, a human) is
// reported at once and fails the job after --stopped_timeout_s, named; the stopped process is
// still terminated (SIGTERM is followed by SIGCONT).
TEST(FsLaunch, ARankStoppedPastItsGraceFailsTheJobNamingIt) {
  const std::string pids = NewDir();
  Launcher l;
  l.Start({"--nproc_per_node=3", "--master_port=0", "--stopped_timeout_s=1"},
          {"--pid_dir=" + pids, "--sleep"});
  const std::vector<pid_t> ranks = AwaitPids(pids, 3);
  ASSERT_EQ(kill(ranks[2], SIGSTOP), 0);
  EXPECT_EQ(l.Wait(), 128 + SIGSTOP) << l.err();
  EXPECT_THAT(l.err(), HasSubstr(absl::StrCat("fs_launch: rank 2 (local rank 2 on node 0, pid ",
                                              ranks[2], ") was stopped by SIGSTOP; the job "
                                              "fails if it is still stopped in 1s")));
  EXPECT_THAT(l.err(), HasSubstr("rank 2 has been stopped by SIGSTOP for "));
  EXPECT_THAT(l.err(), HasSubstr("exit status 147"));
  // It handled its SIGTERM (SIGCONT followed it): no SIGKILL was needed.
  EXPECT_THAT(l.err(), Not(HasSubstr("sending SIGKILL")));
  ExpectGone(ranks);
}

// A rank stopped for less than the grace and continued is only reported.
TEST(FsLaunch, ARankContinuedWithinItsGraceKeepsTheJobRunning) {
  const std::string pids = NewDir();
  Launcher l;
  l.Start({"--nproc_per_node=2", "--master_port=0", "--stopped_timeout_s=30"},
          {"--pid_dir=" + pids, "--sleep"});
  const std::vector<pid_t> ranks = AwaitPids(pids, 2);
  ASSERT_EQ(kill(ranks[1], SIGSTOP), 0);
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_EQ(kill(ranks[1], SIGCONT), 0);
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_EQ(kill(l.pid(), SIGTERM), 0);  // end the job the usual way
  EXPECT_EQ(l.Wait(), 128 + SIGTERM) << l.err();
  EXPECT_THAT(l.err(), HasSubstr("rank 1 (local rank 1 on node 0, pid "));
  EXPECT_THAT(l.err(), HasSubstr("was stopped by SIGSTOP"));
  EXPECT_THAT(l.err(), HasSubstr(absl::StrCat("rank 1 (pid ", ranks[1], ") continued after ")));
  EXPECT_THAT(l.err(), Not(HasSubstr("has been stopped")));
  ExpectGone(ranks);
}

// SIGTERM to the launcher reaches a stopped rank too (SIGCONT follows it), so the job ends
// without waiting for the SIGKILL.
TEST(FsLaunch, SigtermToTheLauncherEndsAStoppedRank) {
  const std::string pids = NewDir();
  Launcher l;
  l.Start({"--nproc_per_node=2", "--master_port=0", "--stopped_timeout_s=60",
           "--stop_timeout_s=30"},
          {"--pid_dir=" + pids, "--sleep"});
  const std::vector<pid_t> ranks = AwaitPids(pids, 2);
  ASSERT_EQ(kill(ranks[0], SIGSTOP), 0);
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_EQ(kill(l.pid(), SIGTERM), 0);
  EXPECT_EQ(l.Wait(absl::Seconds(20)), 128 + SIGTERM) << l.err();
  EXPECT_THAT(l.err(), Not(HasSubstr("sending SIGKILL")));
  ExpectGone(ranks);
}

TEST(FsLaunch, SigtermToTheLauncherIsForwardedToTheRanks) {
  const std::string pids = NewDir();
  Launcher l;
  l.Start({"--nproc_per_node=2", "--master_port=0"}, {"--pid_dir=" + pids, "--sleep"});
  const std::vector<pid_t> ranks = AwaitPids(pids, 2);
  ASSERT_EQ(kill(l.pid(), SIGTERM), 0);
  EXPECT_EQ(l.Wait(), 128 + SIGTERM) << l.err();
  EXPECT_THAT(l.err(), HasSubstr("received SIGTERM; forwarding it to 2 running rank(s)"));
  ExpectGone(ranks);
}

TEST(FsLaunch, SigintToTheLauncherIsForwardedToTheRanks) {
  const std::string pids = NewDir();
  Launcher l;
  l.Start({"--nproc_per_node=2", "--master_port=0"}, {"--pid_dir=" + pids, "--sleep"});
  const std::vector<pid_t> ranks = AwaitPids(pids, 2);
  ASSERT_EQ(kill(l.pid(), SIGINT), 0);
  EXPECT_EQ(l.Wait(), 128 + SIGINT) << l.err();
  EXPECT_THAT(l.err(), HasSubstr("received SIGINT"));
  ExpectGone(ranks);
}

// A closed terminal reaches only the launcher (the ranks have their own process groups).
TEST(FsLaunch, SighupToTheLauncherIsForwardedToTheRanks) {
  const std::string pids = NewDir();
  Launcher l;
  l.Start({"--nproc_per_node=2", "--master_port=0"}, {"--pid_dir=" + pids, "--sleep"});
  const std::vector<pid_t> ranks = AwaitPids(pids, 2);
  ASSERT_EQ(kill(l.pid(), SIGHUP), 0);
  EXPECT_EQ(l.Wait(), 128 + SIGHUP) << l.err();
  EXPECT_THAT(l.err(), HasSubstr("received SIGHUP"));
  ExpectGone(ranks);
}

TEST(FsLaunch, MaxRestartsRestartsTheWholeJob) {
  // Rank 0 fails in attempt 0 only: one restart makes the job succeed.
  Launcher l;
  l.Start({"--nproc_per_node=2", "--master_port=0", "--max_restarts=1"},
          {"--report_env", "--fail_rank=0", "--fail_until_restart=1", "--fail_code=5"});
  ASSERT_EQ(l.Wait(), 0) << l.err();
  EXPECT_THAT(l.err(), HasSubstr("rank 0 exited with code 5; restarting the job (restart 1 of "
                                 "at most 1, FS_RESTART_COUNT=1)"));
  int second_attempt = 0;
  for (const std::string& line : Lines(l.out())) {
    if (absl::StrContains(line, "FS_RESTART_COUNT=1")) {
      ++second_attempt;
      EXPECT_THAT(line, HasSubstr("FS_STORE_PREFIX=fs_launch/1/job"));
    }
  }
  EXPECT_EQ(second_attempt, 2) << l.out();
}

TEST(FsLaunch, WithoutRestartsLeftTheFailureIsTheJobStatus) {
  Launcher none;
  none.Start({"--nproc_per_node=2", "--master_port=0"},
             {"--fail_rank=0", "--fail_until_restart=1", "--fail_code=5"});
  EXPECT_EQ(none.Wait(), 5) << none.err();
  EXPECT_THAT(none.err(), Not(HasSubstr("restarting")));

  Launcher two;
  two.Start({"--nproc_per_node=2", "--master_port=0", "--max_restarts=2"},
            {"--fail_rank=1", "--fail_code=6"});
  EXPECT_EQ(two.Wait(), 6) << two.err();
  EXPECT_THAT(two.err(), HasSubstr("restart 2 of at most 2"));
  EXPECT_THAT(two.err(), HasSubstr("job failed: rank 1 exited with code 6 (after 2 restart(s))"));
}

// Replica groups: 4 ranks per node in groups of 2 ({0,1} and {2,3} on node 0), each group with
// its own restarts (2 by default), a short stop timeout.
std::vector<std::string> GroupFlags(int max_restarts = 2, int master_port = 0) {
  return {"--nproc_per_node=4", absl::StrCat("--master_port=", master_port),
          "--replica_group_size=2", absl::StrCat("--max_restarts=", max_restarts),
          "--stop_timeout_s=2"};
}

int CountLines(const std::string& text, const std::string& line) {
  int n = 0;
  for (const std::string& l : Lines(text)) n += l == line ? 1 : 0;
  return n;
}

TEST(FsLaunchReplicaGroups, OnlyTheFailedGroupIsRestarted) {
  const std::string pids = NewDir();
  Launcher l;
  // Rank 3 SIGKILLs itself in its first incarnation; every rank lives 3 s otherwise.
  l.Start(GroupFlags(),
          {"--report_env", "--report_sigterm", "--pid_dir=" + pids, "--fail_rank=3",
           "--fail_signal", "--fail_until_restart=1", "--sleep", "--sleep_s=3"});
  ASSERT_EQ(l.Wait(), 0) << l.err() << l.out();
  EXPECT_THAT(l.err(), HasSubstr("fs_launch: rank 3 (local rank 3 on node 0, pid "));
  EXPECT_THAT(l.err(), HasSubstr(") was killed by SIGKILL (status 137); restarting replica group "
                                 "1 (ranks 2-3, restart 1 of at most 2); the other groups keep "
                                 "running"));
  EXPECT_THAT(l.err(),
              HasSubstr("fs_launch: replica group 1 restarted (ranks 2-3, FS_RESTART_COUNT=1)"));
  EXPECT_THAT(l.err(), Not(HasSubstr("replica group 0")));

  const auto reports = AllEnvReports(l.out());
  ASSERT_EQ(reports.size(), 4u) << l.out();
  for (int r : {0, 1}) {  // ran once, untouched
    ASSERT_EQ(reports.at(r).size(), 1u) << l.out();
    EXPECT_EQ(reports.at(r)[0].at("FS_REPLICA_GROUP"), "0");
    EXPECT_EQ(reports.at(r)[0].at("FS_RESTART_COUNT"), "0");
    EXPECT_EQ(CountLines(l.out(), absl::StrCat("[rank ", r, "] GOT SIGTERM")), 0);
  }
  for (int r : {2, 3}) {
    ASSERT_EQ(reports.at(r).size(), 2u) << l.out();
    const EnvReport& first = reports.at(r)[0];
    const EnvReport& second = reports.at(r)[1];
    EXPECT_NE(first.at("PID"), second.at("PID"));
    for (const EnvReport* kv : {&first, &second}) {
      EXPECT_EQ(kv->at("FS_REPLICA_GROUP"), "1");
      EXPECT_EQ(kv->at("FS_REPLICA_GROUP_SIZE"), "2");
      EXPECT_EQ(kv->at("FS_NUM_REPLICA_GROUPS"), "2");
      EXPECT_EQ(kv->at("WORLD_SIZE"), "4");
      // The restarted group meets the running ones in the job's store namespace.
      EXPECT_EQ(kv->at("FS_STORE_PREFIX"), "fs_launch/0/job");
    }
    EXPECT_EQ(first.at("FS_RESTART_COUNT"), "0");
    EXPECT_EQ(second.at("FS_RESTART_COUNT"), "1");
    EXPECT_EQ(second.at("TORCHELASTIC_RESTART_COUNT"), "1");
  }
  // Rank 2 was stopped with SIGTERM for the restart; rank 3 died by itself.
  EXPECT_EQ(CountLines(l.out(), "[rank 2] GOT SIGTERM"), 1) << l.out();
  EXPECT_EQ(CountLines(l.out(), "[rank 3] GOT SIGTERM"), 0) << l.out();
}

TEST(FsLaunchReplicaGroups, AGroupOutOfRestartsFailsTheJob) {
  const std::string pids = NewDir();
  Launcher l;
  l.Start(GroupFlags(), {"--report_env", "--report_sigterm", "--pid_dir=" + pids, "--fail_rank=3",
                         "--fail_code=6", "--sleep"});
  EXPECT_EQ(l.Wait(), 6) << l.err();
  EXPECT_THAT(l.err(), HasSubstr("restarting replica group 1 (ranks 2-3, restart 1 of at most 2)"));
  EXPECT_THAT(l.err(), HasSubstr("restarting replica group 1 (ranks 2-3, restart 2 of at most 2)"));
  EXPECT_THAT(l.err(), Not(HasSubstr("restart 3 of")));
  EXPECT_THAT(l.err(), HasSubstr("fs_launch: job failed: rank 3 exited with code 6 (replica "
                                 "group 1 (ranks 2-3) is out of restarts: 2 of at most 2); "
                                 "exit status 6"));
  const auto reports = AllEnvReports(l.out());
  EXPECT_EQ(reports.at(3).size(), 3u) << l.out();
  // The other group ran once, and was stopped with the job.
  EXPECT_EQ(reports.at(0).size(), 1u) << l.out();
  EXPECT_EQ(CountLines(l.out(), "[rank 0] GOT SIGTERM"), 1) << l.out();
  EXPECT_EQ(CountLines(l.out(), "[rank 1] GOT SIGTERM"), 1) << l.out();
  ExpectGone(AwaitPids(pids, 4));
}

TEST(FsLaunchReplicaGroups, EachGroupHasItsOwnRestartCount) {
  const std::string pids = NewDir();
  Launcher l;
  // Rank 1 (group 0) and rank 2 (group 1) fail in their first incarnation: one restart each,
  // once every rank reported (--pid_dir: CI once stopped rank 3 before its first line).
  l.Start(GroupFlags(/*max_restarts=*/1),
          {"--report_env", "--pid_dir=" + pids, "--fail_rank=1,2", "--fail_code=5",
           "--fail_until_restart=1", "--sleep", "--sleep_s=2"});
  ASSERT_EQ(l.Wait(), 0) << l.err();
  EXPECT_THAT(l.err(), HasSubstr("rank 1 (local rank 1 on node 0, pid "));
  EXPECT_THAT(l.err(), HasSubstr("restarting replica group 0 (ranks 0-1, restart 1 of at most 1)"));
  EXPECT_THAT(l.err(), HasSubstr("restarting replica group 1 (ranks 2-3, restart 1 of at most 1)"));
  EXPECT_THAT(l.err(), HasSubstr("replica group 0 restarted (ranks 0-1, FS_RESTART_COUNT=1)"));
  EXPECT_THAT(l.err(), HasSubstr("replica group 1 restarted (ranks 2-3, FS_RESTART_COUNT=1)"));
  const auto reports = AllEnvReports(l.out());
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(reports.at(r).size(), 2u) << l.out();
    EXPECT_EQ(reports.at(r)[1].at("FS_RESTART_COUNT"), "1");
  }
}

// Rank 2 finished its work (exit 0) before rank 3 of its group failed: restarting the group
// would run rank 2's work again, so the job fails.
TEST(FsLaunchReplicaGroups, AGroupWithAFinishedRankIsNotRestarted) {
  const std::string pids = NewDir();
  Launcher l;
  l.Start(GroupFlags(), {"--pid_dir=" + pids, "--fail_rank=3", "--fail_code=4",
                         "--fail_after_s=0.5", "--no_sleep_rank=2", "--sleep"});
  EXPECT_EQ(l.Wait(), 4) << l.err();
  EXPECT_THAT(l.err(), HasSubstr("job failed: rank 3 exited with code 4 (replica group 1 (ranks "
                                 "2-3) is not restarted: rank 2 had already exited 0); exit "
                                 "status 4"));
  EXPECT_THAT(l.err(), Not(HasSubstr("restarting")));
  ExpectGone(AwaitPids(pids, 4));
}

TEST(FsLaunchReplicaGroups, SigtermToTheLauncherStopsEveryGroup) {
  const std::string pids = NewDir();
  Launcher l;
  l.Start(GroupFlags(), {"--pid_dir=" + pids, "--sleep"});
  const std::vector<pid_t> ranks = AwaitPids(pids, 4);
  ASSERT_EQ(kill(l.pid(), SIGTERM), 0);
  EXPECT_EQ(l.Wait(), 128 + SIGTERM) << l.err();
  EXPECT_THAT(l.err(), Not(HasSubstr("restarting")));
  ExpectGone(ranks);
}

// A group restart is the node's own affair: node 1 restarts group 3 (ranks 6-7) while node 0's
// groups and node 1's group 2 keep running, and both launchers end with status 0.
TEST(FsLaunchReplicaGroups, AGroupRestartStaysOnItsNode) {
  const std::vector<std::string> env = {"FS_STORE_TOKEN=00112233445566778899aabbccddeeff"};
  const std::vector<std::string> rank_flags = {"--report_env", "--fail_rank=7", "--fail_signal",
                                               "--fail_until_restart=1", "--sleep", "--sleep_s=2",
                                               "--fail_after_s=1"};
  Launcher node0;
  Launcher node1;
  for (int node : {0, 1}) {
    std::vector<std::string> flags = GroupFlags(/*max_restarts=*/2, /*master_port=*/29523);
    flags.push_back("--nnodes=2");
    flags.push_back(absl::StrCat("--node_rank=", node));
    (node == 0 ? node0 : node1).Start(flags, rank_flags, env);
  }
  ASSERT_EQ(node0.Wait(), 0) << node0.err();
  ASSERT_EQ(node1.Wait(), 0) << node1.err();
  EXPECT_THAT(node1.err(), HasSubstr("replica group 3 restarted (ranks 6-7, FS_RESTART_COUNT=1)"));
  EXPECT_THAT(node0.err(), Not(HasSubstr("restart")));
  const auto reports0 = AllEnvReports(node0.out());
  const auto reports1 = AllEnvReports(node1.out());
  for (int r = 0; r < 4; ++r) EXPECT_EQ(reports0.at(r).size(), 1u) << node0.out();
  for (int r = 4; r < 6; ++r) EXPECT_EQ(reports1.at(r).size(), 1u) << node1.out();
  for (int r = 6; r < 8; ++r) {
    ASSERT_EQ(reports1.at(r).size(), 2u) << node1.out();
    EXPECT_EQ(reports1.at(r)[1].at("FS_REPLICA_GROUP"), "3");
    EXPECT_EQ(reports1.at(r)[1].at("FS_NUM_REPLICA_GROUPS"), "4");
    EXPECT_EQ(reports1.at(r)[1].at("FS_RESTART_COUNT"), "1");
  }
}

TEST(FsLaunchReplicaGroups, BadGroupSizesAreRefusedNamingTheFlag) {
  Launcher l;
  l.StartRaw({"--nproc_per_node=4", "--replica-group-size=3", "--", g_fake_rank});
  EXPECT_EQ(l.Wait(), 1);
  EXPECT_THAT(l.err(),
              HasSubstr("--replica_group_size=3 must divide --nproc_per_node=4: a replica group "
                        "lies within one node"));
}

TEST(FsLaunch, PortZeroAndARealAllReduceThroughTheLaunchersStore) {
  Launcher l;
  l.Start({"--nproc_per_node=3", "--master_port=0"}, {"--all_reduce"});
  ASSERT_EQ(l.Wait(), 0) << l.err() << l.out();
  for (int r = 0; r < 3; ++r) {
    EXPECT_THAT(l.out(),
                HasSubstr(absl::StrCat("[rank ", r, "] ALLREDUCE rank=", r, " size=3 sum=6")));
  }
}

// Two launchers on one host stand for two nodes (the test runs in its own network namespace,
// so a fixed port cannot clash).
TEST(FsLaunch, TwoNodesMakeOneJobOfWorldSizeTwiceNproc) {
  const std::vector<std::string> env = {"FS_STORE_TOKEN=0123456789abcdef0123456789abcdef"};
  Launcher node0;
  Launcher node1;
  const std::vector<std::string> common = {"--nnodes=2", "--nproc_per_node=2",
                                           "--master_port=29517"};
  auto with = [&](const std::string& flag) {
    std::vector<std::string> v = common;
    v.push_back(flag);
    return v;
  };
  node0.Start(with("--node_rank=0"), {"--report_env", "--all_reduce"}, env);
  node1.Start(with("--node_rank=1"), {"--report_env", "--all_reduce"}, env);
  ASSERT_EQ(node0.Wait(), 0) << node0.err() << node0.out();
  ASSERT_EQ(node1.Wait(), 0) << node1.err() << node1.out();
  auto reports0 = EnvReports(node0.out());
  auto reports1 = EnvReports(node1.out());
  ASSERT_EQ(reports0.size(), 2u);
  ASSERT_EQ(reports1.size(), 2u);
  for (int r : {0, 1}) {
    EXPECT_EQ(reports0[r]["WORLD_SIZE"], "4");
    EXPECT_EQ(reports0[r]["GROUP_RANK"], "0");
    EXPECT_EQ(reports0[r]["LOCAL_RANK"], absl::StrCat(r));
  }
  for (int r : {2, 3}) {
    EXPECT_EQ(reports1[r]["WORLD_SIZE"], "4");
    EXPECT_EQ(reports1[r]["GROUP_RANK"], "1");
    EXPECT_EQ(reports1[r]["LOCAL_RANK"], absl::StrCat(r - 2));
    EXPECT_EQ(reports1[r]["MASTER_PORT"], "29517");
  }
  for (int r = 0; r < 4; ++r) {
    const std::string& out = r < 2 ? node0.out() : node1.out();
    EXPECT_THAT(out,
                HasSubstr(absl::StrCat("[rank ", r, "] ALLREDUCE rank=", r, " size=4 sum=10")));
  }
}

TEST(FsLaunch, AFailureOnOneNodeStopsTheOtherNodeWithTheSameStatus) {
  const std::vector<std::string> env = {"FS_STORE_TOKEN=0123456789abcdef0123456789abcdef"};
  const std::string pids = NewDir();
  const std::vector<std::string> rank_flags = {"--pid_dir=" + pids, "--fail_rank=3",
                                               "--fail_code=9", "--sleep"};
  Launcher node0;
  Launcher node1;
  node0.Start({"--nnodes=2", "--nproc_per_node=2", "--master_port=29518", "--node_rank=0"},
              rank_flags, env);
  node1.Start({"--nnodes=2", "--nproc_per_node=2", "--master_port=29518", "--node_rank=1"},
              rank_flags, env);
  EXPECT_EQ(node1.Wait(), 9) << node1.err();
  EXPECT_EQ(node0.Wait(), 9) << node0.err();
  EXPECT_THAT(node0.err(), HasSubstr("rank 3 exited with code 9 (another node)"));
  ExpectGone(AwaitPids(pids, 4));
}

TEST(FsLaunch, TwoNodesRestartTogether) {
  const std::vector<std::string> env = {"FS_STORE_TOKEN=fedcba9876543210fedcba9876543210"};
  // Rank 2 (node 1) fails in attempt 0 only; both nodes restart, and attempt 1 all-reduces.
  const std::vector<std::string> rank_flags = {
      "--report_env", "--fail_rank=2", "--fail_until_restart=1", "--fail_code=8", "--all_reduce"};
  Launcher node0;
  Launcher node1;
  node0.Start({"--nnodes=2", "--nproc_per_node=2", "--master_port=29520", "--node_rank=0",
               "--max_restarts=1"},
              rank_flags, env);
  node1.Start({"--nnodes=2", "--nproc_per_node=2", "--master_port=29520", "--node_rank=1",
               "--max_restarts=1"},
              rank_flags, env);
  ASSERT_EQ(node0.Wait(), 0) << node0.err();
  ASSERT_EQ(node1.Wait(), 0) << node1.err();
  EXPECT_THAT(node0.err(), HasSubstr("restarting the job (restart 1 of at most 1"));
  EXPECT_THAT(node1.err(), HasSubstr("restarting the job (restart 1 of at most 1"));
  // Every rank ran again in attempt 1.
  for (const Launcher* node : {&node0, &node1}) {
    int second_attempt = 0;
    for (const std::string& line : Lines(node->out())) {
      second_attempt += absl::StrContains(line, "FS_RESTART_COUNT=1") ? 1 : 0;
    }
    EXPECT_EQ(second_attempt, 2) << node->out();
  }
  for (int r = 0; r < 4; ++r) {
    const std::string& out = r < 2 ? node0.out() : node1.out();
    EXPECT_THAT(out,
                HasSubstr(absl::StrCat("[rank ", r, "] ALLREDUCE rank=", r, " size=4 sum=10")));
  }
}

TEST(FsLaunch, ErrorsBeforeAnyRankRuns) {
  Launcher no_program;
  no_program.StartRaw({"--nproc_per_node=2"});
  EXPECT_EQ(no_program.Wait(), 1);
  EXPECT_THAT(no_program.err(), HasSubstr("no program to launch"));

  Launcher missing;
  missing.StartRaw({"--master_port=0", "--", "/nonexistent/program"});
  EXPECT_EQ(missing.Wait(), 1);
  EXPECT_THAT(missing.err(), HasSubstr("cannot start rank 0"));
  EXPECT_THAT(missing.err(), HasSubstr("/nonexistent/program"));

  Launcher no_token;
  no_token.StartRaw({"--nnodes=2", "--master_port=29519", "--", g_fake_rank}, {"FS_STORE_TOKEN="});
  EXPECT_EQ(no_token.Wait(), 1);
  EXPECT_THAT(no_token.err(), HasSubstr("FS_STORE_TOKEN"));

  // A port someone else listens on: the message says what to do.
  const int busy = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(busy, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(busy, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(busy, 1), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::getsockname(busy, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  Launcher in_use;
  in_use.StartRaw({absl::StrCat("--master_port=", ntohs(addr.sin_port)), "--", g_fake_rank});
  EXPECT_EQ(in_use.Wait(), 1);
  EXPECT_THAT(in_use.err(), HasSubstr("pass --master_port=0 to pick a free one"));
  ::close(busy);
}

// The same binaries without fs_launch: the rank and size come from mpirun's or srun's variables
// (emulated here: neither launcher is installed on the build machines). Under mpirun inside an
// allocation the batch step's SLURM_* are also set, and must not win.
TEST(WithoutFsLaunch, MpirunAndSlurmVariablesAreEnoughForAnAllReduce) {
  struct Case {
    int size;
    int port;
    std::function<std::vector<std::string>(int)> env;
  };
  const std::vector<Case> cases = {
      {3, 29521,
       [](int r) {
         return std::vector<std::string>{absl::StrCat("OMPI_COMM_WORLD_RANK=", r),
                                         "OMPI_COMM_WORLD_SIZE=3",
                                         absl::StrCat("OMPI_COMM_WORLD_LOCAL_RANK=", r),
                                         "SLURM_PROCID=0",
                                         "SLURM_NTASKS=1",
                                         "MASTER_ADDR=127.0.0.1",
                                         "MASTER_PORT=29521",
                                         "FS_STORE_TOKEN=0123"};
       }},
      {2, 29522,
       [](int r) {
         // srun sets SLURM_STEP_ID for the tasks of a step (the batch step has none).
         return std::vector<std::string>{absl::StrCat("SLURM_PROCID=", r), "SLURM_NTASKS=2",
                                         absl::StrCat("SLURM_LOCALID=", r), "SLURM_STEP_ID=0",
                                         "MASTER_ADDR=127.0.0.1", "MASTER_PORT=29522"};
       }},
  };
  for (const Case& c : cases) {
    const std::string dir = NewDir();
    std::vector<pid_t> pids;
    for (int r = 0; r < c.size; ++r) {
      const std::vector<std::string> env = c.env(r);
      const int out = open(absl::StrCat(dir, "/out", r).c_str(),
                           O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      ASSERT_GE(out, 0);
      absl::StatusOr<pid_t> pid = base::Spawn(g_fake_rank, {"--all_reduce"}, env, {{out, 1}});
      close(out);
      ASSERT_TRUE(pid.ok()) << pid.status();
      pids.push_back(*pid);
    }
    const int sum = c.size * (c.size + 1) / 2;
    for (int r = 0; r < c.size; ++r) {
      absl::StatusOr<int> code = base::WaitChild(pids[r], kJobTimeout);
      ASSERT_TRUE(code.ok()) << code.status();
      EXPECT_EQ(*code, 0);
      EXPECT_EQ(ReadFile(absl::StrCat(dir, "/out", r)),
                absl::StrCat("ALLREDUCE rank=", r, " size=", c.size, " sum=", sum, "\n"));
    }
  }
}

TEST(LaunchOptions, ValidationNamesTheBadField) {
  LaunchOptions o;
  o.program = "x";
  EXPECT_TRUE(ValidateLaunchOptions(o).ok());
  auto bad = [&](auto change, const char* message) {
    LaunchOptions c = o;
    change(c);
    EXPECT_THAT(ValidateLaunchOptions(c),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(message)));
  };
  bad([](LaunchOptions& c) { c.program = ""; }, "no program");
  bad([](LaunchOptions& c) { c.nproc_per_node = 0; }, "--nproc_per_node=0");
  bad([](LaunchOptions& c) { c.nnodes = 0; }, "--nnodes=0");
  bad([](LaunchOptions& c) { c.node_rank = 1; }, "--node_rank=1 is outside [0, --nnodes=1)");
  bad([](LaunchOptions& c) { c.master_port = 70000; }, "--master_port=70000");
  bad(
      [](LaunchOptions& c) {
        c.master_port = 0;
        c.nnodes = 2;
      },
      "--master_port=0 (pick a free port) needs --nnodes=1");
  bad([](LaunchOptions& c) { c.max_restarts = -1; }, "--max_restarts=-1");
  bad([](LaunchOptions& c) { c.replica_group_size = -1; }, "--replica_group_size=-1 must be >= 0");
  bad(
      [](LaunchOptions& c) {
        c.nproc_per_node = 4;
        c.replica_group_size = 3;
      },
      "--replica_group_size=3 must divide --nproc_per_node=4");
  bad([](LaunchOptions& c) { c.stopped_timeout = absl::Seconds(-1); },
      "the stopped-rank timeout must be >= 0");
}

TEST(LaunchOptions, RankEnvAndTokens) {
  LaunchOptions o;
  o.program = "x";
  o.nproc_per_node = 4;
  o.nnodes = 3;
  o.node_rank = 2;
  o.master_addr = "node0";
  o.env = {"EXTRA=1"};
  const std::vector<std::string> env = RankEnv(o, 1, 29500, "tok", 2);
  for (const char* want :
       {"EXTRA=1", "RANK=9", "LOCAL_RANK=1", "WORLD_SIZE=12", "LOCAL_WORLD_SIZE=4", "GROUP_RANK=2",
        "MASTER_ADDR=node0", "MASTER_PORT=29500", "TORCHELASTIC_USE_AGENT_STORE=True",
        "FS_RESTART_COUNT=2", "FS_STORE_TOKEN=tok", "FS_STORE_PREFIX=fs_launch/2/job"}) {
    EXPECT_THAT(env, Contains(std::string(want)));
  }
  for (const std::string& kv : env) EXPECT_FALSE(absl::StartsWith(kv, "FS_REPLICA_GROUP")) << kv;

  // Replica groups of 2: rank 9 is in group 4 of 6, and the restart count is its group's.
  o.replica_group_size = 2;
  const std::vector<std::string> grouped = RankEnv(o, 1, 29500, "tok", 0, /*group_restarts=*/3);
  for (const char* want :
       {"FS_REPLICA_GROUP=4", "FS_REPLICA_GROUP_SIZE=2", "FS_NUM_REPLICA_GROUPS=6",
        "FS_RESTART_COUNT=3", "TORCHELASTIC_RESTART_COUNT=3", "FS_STORE_PREFIX=fs_launch/0/job"}) {
    EXPECT_THAT(grouped, Contains(std::string(want)));
  }

  const std::string a = NewStoreToken();
  const std::string b = NewStoreToken();
  EXPECT_EQ(a.size(), 32u);
  EXPECT_NE(a, b);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos) << a;
}

}  // namespace
}  // namespace fairscale::launch

int main(int argc, char** argv) {
  ::testing::InitGoogleMock(&argc, argv);
  if (argc != 3) {
    std::fprintf(stderr, "usage: fs_launch_test <fs_launch> <fake_rank>\n");
    return 2;
  }
  fairscale::launch::g_fs_launch = argv[1];
  fairscale::launch::g_fake_rank = argv[2];
  return RUN_ALL_TESTS();
}
