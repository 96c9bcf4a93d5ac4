// Child processes for the multi-process store tests (//comm/store/testing:subprocess).
//
// A test binary re-executes itself (posix_spawn of /proc/self/exe, never fork: the parent has
// threads, and a forked copy of a multithreaded process may deadlock) with arguments that its
// main() recognizes before handing the rest to GoogleTest.
#pragma once

#include <sys/types.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace fairscale::comm::testing {

// Starts /proc/self/exe with `args` (argv[1...]). Each pair in `fds` makes the child's
// descriptor `second` a copy of the parent's `first` (e.g. a pipe end as fd 3).
absl::StatusOr<pid_t> SpawnSelf(const std::vector<std::string>& args,
                                const std::vector<std::pair<int, int>>& fds = {});

// Waits for `pid` to exit and returns its exit code (128 + signal when killed). After `timeout`
// the child is killed and the result is kDeadlineExceeded.
absl::StatusOr<int> WaitChild(pid_t pid, absl::Duration timeout);

}  // namespace fairscale::comm::testing
