// The demo job: N ranks as real processes on 127.0.0.1 under the torchrun environment contract.
//
//   ./bazelw run //examples:demo                  # 4 ranks, tcp backend
//   ./bazelw run //examples:demo -- --nproc_per_node=3 --count=1000000
//
// Unless a launcher started it (comm::StartedByLauncher(): torchrun / fs_launch, mpirun or srun
// variables) the binary is its own small launcher: it hosts the TCPStore
// (as torchrun's agent does, TORCHELASTIC_USE_AGENT_STORE=True), spawns one copy of itself per
// rank with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set, and exits non-zero if
// any rank fails. Each rank creates its communicator with CreateCommunicatorFromEnv() and runs
// every collective once, checking each result against the value computed locally.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/flags.h"
#include "base/logging.h"
#include "base/subprocess.h"
#include "base/status_macros.h"
#include "comm/communicator.h"
#include "comm/registry.h"
#include "comm/store/tcp_store.h"

ABSL_FLAG(int, nproc_per_node, 0, "ranks to launch (0: --ranks, else 4)");
ABSL_FLAG(int, ranks, 0, "short for --nproc_per_node");
ABSL_FLAG(int64_t, count, 1 << 20, "f32 elements per rank");
ABSL_FLAG(int, timeout_s, 300, "the launcher kills ranks still running after this long");

namespace fairscale::examples {
namespace {

using comm::MakeBuffer;
using comm::MakeConstBuffer;
using comm::ReduceOp;

absl::Status Expect(bool ok, absl::string_view what) {
  if (ok) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("wrong result: ", what));
}

absl::Status RunRank() {
  FS_ASSIGN_OR_RETURN(std::shared_ptr<comm::Communicator> comm, comm::CreateCommunicatorFromEnv());
  const int r = comm->rank(), n = comm->size();
  base::SetLogRank(r, n);
  const size_t count = static_cast<size_t>(absl::GetFlag(FLAGS_count)) / n * n;
  const size_t block = count / n;

  // all_reduce: element i of rank r is r + i % 7; the sum is n(n-1)/2 + n (i % 7).
  std::vector<float> x(count), y(count);
  for (size_t i = 0; i < count; ++i) x[i] = static_cast<float>(r + i % 7);
  absl::Time t0 = absl::Now();
  FS_RETURN_IF_ERROR(
      comm->AllReduce(MakeConstBuffer(x.data(), count), MakeBuffer(y.data(), count), ReduceOp::kSum)
          .Wait());
  absl::Duration all_reduce_time = absl::Now() - t0;
  for (size_t i = 0; i < count; ++i) {
    FS_RETURN_IF_ERROR(Expect(y[i] == n * (n - 1) / 2.0f + n * static_cast<float>(i % 7),
                              "all_reduce"));
  }

  // reduce_scatter of the same input: block r of the sum.
  std::vector<float> mine(block);
  FS_RETURN_IF_ERROR(comm->ReduceScatter(MakeConstBuffer(x.data(), count),
                                         MakeBuffer(mine.data(), block), ReduceOp::kSum)
                         .Wait());
  for (size_t i = 0; i < block; ++i) {
    FS_RETURN_IF_ERROR(Expect(mine[i] == y[r * block + i], "reduce_scatter"));
  }

  // all_gather puts the blocks back together: equal to the all_reduce result.
  std::vector<float> whole(count);
  FS_RETURN_IF_ERROR(
      comm->AllGather(MakeConstBuffer(mine.data(), block), MakeBuffer(whole.data(), count)).Wait());
  FS_RETURN_IF_ERROR(Expect(whole == y, "all_gather"));

  // broadcast from the last rank.
  std::vector<int64_t> b(5, r == n - 1 ? 42 : -1);
  FS_RETURN_IF_ERROR(comm->Broadcast(MakeBuffer(b.data(), b.size()), n - 1).Wait());
  FS_RETURN_IF_ERROR(Expect(b == std::vector<int64_t>(5, 42), "broadcast"));

  // reduce (max) to rank 0.
  int32_t v = 10 * r, out = -1;
  FS_RETURN_IF_ERROR(
      comm->Reduce(MakeConstBuffer(&v, 1), MakeBuffer(&out, 1), ReduceOp::kMax, 0).Wait());
  if (r == 0) FS_RETURN_IF_ERROR(Expect(out == 10 * (n - 1), "reduce"));

  // all_to_all: send j*100 + r to rank j; receive from i: r*100 + i.
  std::vector<int32_t> s(n), recv(n);
  for (int j = 0; j < n; ++j) s[j] = j * 100 + r;
  FS_RETURN_IF_ERROR(
      comm->AllToAll(MakeConstBuffer(s.data(), n), MakeBuffer(recv.data(), n)).Wait());
  for (int i = 0; i < n; ++i) FS_RETURN_IF_ERROR(Expect(recv[i] == r * 100 + i, "all_to_all"));

  // send/recv around a ring, as one batch (every rank sends and receives at once).
  if (n > 1) {
    double token = r, got = -1;
    FS_RETURN_IF_ERROR(comm->BatchP2P({comm::P2POp::Send(MakeConstBuffer(&token, 1), (r + 1) % n),
                                       comm::P2POp::Recv(MakeBuffer(&got, 1), (r + n - 1) % n)})
                           .Wait());
    FS_RETURN_IF_ERROR(Expect(got == (r + n - 1) % n, "send/recv"));
  }

  // Split into even and odd ranks; each half sums its ranks.
  FS_ASSIGN_OR_RETURN(std::shared_ptr<comm::Communicator> half, comm->Split(r % 2, r));
  int64_t mine_r = r, half_sum = 0;
  FS_RETURN_IF_ERROR(
      half->AllReduce(MakeConstBuffer(&mine_r, 1), MakeBuffer(&half_sum, 1), ReduceOp::kSum)
          .Wait());
  int64_t expect = 0;
  for (int i = r % 2; i < n; i += 2) expect += i;
  FS_RETURN_IF_ERROR(Expect(half_sum == expect, "split all_reduce"));

  FS_RETURN_IF_ERROR(comm->Barrier().Wait());
  FS_LOG(INFO) << "all collectives correct; all_reduce of " << count * 4 / 1024 << " KiB took "
               << absl::FormatDuration(all_reduce_time) << " [" << comm->backend() << "]";
  std::printf("[rank %d/%d] OK: all_reduce, reduce_scatter, all_gather, broadcast, reduce, "
              "all_to_all, send/recv, split, barrier\n", r, n);
  return absl::OkStatus();
}

int Launch(const char* self) {
  const int ranks = absl::GetFlag(FLAGS_ranks);
  const int nproc_per_node = absl::GetFlag(FLAGS_nproc_per_node);
  if (ranks > 0 && nproc_per_node > 0 && ranks != nproc_per_node) {
    std::fprintf(stderr,
                 "demo: --ranks=%d and --nproc_per_node=%d disagree (--ranks is short for "
                 "--nproc_per_node); give one of them\n",
                 ranks, nproc_per_node);
    return 2;
  }
  const int n = nproc_per_node != 0 ? nproc_per_node : ranks != 0 ? ranks : 4;
  if (n < 1) {
    std::fprintf(stderr, "demo: --nproc_per_node must be >= 1, got %d\n", n);
    return 2;
  }
  comm::TCPStoreOptions opts;
  opts.is_server = true;
  opts.timeout = absl::Seconds(60);
  auto store = comm::TCPStore::Create(opts);
  if (!store.ok()) {
    std::fprintf(stderr, "demo: cannot start the TCPStore: %s\n", store.status().ToString().c_str());
    return 1;
  }
  std::printf("demo: launching %d ranks, store at 127.0.0.1:%d\n", n, (*store)->port());
  std::fflush(stdout);  // before the ranks write to the same terminal (or pipe)
  const int port = (*store)->port();
  const bool default_timeout = std::getenv("FS_COMM_TIMEOUT_S") == nullptr;
  std::vector<absl::StatusOr<int>> results = base::RunSelfCopies(
      n, {absl::StrCat("--count=", absl::GetFlag(FLAGS_count))},
      [&](int r) {
        std::vector<std::string> env = {
            absl::StrCat("RANK=", r),         absl::StrCat("LOCAL_RANK=", r),
            absl::StrCat("WORLD_SIZE=", n),   "MASTER_ADDR=127.0.0.1",
            absl::StrCat("MASTER_PORT=", port), "TORCHELASTIC_USE_AGENT_STORE=True",
            "FS_STORE_PROTOCOL=fairscale"};
        if (default_timeout) env.push_back("FS_COMM_TIMEOUT_S=60");
        return env;
      },
      absl::Seconds(absl::GetFlag(FLAGS_timeout_s)));
  int failed = 0;
  for (int r = 0; r < n; ++r) {
    if (!results[r].ok() || *results[r] != 0) {
      const std::string why = results[r].ok() ? absl::StrCat("exit code ", *results[r])
                                              : results[r].status().ToString();
      std::fprintf(stderr, "demo: rank %d failed: %s\n", r, why.c_str());
      ++failed;
    }
  }
  std::printf(failed ? "demo: FAILED\n" : "demo: all %d ranks OK\n", n);
  return failed ? 1 : 0;
}

constexpr char kUsage[] =
    "runs every collective once on N ranks (processes on 127.0.0.1 over tcp) and checks\n"
    "each result.\n"
    "\n"
    "  demo [--nproc_per_node=4] [--count=1048576]\n"
    "  fs_launch --nproc_per_node=4 -- demo      (under a launcher: one rank each)\n"
    "\n"
    "Environment read: RANK, or Open MPI / PMI / Slurm rank variables (set: run as that rank;\n"
    "unset: launch the ranks), WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT,\n"
    "TORCHELASTIC_USE_AGENT_STORE, FS_STORE_PROTOCOL, FS_STORE_TOKEN, FS_STORE_PREFIX\n"
    "(launch/README.md),\n"
    "FS_COMM_BACKEND, FS_COMM_TIMEOUT_S (60 when self-launched).";

}  // namespace
}  // namespace fairscale::examples

int main(int argc, char** argv) {
  fairscale::base::ParseCommandLine(argc, argv, fairscale::examples::kUsage);
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  if (!fairscale::comm::StartedByLauncher()) return fairscale::examples::Launch(argv[0]);
  absl::Status s = fairscale::examples::RunRank();
  if (!s.ok()) {
    const char* rank = std::getenv("RANK");  // unset under mpirun / srun
    std::fprintf(stderr, "[rank %s] %s\n", rank ? rank : "?", s.ToString().c_str());
    return 1;
  }
  return 0;
}
