// Re-executing the current binary as child processes (//base:subprocess): how the demo job, the
// benchmarks and the multi-process tests start their ranks on one machine.
//
// posix_spawn of /proc/self/exe, never fork(): the parent usually runs threads (stores, comm
// workers), and a forked copy of a multithreaded process may deadlock. Waiting always has a
// deadline; a child still running then is SIGKILLed.
#pragma once

#include <sys/types.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace fairscale::base {

// Starts `program` (a path; a name without '/' is looked up in PATH) with argv[0] = program,
// argv[1...] = `args` and this process's environment, in which each "KEY=VALUE" of `env`
// replaces KEY (or adds it). Each pair in `fds` makes the child's descriptor `second` a copy of
// the parent's `first` (e.g. a pipe end as fd 1). The child starts with default SIGINT,
// SIGTERM, SIGHUP, SIGQUIT and SIGPIPE handling whatever the parent did with them. With
// `new_process_group` the child leads a process group of its own (pgid = pid), so
// kill(-pid, sig) reaches its descendants too and a terminal's Ctrl-C reaches only the parent,
// which decides what to forward.
absl::StatusOr<pid_t> Spawn(const std::string& program, const std::vector<std::string>& args,
                            const std::vector<std::string>& env = {},
                            const std::vector<std::pair<int, int>>& fds = {},
                            bool new_process_group = false);

// Spawn of /proc/self/exe (this binary again).
absl::StatusOr<pid_t> SpawnSelf(const std::vector<std::string>& args,
                                const std::vector<std::string>& env = {},
                                const std::vector<std::pair<int, int>>& fds = {});

// Waits for `pid` to exit and returns its exit code (128 + signal when killed). After `timeout`
// the child is SIGKILLed and reaped, and the result is kDeadlineExceeded.
absl::StatusOr<int> WaitChild(pid_t pid, absl::Duration timeout);

// Runs n copies of this binary (argv[1...] = `args`, environment changed by env_of(rank) as in
// SpawnSelf) and waits for all of them with one deadline `timeout`; copies still running then
// are SIGKILLed. Returns one result per rank: its exit code, or the error that prevented
// spawning or waiting (kDeadlineExceeded for a killed straggler). If a spawn fails, the copies
// already started are killed.
std::vector<absl::StatusOr<int>> RunSelfCopies(
    int n, const std::vector<std::string>& args,
    const std::function<std::vector<std::string>(int rank)>& env_of, absl::Duration timeout);

}  // namespace fairscale::base
