#include "comm/testing/rank_runner.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "comm/store/file_store.h"
#include "comm/store/hash_store.h"
#include "gtest/gtest.h"

extern char** environ;

namespace fairscale::comm::testing {
namespace {

// Environment of a child process. FS_TEST_RANK, FS_TEST_WORLD_SIZE and FS_TEST_STORE_DIR are
// the documented ones; the others are the runner's bookkeeping.
constexpr char kEnvRank[] = "FS_TEST_RANK";
constexpr char kEnvWorldSize[] = "FS_TEST_WORLD_SIZE";
constexpr char kEnvStoreDir[] = "FS_TEST_STORE_DIR";
constexpr char kEnvResultFile[] = "FS_TEST_RESULT_FILE";
constexpr char kEnvRunIndex[] = "FS_TEST_RUN_INDEX";
constexpr char kEnvParentPid[] = "FS_TEST_PARENT_PID";

// A failing child exits with kExitBase + status code (OK exits 0), so the code survives even if
// the result file could not be written.
constexpr int kExitBase = 100;
// Lines of each child's output printed by the parent (the tail, if longer).
constexpr size_t kMaxPrintedLines = 2000;

thread_local const RankInfo* t_rank_info = nullptr;
const RankInfo* g_process_rank_info = nullptr;  // set in a child process while its body runs

class ScopedRankInfo {
 public:
  explicit ScopedRankInfo(const RankInfo* info) : prev_(t_rank_info) { t_rank_info = info; }
  ~ScopedRankInfo() { t_rank_info = prev_; }
  ScopedRankInfo(const ScopedRankInfo&) = delete;
  ScopedRankInfo& operator=(const ScopedRankInfo&) = delete;

 private:
  const RankInfo* prev_;
};

absl::Status RunBody(const RankBody& body, int rank) {
  try {
    return body(rank);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("rank ", rank, " threw: ", e.what()));
  } catch (...) {
    return absl::InternalError(absl::StrCat("rank ", rank, " threw a non-std exception"));
  }
}

std::vector<absl::Status> AllRanks(int n, const absl::Status& status) {
  return std::vector<absl::Status>(n > 0 ? n : 0, status);
}

// ---------------------------------------------------------------------------------------------
// Threads.

struct ThreadRun {
  explicit ThreadRun(int n, RankBody b) : body(std::move(b)), results(n), finished(n, false) {}
  const RankBody body;
  const std::shared_ptr<Store> store = std::make_shared<HashStore>();
  absl::Mutex mu;
  int done ABSL_GUARDED_BY(mu) = 0;
  std::vector<absl::Status> results ABSL_GUARDED_BY(mu);
  std::vector<bool> finished ABSL_GUARDED_BY(mu);
};

// ---------------------------------------------------------------------------------------------
// Processes.

std::string Getenv(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "" : v;
}

int EnvInt(const char* name, int fallback) {
  int v = 0;
  return absl::SimpleAtoi(Getenv(name), &v) ? v : fallback;
}

// The ordinal of this RunProcesses call within the current test (1, 2, ...).
int NextRunIndex(const std::string& test_name) {
  static absl::Mutex mu(absl::kConstInit);
  static std::string* last_test ABSL_PT_GUARDED_BY(mu) = new std::string();
  static int calls ABSL_GUARDED_BY(mu) = 0;
  absl::MutexLock lock(&mu);
  if (*last_test != test_name) {
    *last_test = test_name;
    calls = 0;
  }
  return ++calls;
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents) {
  const std::string tmp = absl::StrCat(path, ".tmp");
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
    out.flush();
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot rename ", tmp, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

bool ReadFile(const std::string& path, std::string* contents) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::stringstream ss;
  ss << in.rdbuf();
  *contents = ss.str();
  return true;
}

// "<code>\n<message>" <-> absl::Status.
std::string EncodeStatus(const absl::Status& s) {
  return absl::StrCat(static_cast<int>(s.code()), "\n", s.message());
}

bool DecodeStatus(absl::string_view text, absl::Status* s) {
  const size_t nl = text.find('\n');
  if (nl == absl::string_view::npos) return false;
  int code = 0;
  if (!absl::SimpleAtoi(text.substr(0, nl), &code) || code < 0 || code > 16) return false;
  *s = absl::Status(static_cast<absl::StatusCode>(code), text.substr(nl + 1));
  return true;
}

// The child side of RunProcesses: runs the body as this process's rank and never returns.
[[noreturn]] void RunChild(int n, const RankBody& body) {
  const int rank = EnvInt(kEnvRank, -1);
  const std::string result_file = Getenv(kEnvResultFile);
  // Die with the parent (e.g. when Bazel kills a test that overran), so no rank outlives it.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != EnvInt(kEnvParentPid, -1)) _exit(kExitBase + static_cast<int>(
                                                           absl::StatusCode::kAborted));

  absl::Status status;
  if (rank < 0 || rank >= n || EnvInt(kEnvWorldSize, -1) != n) {
    status = absl::InternalError(absl::StrCat("rank process started with ", kEnvRank, "=",
                                              Getenv(kEnvRank), " ", kEnvWorldSize, "=",
                                              Getenv(kEnvWorldSize), " but the test runs ", n,
                                              " ranks"));
  } else {
    absl::StatusOr<std::unique_ptr<FileStore>> store = FileStore::Create(Getenv(kEnvStoreDir));
    if (!store.ok()) {
      status = absl::Status(store.status().code(),
                            absl::StrCat("opening the rank runner's FileStore: ",
                                         store.status().message()));
    } else {
      RankInfo info;
      info.rank = rank;
      info.size = n;
      info.runner = RunnerKind::kProcesses;
      info.store = std::shared_ptr<Store>(std::move(store).value());
      base::SetLogRank(rank, n);
      base::ScopedLogRank log_rank(rank, n);
      ScopedRankInfo scoped(&info);
      g_process_rank_info = &info;
      status = RunBody(body, rank);
      g_process_rank_info = nullptr;
      if (status.ok() && ::testing::Test::HasFailure()) {
        status = absl::InternalError(absl::StrCat(
            "rank ", rank, " returned OK but a gtest assertion failed in its process (see its "
            "output)"));
      }
    }
  }
  std::cout.flush();
  std::cerr << "[rank " << rank << "] finished: " << status << std::endl;
  if (!result_file.empty()) {
    absl::Status written = WriteFileAtomically(result_file, EncodeStatus(status));
    if (!written.ok()) std::cerr << "[rank " << rank << "] " << written << std::endl;
  }
  std::fflush(nullptr);
  _exit(status.ok() ? 0 : kExitBase + static_cast<int>(status.code()));
}

// Environment variables a child must not inherit: gtest's sharding and output files (a child
// would filter its test away or overwrite the parent's XML) and a parent's runner variables.
bool StripFromChildEnv(absl::string_view entry) {
  const absl::string_view name = entry.substr(0, entry.find('='));
  if (absl::StartsWith(name, "GTEST_") || absl::StartsWith(name, "FS_TEST_")) return true;
  for (absl::string_view bad :
       {"TEST_SHARD_INDEX", "TEST_TOTAL_SHARDS", "TEST_SHARD_STATUS_FILE", "XML_OUTPUT_FILE",
        "TEST_PREMATURE_EXIT_FILE", "TESTBRIDGE_TEST_ONLY", "TEST_WARNINGS_OUTPUT_FILE"}) {
    if (name == bad) return true;
  }
  return false;
}

// A gtest filter that matches exactly `name`: '-' and ':' are filter syntax, so they become the
// one-character wildcard '?'.
std::string ExactFilter(const std::string& name) {
  std::string f = name;
  for (char& c : f) {
    if (c == '-' || c == ':' || c == '*') c = '?';
  }
  return f;
}

struct Child {
  pid_t pid = -1;
  bool running = false;
  bool timed_out = false;
  int wait_status = 0;
  std::string log_file;
  std::string result_file;
};

void PrintChildOutput(int rank, const std::string& log_file) {
  std::string text;
  if (!ReadFile(log_file, &text) || text.empty()) return;
  std::vector<absl::string_view> lines = absl::StrSplit(text, '\n');
  if (!lines.empty() && lines.back().empty()) lines.pop_back();
  const std::string prefix = absl::StrCat("[rank ", rank, "] ");
  const std::string own_prefix = absl::StrCat("[rank ", rank, "]");
  std::string out;
  size_t first = 0;
  if (lines.size() > kMaxPrintedLines) {
    first = lines.size() - kMaxPrintedLines;
    absl::StrAppend(&out, prefix, "... ", first, " earlier lines omitted\n");
  }
  for (size_t i = first; i < lines.size(); ++i) {
    absl::StrAppend(&out, absl::StartsWith(lines[i], own_prefix) ? "" : prefix, lines[i], "\n");
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
  std::fflush(stdout);
}

absl::Status ChildStatus(int rank, int n, const Child& c, absl::Duration timeout) {
  if (c.timed_out) {
    return absl::DeadlineExceededError(absl::StrCat("rank ", rank, "/", n,
                                                    " was still running after ",
                                                    absl::FormatDuration(timeout),
                                                    "; the runner killed it"));
  }
  if (WIFSIGNALED(c.wait_status)) {
    const int sig = WTERMSIG(c.wait_status);
    return absl::InternalError(absl::StrCat("rank ", rank, "/", n, " was killed by signal ", sig,
                                            " (", strsignal(sig), ")"));
  }
  const int code = WIFEXITED(c.wait_status) ? WEXITSTATUS(c.wait_status) : -1;
  std::string text;
  absl::Status reported;
  if (ReadFile(c.result_file, &text) && DecodeStatus(text, &reported)) return reported;
  if (code > kExitBase && code <= kExitBase + 16) {
    return absl::Status(static_cast<absl::StatusCode>(code - kExitBase),
                        absl::StrCat("rank ", rank, "/", n, " exited with code ", code,
                                     " (its status message was lost)"));
  }
  return absl::InternalError(absl::StrCat(
      "rank ", rank, "/", n, " exited with code ", code,
      " without reporting a status (did the child run the test up to RunProcesses? a gtest "
      "filter mismatch, an ASSERT before the call, or exit() in the body all look like this)"));
}

}  // namespace

absl::string_view RunnerKindName(RunnerKind kind) {
  return kind == RunnerKind::kThreads ? "threads" : "processes";
}

const RankInfo* CurrentRank() {
  return t_rank_info != nullptr ? t_rank_info : g_process_rank_info;
}

CommConfig RankConfig(absl::Duration timeout) {
  const RankInfo* info = CurrentRank();
  if (info == nullptr) {
    std::fprintf(stderr, "RankConfig() called outside a RunThreads/RunProcesses rank body\n");
    std::abort();
  }
  CommConfig config;
  config.rank = info->rank;
  config.size = info->size;
  config.store = info->store;
  config.timeout = timeout;
  return config;
}

bool IsRankProcess() { return std::getenv(kEnvRank) != nullptr; }

std::vector<absl::Status> RunThreads(int n, RankBody body, absl::Duration timeout) {
  if (n < 1) return {};
  auto run = std::make_shared<ThreadRun>(n, std::move(body));
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int r = 0; r < n; ++r) {
    // The thread owns a reference to `run`, so a detached straggler never touches freed state.
    threads.emplace_back([run, r, n] {
      base::ScopedLogRank log_rank(r, n);
      RankInfo info;
      info.rank = r;
      info.size = n;
      info.runner = RunnerKind::kThreads;
      info.store = run->store;
      ScopedRankInfo scoped(&info);
      absl::Status s = RunBody(run->body, r);
      absl::MutexLock lock(&run->mu);
      run->results[r] = std::move(s);
      run->finished[r] = true;
      ++run->done;
    });
  }
  std::vector<absl::Status> results(n);
  std::vector<bool> finished;
  {
    absl::MutexLock lock(&run->mu);
    auto all_done = [&run, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(run->mu) {
      return run->done == n;
    };
    run->mu.AwaitWithTimeout(absl::Condition(&all_done), timeout);
    finished = run->finished;
    for (int r = 0; r < n; ++r) {
      if (finished[r]) results[r] = run->results[r];
    }
  }
  for (int r = 0; r < n; ++r) {
    if (finished[r]) {
      threads[r].join();
    } else {
      threads[r].detach();
      results[r] = absl::DeadlineExceededError(
          absl::StrCat("rank ", r, "/", n, " was still running after ",
                       absl::FormatDuration(timeout), "; its thread was detached"));
      std::fprintf(stderr, "RunThreads: rank %d/%d still running after %s; detached\n", r, n,
                   absl::FormatDuration(timeout).c_str());
    }
  }
  return results;
}

std::vector<absl::Status> RunProcesses(int n, RankBody body, absl::Duration timeout) {
  if (n < 1) return {};
  const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
  if (test == nullptr) {
    return AllRanks(n, absl::FailedPreconditionError(
                           "RunProcesses must be called from inside a gtest test body"));
  }
  const std::string test_name = absl::StrCat(test->test_suite_name(), ".", test->name());
  const int run_index = NextRunIndex(test_name);

  if (IsRankProcess()) {
    if (EnvInt(kEnvRunIndex, -1) == run_index) RunChild(n, body);
    // An earlier call of this test: the parent has already run it.
    return AllRanks(n, absl::OkStatus());
  }

  std::string base_dir = Getenv("TEST_TMPDIR");
  if (base_dir.empty()) base_dir = Getenv("TMPDIR");
  if (base_dir.empty()) base_dir = "/tmp";
  std::string dir_template = absl::StrCat(base_dir, "/fs_ranks_XXXXXX");
  if (mkdtemp(dir_template.data()) == nullptr) {
    return AllRanks(n, absl::InternalError(absl::StrCat("mkdtemp(", dir_template,
                                                        "): ", std::strerror(errno))));
  }
  const std::string dir = dir_template;

  std::vector<std::string> base_env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    if (!StripFromChildEnv(*e)) base_env.emplace_back(*e);
  }
  const std::string filter_flag = absl::StrCat("--gtest_filter=", ExactFilter(test_name));

  std::vector<Child> children(n);
  std::vector<absl::Status> spawn_errors(n);
  for (int r = 0; r < n; ++r) {
    Child& c = children[r];
    c.log_file = absl::StrCat(dir, "/rank", r, ".log");
    c.result_file = absl::StrCat(dir, "/rank", r, ".status");
    std::vector<std::string> env = base_env;
    env.push_back(absl::StrCat(kEnvRank, "=", r));
    env.push_back(absl::StrCat(kEnvWorldSize, "=", n));
    env.push_back(absl::StrCat(kEnvStoreDir, "=", dir, "/store"));
    env.push_back(absl::StrCat(kEnvResultFile, "=", c.result_file));
    env.push_back(absl::StrCat(kEnvRunIndex, "=", run_index));
    env.push_back(absl::StrCat(kEnvParentPid, "=", getpid()));
    std::vector<char*> envp;
    for (std::string& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);

    std::string exe = "/proc/self/exe";
    std::string filter = filter_flag;
    std::string brief = "--gtest_brief=1";
    std::string disabled = "--gtest_also_run_disabled_tests";
    std::string color = "--gtest_color=no";
    std::vector<char*> argv = {exe.data(), filter.data(), brief.data(), disabled.data(),
                               color.data(), nullptr};

    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, c.log_file.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    // The parent's threads may block signals or ignore SIGPIPE; a child starts clean.
    sigset_t none, all;
    sigemptyset(&none);
    sigfillset(&all);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setsigdefault(&attr, &all);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    const int err = posix_spawn(&c.pid, exe.c_str(), &actions, &attr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attr);
    if (err != 0) {
      spawn_errors[r] = absl::InternalError(
          absl::StrCat("posix_spawn of rank ", r, " failed: ", std::strerror(err)));
      c.pid = -1;
    } else {
      c.running = true;
    }
  }

  // Wait for every child, polling so that one deadline bounds the whole run.
  const absl::Time deadline = absl::Now() + timeout;
  int running = 0;
  for (const Child& c : children) running += c.running ? 1 : 0;
  while (running > 0) {
    for (Child& c : children) {
      if (!c.running) continue;
      int st = 0;
      const pid_t got = waitpid(c.pid, &st, WNOHANG);
      if (got == c.pid || (got < 0 && errno != EINTR)) {
        c.wait_status = st;
        c.running = false;
        --running;
      }
    }
    if (running == 0) break;
    if (absl::Now() >= deadline) {
      for (Child& c : children) {
        if (!c.running) continue;
        kill(c.pid, SIGKILL);
        int st = 0;
        while (waitpid(c.pid, &st, 0) < 0 && errno == EINTR) {
        }
        c.running = false;
        c.timed_out = true;
      }
      break;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }

  std::vector<absl::Status> results(n);
  for (int r = 0; r < n; ++r) {
    if (!spawn_errors[r].ok()) {
      results[r] = spawn_errors[r];
      continue;
    }
    PrintChildOutput(r, children[r].log_file);
    results[r] = ChildStatus(r, n, children[r], timeout);
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  return results;
}

std::vector<absl::Status> RunRanks(RunnerKind kind, int n, RankBody body,
                                   absl::Duration timeout) {
  return kind == RunnerKind::kThreads ? RunThreads(n, std::move(body), timeout)
                                      : RunProcesses(n, std::move(body), timeout);
}

void ExpectAllOk(const std::vector<absl::Status>& statuses, absl::string_view what) {
  const size_t n = statuses.size();
  for (size_t r = 0; r < n; ++r) {
    EXPECT_TRUE(statuses[r].ok()) << what << (what.empty() ? "" : " ") << "rank " << r << "/" << n
                                  << ": " << statuses[r];
  }
}

absl::Status Check(bool ok, absl::string_view what) {
  return ok ? absl::OkStatus() : absl::InternalError(what);
}

}  // namespace fairscale::comm::testing
