#include "base/subprocess.h"

#include <errno.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstring>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

extern char** environ;

namespace fairscale::base {
namespace {

absl::string_view KeyOf(absl::string_view entry) {
  const size_t eq = entry.find('=');
  return eq == absl::string_view::npos ? entry : entry.substr(0, eq);
}

}  // namespace

absl::StatusOr<pid_t> SpawnSelf(const std::vector<std::string>& args,
                                const std::vector<std::string>& env,
                                const std::vector<std::pair<int, int>>& fds) {
  return Spawn("/proc/self/exe", args, env, fds);
}

absl::StatusOr<pid_t> Spawn(const std::string& program, const std::vector<std::string>& args,
                            const std::vector<std::string>& env,
                            const std::vector<std::pair<int, int>>& fds, bool new_process_group) {
  std::vector<std::string> argv_storage = {program};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_storage) argv.push_back(a.data());
  argv.push_back(nullptr);

  // getenv() returns the first match, so a replaced key must not also be inherited.
  absl::flat_hash_set<absl::string_view> replaced;
  for (const std::string& e : env) replaced.insert(KeyOf(e));
  std::vector<std::string> env_storage;
  for (char** e = environ; *e != nullptr; ++e) {
    if (!replaced.contains(KeyOf(*e))) env_storage.emplace_back(*e);
  }
  env_storage.insert(env_storage.end(), env.begin(), env.end());
  std::vector<char*> envp;
  for (std::string& e : env_storage) envp.push_back(e.data());
  envp.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  for (const auto& [from, to] : fds) posix_spawn_file_actions_adddup2(&actions, from, to);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t defaults;
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGINT);
  sigaddset(&defaults, SIGTERM);
  sigaddset(&defaults, SIGPIPE);
  sigaddset(&defaults, SIGHUP);
  sigaddset(&defaults, SIGQUIT);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  short flags = POSIX_SPAWN_SETSIGDEF;
  if (new_process_group) {
    flags |= POSIX_SPAWN_SETPGROUP;
    posix_spawnattr_setpgroup(&attr, 0);
  }
  posix_spawnattr_setflags(&attr, flags);
  pid_t pid = 0;
  const bool search_path = program.find('/') == std::string::npos;
  const int rc = search_path ? posix_spawnp(&pid, program.c_str(), &actions, &attr, argv.data(),
                                            envp.data())
                             : posix_spawn(&pid, program.c_str(), &actions, &attr, argv.data(),
                                           envp.data());
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    return absl::Status(rc == ENOENT || rc == EACCES ? absl::StatusCode::kNotFound
                                                     : absl::StatusCode::kInternal,
                        absl::StrCat("posix_spawn(", program, "): ", std::strerror(rc)));
  }
  return pid;
}

absl::StatusOr<int> WaitChild(pid_t pid, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) {
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
      continue;
    }
    if (r < 0 && errno != EINTR) {
      return absl::InternalError(absl::StrCat("waitpid(", pid, "): ", std::strerror(errno)));
    }
    if (absl::Now() >= deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return absl::DeadlineExceededError(
          absl::StrCat("child ", pid, " still running after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
}

std::vector<absl::StatusOr<int>> RunSelfCopies(
    int n, const std::vector<std::string>& args,
    const std::function<std::vector<std::string>(int rank)>& env_of, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::vector<absl::StatusOr<int>> results(n, absl::UnknownError("not started"));
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    absl::StatusOr<pid_t> pid = SpawnSelf(args, env_of(r));
    if (!pid.ok()) {
      for (int k = 0; k < r; ++k) {
        kill(pids[k], SIGKILL);
        results[k] = WaitChild(pids[k], absl::Seconds(10));
      }
      results[r] = pid.status();
      return results;
    }
    pids.push_back(*pid);
  }
  for (int r = 0; r < n; ++r) {
    results[r] = WaitChild(pids[r], std::max(deadline - absl::Now(), absl::ZeroDuration()));
  }
  return results;
}

}  // namespace fairscale::base
