// The launcher library (//launch:launcher): what fs_launch does, callable from other binaries
// (a job that launches itself, integration tests). Like torchrun, it starts nproc_per_node ranks
// of `program` on this node under the environment contract that CreateCommunicatorFromEnv reads
// (comm/registry.h), and supervises them:
//
// * Node 0's launcher hosts the job's TCPStore on master_addr:master_port (port 0: the OS picks
//   one, and the ranks get the real port in MASTER_PORT); the ranks connect to it as clients
//   (TORCHELASTIC_USE_AGENT_STORE=True), presenting the job token FS_STORE_TOKEN.
// * Every line a rank writes to stdout / stderr is copied to the launcher's stdout / stderr
//   prefixed "[rank N] " (a last line without '\n' is flushed when the rank exits).
// * SIGINT / SIGTERM (and SIGHUP / SIGQUIT) to the launcher are forwarded to every rank (to its
//   process group); ranks still running stop_timeout later are SIGKILLed; a second signal
//   SIGKILLs at once.
// * When a rank exits non-zero or is killed, the others get SIGTERM (SIGKILL after
//   stop_timeout) and the job's status is that rank's: its exit code, or 128 + signal.
// * A rank that is stopped (SIGSTOP, SIGTSTP, ...) is reported at once; if it is still stopped
//   stopped_timeout later it fails the job like a rank killed by that signal (status 128 +
//   signal), naming it. Every signal the launcher sends to ranks is followed by SIGCONT, so a
//   stopped rank handles its SIGTERM instead of waiting for the SIGKILL.
// * With max_restarts = N, a failed job is stopped and started again, at most N times, with
//   FS_RESTART_COUNT = 1, 2, ... (the program resumes from its own last checkpoint) and a fresh
//   store namespace (FS_STORE_PREFIX) per attempt, so no key of a failed attempt is seen.
// * With replica_group_size = S > 0, the ranks form replica groups of S consecutive global
//   ranks (group g: ranks [g*S, (g+1)*S), within one node), and a failure restarts only the
//   failed rank's group: its other ranks get SIGTERM (SIGKILL after stop_timeout), and once all
//   are reaped they start again with the group's FS_RESTART_COUNT = 1, 2, ..., while every
//   other group keeps running untouched. max_restarts then counts per group. FS_STORE_PREFIX
//   stays that of the job (the restarted ranks meet the running ones in the store; keeping
//   incarnations apart is the program's business, e.g. //ft's epochs). A group out of restarts,
//   or one whose failed rank has a sibling that had already exited 0 (its work is done), fails
//   the job as above. A group restart is this node's own affair; only a job failure reaches
//   the other nodes.
// * Several nodes: run one launcher per node with the same nnodes / master_addr / master_port
//   and FS_STORE_TOKEN, and node_rank 0..nnodes-1. The launchers meet in the store before each
//   attempt, and a failure on any node stops (and restarts) the ranks of every node.
//
// Thread-safety: Launch installs SIGINT / SIGTERM / SIGHUP / SIGQUIT handlers and ignores
// SIGPIPE for its duration (the previous dispositions are restored on return); run one Launch
// per process at a time.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace fairscale::launch {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  // Where node 0's launcher serves the TCPStore; the ranks get it as MASTER_ADDR.
  std::string master_addr = "127.0.0.1";
  // 0: pick a free port (single node only: other nodes could not know it).
  int master_port = 29500;
  // Where node 0's TCPStore binds. Empty: master_addr for one node, every interface ("0.0.0.0")
  // for several.
  std::string store_bind_addr;
  // Restarts after a failure: of the whole job (replica_group_size 0), or of each replica group.
  int max_restarts = 0;
  // 0: a failure stops (and restarts) the whole job. S > 0: replica groups of S consecutive
  // ranks, restarted one by one; nproc_per_node must be a multiple of S.
  int replica_group_size = 0;
  // SIGTERM -> SIGKILL grace when stopping ranks.
  absl::Duration stop_timeout = absl::Seconds(5);
  // How long a rank may stay stopped (SIGSTOP, ...) before it fails the job.
  absl::Duration stopped_timeout = absl::Seconds(10);
  // How long launchers wait for each other (and non-zero nodes for node 0's store).
  absl::Duration rendezvous_timeout = absl::Minutes(5);
  // The program (a path, or a name looked up in PATH) and its arguments.
  std::string program;
  std::vector<std::string> args;
  // Extra "KEY=VALUE" for every rank (applied before the launcher's own variables).
  std::vector<std::string> env;
  // The job token. Empty: FS_STORE_TOKEN of the launcher's environment, else (one node only) a
  // fresh random one.
  std::string store_token;
  // Prefix each output line with "[rank N] ".
  bool prefix_output = true;
  // false: the ranks inherit the launcher's stdout / stderr instead of pipes (no prefixes, no
  // line splitting), e.g. for a job whose rank 0 draws a progress bar on the terminal.
  bool capture_output = true;
  // Where prefixed rank output and the launcher's own messages go.
  int stdout_fd = 1;
  int stderr_fd = 2;
};

// kInvalidArgument naming the first bad field.
absl::Status ValidateLaunchOptions(const LaunchOptions& options);

// Runs the job to its end and returns its exit status: 0 when every rank of every node exited
// 0; the failed rank's status (exit code, or 128 + signal) otherwise; 128 + signal when the
// launcher itself was told to stop. An error only when the job could not be run at all (bad
// options, the program cannot be started, the store or the launchers' rendezvous failed).
absl::StatusOr<int> Launch(const LaunchOptions& options);

// 128 random bits as 32 lowercase hex digits (the launcher's job tokens).
std::string NewStoreToken();

// The environment of one rank ("KEY=VALUE"), as Launch gives it: options.env, then RANK,
// LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT,
// TORCHELASTIC_USE_AGENT_STORE=True, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS,
// FS_RESTART_COUNT, FS_STORE_TOKEN, FS_STORE_PREFIX (fs_launch/<attempt>/job), FS_OUTPUT_PREFIXED=1
// when the launcher prefixes the rank's output lines with "[rank N] " (so the program need not
// add its own), and with replica_group_size > 0: FS_REPLICA_GROUP (the rank's group),
// FS_REPLICA_GROUP_SIZE and FS_NUM_REPLICA_GROUPS. FS_RESTART_COUNT and
// TORCHELASTIC_RESTART_COUNT are `attempt` without replica groups, `group_restarts` (the rank's
// group's restart count) with them.
std::vector<std::string> RankEnv(const LaunchOptions& options, int local_rank, int master_port,
                                 const std::string& token, int attempt, int group_restarts = 0);

}  // namespace fairscale::launch
