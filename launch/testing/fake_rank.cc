// fake_rank (//launch/testing:fake_rank): a tiny program for fs_launch's tests, run as every
// rank. What it does is set by flags, in this order:
//   --report_env     print "ENV RANK=.. LOCAL_RANK=.. ... PID=.." (one line, stdout)
//   --report_sigterm on SIGTERM print "GOT SIGTERM" and exit 143 (from the start)
//   --pid_dir=D      write its pid to D/rank_<RANK>.pid (atomically), so a test can find it
//   --lines=N        print N lines "line i of rank R" to stdout and one to stderr, and end with
//                    a partial line "tail of rank R" without '\n'
//   --store          connect to MASTER_ADDR:MASTER_PORT with FS_STORE_TOKEN; set and read a key
//   --all_reduce     CreateCommunicatorFromEnv (tcp) and all-reduce the ranks: prints the sum
//   --fail_rank=R,.. on these ranks (while FS_RESTART_COUNT < --fail_until_restart, default
//                    always), once every rank wrote its pid file when --pid_dir is set, and
//                    --fail_after_s later: exit --fail_code, or with --fail_signal kill itself
//                    with SIGKILL
//   --sleep          then sleep until killed (at most --sleep_s), except on --no_sleep_rank
//   --ignore_sigterm ignore SIGTERM (from the start)
// and exits 0.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/registry.h"
#include "comm/store/tcp_store.h"

ABSL_FLAG(bool, report_env, false, "print the launcher's variables");
ABSL_FLAG(std::string, pid_dir, "", "write the pid to <dir>/rank_<RANK>.pid");
ABSL_FLAG(int, lines, 0, "lines to print");
ABSL_FLAG(bool, store, false, "use the job's TCPStore with FS_STORE_TOKEN");
ABSL_FLAG(bool, all_reduce, false, "all-reduce over a tcp communicator from the environment");
ABSL_FLAG(bool, report_sigterm, false, "print GOT SIGTERM on SIGTERM, then exit 143");
ABSL_FLAG(std::vector<std::string>, fail_rank, {}, "the ranks that fail");
ABSL_FLAG(double, fail_after_s, 0, "how long a failing rank waits before failing");
ABSL_FLAG(int, fail_code, 3, "its exit code");
ABSL_FLAG(bool, fail_signal, false, "fail by SIGKILLing itself");
ABSL_FLAG(int, fail_until_restart, 1 << 30, "fail only while FS_RESTART_COUNT is below this");
ABSL_FLAG(bool, sleep, false, "sleep until killed");
ABSL_FLAG(double, sleep_s, 120, "longest sleep");
ABSL_FLAG(std::vector<std::string>, no_sleep_rank, {}, "ranks that exit 0 at once, not sleeping");
ABSL_FLAG(bool, ignore_sigterm, false, "ignore SIGTERM");

namespace {

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "<unset>" : v;
}

int IntEnv(const char* name, int fallback) {
  int v = 0;
  const char* s = std::getenv(name);
  return s != nullptr && absl::SimpleAtoi(s, &v) ? v : fallback;
}

// Whether `rank` is in the list of a rank-list flag.
bool Listed(const std::vector<std::string>& ranks, int rank) {
  for (const std::string& r : ranks) {
    int v = 0;
    if (absl::SimpleAtoi(r, &v) && v == rank) return true;
  }
  return false;
}

void OnSigterm(int) {
  constexpr char kMessage[] = "GOT SIGTERM\n";
  (void)!write(1, kMessage, sizeof(kMessage) - 1);
  _exit(128 + SIGTERM);
}

int UseStore(int rank) {
  fairscale::comm::TCPStoreOptions o;
  o.host = Env("MASTER_ADDR");
  o.port = IntEnv("MASTER_PORT", 0);
  o.token = std::getenv("FS_STORE_TOKEN") == nullptr ? "" : Env("FS_STORE_TOKEN");
  o.timeout = absl::Seconds(30);
  auto store = fairscale::comm::TCPStore::Create(o);
  if (!store.ok()) {
    std::fprintf(stderr, "STORE FAILED %s\n", store.status().ToString().c_str());
    return 4;
  }
  const std::string key = absl::StrCat("fake_rank/", rank);
  absl::Status s = (*store)->Set(key, absl::StrCat("hello from ", rank));
  absl::StatusOr<std::string> v = (*store)->Get(key, absl::Seconds(10));
  if (!s.ok() || !v.ok()) {
    std::fprintf(stderr, "STORE FAILED %s %s\n", s.ToString().c_str(),
                 v.status().ToString().c_str());
    return 4;
  }
  std::printf("STORE OK %s\n", v->c_str());
  return 0;
}

int AllReduce() {
  auto comm = fairscale::comm::CreateCommunicatorFromEnv();
  if (!comm.ok()) {
    std::fprintf(stderr, "ALLREDUCE FAILED %s\n", comm.status().ToString().c_str());
    return 5;
  }
  int64_t mine = (*comm)->rank() + 1;
  int64_t sum = 0;
  absl::Status s =
      (*comm)
          ->AllReduce(fairscale::comm::MakeConstBuffer(&mine, 1),
                      fairscale::comm::MakeBuffer(&sum, 1), fairscale::comm::ReduceOp::kSum)
          .Wait(absl::Seconds(60));
  if (!s.ok()) {
    std::fprintf(stderr, "ALLREDUCE FAILED %s\n", s.ToString().c_str());
    return 5;
  }
  std::printf("ALLREDUCE rank=%d size=%d sum=%lld\n", (*comm)->rank(), (*comm)->size(),
              static_cast<long long>(sum));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  // Before the pid file exists: a test that sees it may already be stopping the job.
  if (absl::GetFlag(FLAGS_ignore_sigterm)) signal(SIGTERM, SIG_IGN);
  if (absl::GetFlag(FLAGS_report_sigterm)) signal(SIGTERM, &OnSigterm);
  const int rank = IntEnv("RANK", -1);
  if (absl::GetFlag(FLAGS_report_env)) {
    std::printf(
        "ENV RANK=%s LOCAL_RANK=%s WORLD_SIZE=%s LOCAL_WORLD_SIZE=%s GROUP_RANK=%s "
        "MASTER_ADDR=%s MASTER_PORT=%s TORCHELASTIC_USE_AGENT_STORE=%s FS_RESTART_COUNT=%s "
        "FS_STORE_PREFIX=%s FS_STORE_TOKEN_LEN=%zu TORCHELASTIC_RESTART_COUNT=%s "
        "FS_REPLICA_GROUP=%s FS_REPLICA_GROUP_SIZE=%s FS_NUM_REPLICA_GROUPS=%s PID=%d\n",
        Env("RANK").c_str(), Env("LOCAL_RANK").c_str(), Env("WORLD_SIZE").c_str(),
        Env("LOCAL_WORLD_SIZE").c_str(), Env("GROUP_RANK").c_str(), Env("MASTER_ADDR").c_str(),
        Env("MASTER_PORT").c_str(), Env("TORCHELASTIC_USE_AGENT_STORE").c_str(),
        Env("FS_RESTART_COUNT").c_str(), Env("FS_STORE_PREFIX").c_str(),
        std::getenv("FS_STORE_TOKEN") == nullptr ? 0 : std::string(Env("FS_STORE_TOKEN")).size(),
        Env("TORCHELASTIC_RESTART_COUNT").c_str(), Env("FS_REPLICA_GROUP").c_str(),
        Env("FS_REPLICA_GROUP_SIZE").c_str(), Env("FS_NUM_REPLICA_GROUPS").c_str(),
        static_cast<int>(getpid()));
    std::fflush(stdout);  // out before the pid file: a failing rank waits for those
  }
  if (const std::string dir = absl::GetFlag(FLAGS_pid_dir); !dir.empty()) {
    const std::string path = absl::StrCat(dir, "/rank_", rank, ".pid");
    const std::string tmp = absl::StrCat(path, ".tmp");
    {
      std::ofstream f(tmp);
      f << getpid() << "\n";
    }
    std::rename(tmp.c_str(), path.c_str());
  }
  for (int i = 0; i < absl::GetFlag(FLAGS_lines); ++i) {
    std::printf("line %d of rank %d\n", i, rank);
  }
  if (absl::GetFlag(FLAGS_lines) > 0) {
    std::fprintf(stderr, "stderr of rank %d\n", rank);
    std::printf("tail of rank %d", rank);
  }
  std::fflush(stdout);
  if (absl::GetFlag(FLAGS_store)) {
    if (const int rc = UseStore(rank); rc != 0) return rc;
  }
  if (absl::GetFlag(FLAGS_all_reduce)) {
    if (const int rc = AllReduce(); rc != 0) return rc;
  }
  std::fflush(stdout);
  if (Listed(absl::GetFlag(FLAGS_fail_rank), rank) &&
      IntEnv("FS_RESTART_COUNT", 0) < absl::GetFlag(FLAGS_fail_until_restart)) {
    // Fail while the others are surely running: once all their pid files exist (bounded).
    if (const std::string dir = absl::GetFlag(FLAGS_pid_dir); !dir.empty()) {
      const int n = IntEnv("WORLD_SIZE", 1);
      const absl::Time deadline = absl::Now() + absl::Seconds(60);
      for (int r = 0; r < n && absl::Now() < deadline;) {
        if (access(absl::StrCat(dir, "/rank_", r, ".pid").c_str(), F_OK) == 0) {
          ++r;
        } else {
          absl::SleepFor(absl::Milliseconds(20));
        }
      }
    }
    absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_fail_after_s)));
    if (absl::GetFlag(FLAGS_fail_signal)) kill(getpid(), SIGKILL);
    return absl::GetFlag(FLAGS_fail_code);
  }
  if (absl::GetFlag(FLAGS_sleep) && !Listed(absl::GetFlag(FLAGS_no_sleep_rank), rank)) {
    absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_sleep_s)));
  }
  return 0;
}
