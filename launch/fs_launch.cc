// fs_launch: the torchrun-like launcher (see launch/README.md and launch/launcher.h).
//
//   fs_launch --nproc_per_node=4 -- ./train --steps=100
//   fs_launch --nnodes=2 --node_rank=1 --master_addr=node0 --master_port=29500
//             --nproc_per_node=8 --max_restarts=3 -- ./train --resume    (one line)
//
// torchrun's spellings are accepted too (--nproc-per-node, --master-port, ...), and the program
// may follow the flags without "--" when flags with a value use "--flag=value" or
// "--flag value". Exit status: the job's (see Launch); 1 when the job could not be run.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/time.h"
#include "base/flags.h"
#include "glog/logging.h"
#include "launch/launcher.h"

ABSL_FLAG(int, nproc_per_node, 1, "ranks to start on this node");
ABSL_FLAG(int, nnodes, 1, "number of nodes (one fs_launch per node)");
ABSL_FLAG(int, node_rank, 0, "this node's index in [0, nnodes); node 0 hosts the job store");
ABSL_FLAG(std::string, master_addr, "127.0.0.1",
          "address of node 0, where the job's TCPStore listens (MASTER_ADDR of the ranks)");
ABSL_FLAG(int, master_port, 29500,
          "port of the job's TCPStore (MASTER_PORT); 0 picks a free one (single node only)");
ABSL_FLAG(int, max_restarts, 0,
          "restart the whole job (each replica group, with --replica_group_size) at most this "
          "many times after a failure (FS_RESTART_COUNT)");
ABSL_FLAG(int, replica_group_size, 0,
          "0: a failure restarts the whole job; S > 0: groups of S consecutive ranks (S divides "
          "--nproc_per_node), and a failure stops and restarts only the failed rank's group");
ABSL_FLAG(double, stop_timeout_s, 5, "seconds between SIGTERM and SIGKILL when stopping ranks");
ABSL_FLAG(double, stopped_timeout_s, 10,
          "seconds a rank may stay stopped (SIGSTOP, SIGTSTP, ...) before it fails the job");
ABSL_FLAG(double, rdzv_timeout_s, 300,
          "seconds to wait for the other nodes' launchers (and for node 0's store)");
ABSL_FLAG(std::string, store_bind_addr, "",
          "where node 0's store binds (default: --master_addr for one node, every interface for "
          "several)");
ABSL_FLAG(bool, standalone, false,
          "torchrun's single-node mode: --nnodes=1 and a free port (--master_port=0)");
ABSL_FLAG(bool, prefix_output, true, "prefix every output line of a rank with \"[rank N] \"");

namespace {

constexpr char kUsage[] =
    "the torchrun-like launcher (launch/README.md).\n"
    "\n"
    "  fs_launch [flags] -- program [args...]\n"
    "  fs_launch --nproc_per_node=4 --master_port=0 -- bazel-bin/examples/train_gpt\n"
    "\n"
    "Starts --nproc_per_node ranks of program, hosts the job's TCPStore on node 0 and supervises\n"
    "the ranks (stop on failure, --max_restarts, per group with --replica_group_size).\n"
    "torchrun's spellings work (--nproc-per-node 4).\n"
    "\n"
    "Environment read: FS_STORE_TOKEN (the job token; generated on one node, required with\n"
    "--nnodes > 1). Set for every rank: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,\n"
    "GROUP_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE, FS_STORE_TOKEN,\n"
    "FS_STORE_PREFIX, FS_RESTART_COUNT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS,\n"
    "and with --replica_group_size: FS_REPLICA_GROUP, FS_REPLICA_GROUP_SIZE, "
    "FS_NUM_REPLICA_GROUPS.\n"
    "Passed on to the ranks: FS_SOCKET_IFNAME=<interface> (where ranks listen for each other and\n"
    "the address they advertise; default with --nnodes > 1: the local address of the route to\n"
    "--master_addr, with one node: 127.0.0.1), FS_COMM_BACKEND, UCX_*.\n"
    "Exit status: the failed rank's code, 128 + signal, or 1 when the job could not be run.";

// Whether --name takes a value (so "--name value" consumes the next argument): every known
// flag except the booleans.
bool TakesValue(const std::string& name) {
  const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  return flag != nullptr && !flag->IsOfType<bool>();
}

}  // namespace

int main(int argc, char** argv) {
  // Our flags end at "--" or at the first argument that is not a flag; torchrun's dashed
  // spellings become absl's underscores.
  std::vector<std::string> ours = {argv[0]};
  int program_at = argc;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") {
      program_at = i + 1;
      break;
    }
    if (!absl::StartsWith(a, "-")) {
      program_at = i;
      break;
    }
    const size_t eq = a.find('=');
    const size_t dashes = absl::StartsWith(a, "--") ? 2 : 1;
    std::string name = a.substr(dashes, eq == std::string::npos ? std::string::npos : eq - dashes);
    name = absl::StrReplaceAll(name, {{"-", "_"}});
    ours.push_back(absl::StrCat("--", name, eq == std::string::npos ? "" : a.substr(eq)));
    if (eq == std::string::npos && TakesValue(name) && i + 1 < argc) {
      ours.push_back(argv[++i]);
    }
  }
  std::vector<char*> ours_argv;
  for (std::string& s : ours) ours_argv.push_back(s.data());
  fairscale::base::ParseCommandLine(static_cast<int>(ours_argv.size()), ours_argv.data(), kUsage);
  // The store's log lines (glog, via //base:logging) go to stderr without glog's "Logging before
  // InitGoogleLogging" warning.
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;

  fairscale::launch::LaunchOptions o;
  o.nproc_per_node = absl::GetFlag(FLAGS_nproc_per_node);
  o.nnodes = absl::GetFlag(FLAGS_nnodes);
  o.node_rank = absl::GetFlag(FLAGS_node_rank);
  o.master_addr = absl::GetFlag(FLAGS_master_addr);
  o.master_port = absl::GetFlag(FLAGS_master_port);
  o.max_restarts = absl::GetFlag(FLAGS_max_restarts);
  o.replica_group_size = absl::GetFlag(FLAGS_replica_group_size);
  o.stop_timeout = absl::Seconds(absl::GetFlag(FLAGS_stop_timeout_s));
  o.stopped_timeout = absl::Seconds(absl::GetFlag(FLAGS_stopped_timeout_s));
  o.rendezvous_timeout = absl::Seconds(absl::GetFlag(FLAGS_rdzv_timeout_s));
  o.store_bind_addr = absl::GetFlag(FLAGS_store_bind_addr);
  o.prefix_output = absl::GetFlag(FLAGS_prefix_output);
  if (absl::GetFlag(FLAGS_standalone)) {
    if (o.nnodes != 1) {
      std::fprintf(stderr, "fs_launch: --standalone runs one node, but --nnodes=%d\n", o.nnodes);
      return 1;
    }
    o.master_port = 0;
  }
  if (program_at < argc) {
    o.program = argv[program_at];
    o.args.assign(argv + program_at + 1, argv + argc);
  }
  absl::StatusOr<int> status = fairscale::launch::Launch(o);
  if (!status.ok()) {
    std::fprintf(stderr, "%s\n", std::string(status.status().message()).c_str());
    return 1;
  }
  return *status;
}
