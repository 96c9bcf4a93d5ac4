#include "comm/store/testing/subprocess.h"

#include <errno.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

extern char** environ;

namespace fairscale::comm::testing {

absl::StatusOr<pid_t> SpawnSelf(const std::vector<std::string>& args,
                                const std::vector<std::pair<int, int>>& fds) {
  std::vector<std::string> argv_storage = {"store_test_child"};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_storage) argv.push_back(a.data());
  argv.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  for (const auto& [from, to] : fds) posix_spawn_file_actions_adddup2(&actions, from, to);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    return absl::InternalError(absl::StrCat("posix_spawn(/proc/self/exe): ", std::strerror(rc)));
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

}  // namespace fairscale::comm::testing
