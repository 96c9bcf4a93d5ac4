// Collectives benchmark: our backends (tcp; ucx over UCX's tcp and over its shared-memory
// transports) vs Gloo (Debian's libgloo, TCP transport) in the same binary and the same run, with
// single-core memcpy bandwidth as the ceiling.
//
//   ./bazelw run //comm/bench:collectives -- --ranks=2,4 --max_bytes=268435456
//
// The parent process spawns `n` copies of itself per world size (real processes on 127.0.0.1);
// each copy builds all communicators (ours through the registry, Gloo's full mesh through its
// own FileStore), then for every op and size runs rounds that alternate ours and Gloo and keeps
// the best round of each (the machine is shared and noisy). Time per op is the slowest rank's
// mean over the round's iterations. Rank 0 writes the rows; the parent prints the table.
//
// Bandwidth follows nccl-tests: algbw = S / t, busbw = algbw * factor, with S the full buffer
// (all_reduce, broadcast: the buffer; reduce_scatter: the send buffer; all_gather: the recv
// buffer) and factor 2(n-1)/n for all_reduce, (n-1)/n for reduce_scatter and all_gather, 1 for
// broadcast.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/flags.h"
#include "base/subprocess.h"
#include "comm/communicator.h"
#include "comm/registry.h"
#include "comm/store/file_store.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/broadcast.h"
#include "gloo/math.h"
#include "gloo/reduce_scatter.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/file_store.h"
#include "gloo/transport/tcp/device.h"


ABSL_FLAG(int, rank_timeout_s, 3600, "ranks still running after this long are killed");
ABSL_FLAG(std::string, ranks, "2,4", "world sizes to run");
ABSL_FLAG(int64_t, min_bytes, 4, "smallest message in bytes");
ABSL_FLAG(int64_t, max_bytes, 256 << 20, "largest message in bytes");
ABSL_FLAG(std::string, ops, "all_reduce,reduce_scatter,all_gather,broadcast", "ops to run");
ABSL_FLAG(int, rounds, 3, "alternating rounds per backend; the best is kept");
ABSL_FLAG(int64_t, bytes_per_round, 32 << 20, "iterations per round = this / size, in [3, 200]");
ABSL_FLAG(std::string, backends, "tcp,ucx,ucx-shm",
          "our backends to measure: registry names, plus ucx (= ucx with ucx.tls=tcp) and "
          "ucx-shm (= ucx with ucx.tls=posix,sysv,self), ucx-cma (posix,sysv,cma,self), "
          "ucx-env (= ucx as UCX_TLS says), tcp-socket (= tcp with tcp.cma_min_bytes=0: no "
          "same-host copies)");
ABSL_FLAG(std::string, out, "", "also write the markdown table here");
ABSL_FLAG(std::string, comm_options, "",
          "CommConfig options for our backends, e.g. "
          "algo.chunk_bytes=1048576,tcp.send_buffer_bytes=0 (tcp.* keys go to tcp only, ucx.* "
          "to ucx only)");

namespace fairscale::comm {
namespace {

using Clock = std::chrono::steady_clock;

struct Row {
  std::string op;
  int n;
  int64_t bytes;
  double gloo_us;
  std::vector<double> ours_us;  // per --backends entry
};

// The UCX transports of "ucx-shm": shared-memory FIFOs (posix, sysv) and loopback to itself.
// "ucx-cma" adds cross-memory attach (process_vm_readv, one copy for large messages); in UCX 1.13
// shared memory has no peer-failure handling, and a cma read from a dead peer aborts the reading
// process (see comm/ucx/README.md).
constexpr char kUcxShmTransports[] = "posix,sysv,self";
constexpr char kUcxCmaTransports[] = "posix,sysv,cma,self";

std::vector<std::string> Backends() {
  return absl::StrSplit(absl::GetFlag(FLAGS_backends), ',', absl::SkipEmpty());
}

// Registry name and extra options of a --backends entry.
std::pair<std::string, std::map<std::string, std::string>> ResolveBackend(const std::string& b) {
  if (b == "ucx") return {"ucx", {{"ucx.tls", "tcp"}}};
  if (b == "ucx-shm") return {"ucx", {{"ucx.tls", kUcxShmTransports}}};
  if (b == "ucx-cma") return {"ucx", {{"ucx.tls", kUcxCmaTransports}}};
  if (b == "ucx-env") return {"ucx", {}};  // UCX's own choice (UCX_TLS etc. from the environment)
  if (b == "tcp-socket") return {"tcp", {{"tcp.cma_min_bytes", "0"}}};  // no same-host copies
  return {b, {}};
}

double BusFactor(const std::string& op, int n) {
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "broadcast") return 1.0;
  return static_cast<double>(n - 1) / n;
}

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "collectives: %s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

// Elements of f32 per buffer for an op whose full buffer is `bytes`; reduce_scatter and
// all_gather split it in n blocks, so there it is rounded up to a multiple of n.
size_t Elements(const std::string& op, int64_t bytes, int n) {
  size_t e = std::max<int64_t>(bytes / 4, 1);
  if (op == "reduce_scatter" || op == "all_gather") e = (e + n - 1) / n * n;
  return e;
}

class RankBench {
 public:
  RankBench(int rank, int n, const std::string& dir) : rank_(rank), n_(n) {
    auto file_store = FileStore::Create(dir + "/ours");
    Check(file_store.status(), "file store");
    const std::shared_ptr<Store> store(*std::move(file_store));
    for (const std::string& b : Backends()) {
      auto [name, extra] = ResolveBackend(b);
      CommConfig config;
      config.rank = rank;
      config.size = n;
      config.timeout = absl::Minutes(2);
      config.name = b;
      config.store = store;
      for (absl::string_view kv : absl::StrSplit(absl::GetFlag(FLAGS_comm_options), ',',
                                                 absl::SkipEmpty())) {
        std::pair<std::string, std::string> parts = absl::StrSplit(kv, absl::MaxSplits('=', 1));
        const bool other = (absl::StartsWith(parts.first, "tcp.") && name != "tcp") ||
                           (absl::StartsWith(parts.first, "ucx.") && name != "ucx");
        if (!other) config.options[parts.first] = parts.second;
      }
      for (const auto& [key, value] : extra) config.options[key] = value;
      auto comm = CreateCommunicator(name, config);
      Check(comm.status(), "create our communicator");
      comms_.push_back(*std::move(comm));
    }
    ours_ = comms_.at(0);

    gloo::transport::tcp::attr attr;
    attr.hostname = "127.0.0.1";
    auto dev = gloo::transport::tcp::CreateDevice(attr);
    gloo::rendezvous::FileStore gloo_store(dir + "/gloo");
    gloo_ = std::make_shared<gloo::rendezvous::Context>(rank, n);
    gloo_->setTimeout(std::chrono::minutes(2));
    gloo_->connectFullMesh(gloo_store, dev);
  }

  // Seconds per op, max over ranks, for one round of `iters` iterations.
  double TimeOurs(size_t backend, const std::string& op, size_t elems, int iters) {
    Prepare(elems);
    Communicator* const comm = comms_.at(backend).get();
    auto run = [&]() -> absl::Status {
      const size_t block = elems / n_;
      if (op == "all_reduce") {
        return comm->AllReduce(MakeConstBuffer(a_.data(), elems), MakeBuffer(b_.data(), elems),
                               ReduceOp::kSum).Wait();
      } else if (op == "reduce_scatter") {
        return comm->ReduceScatter(MakeConstBuffer(a_.data(), elems),
                                   MakeBuffer(b_.data(), block), ReduceOp::kSum).Wait();
      } else if (op == "all_gather") {
        return comm->AllGather(MakeConstBuffer(a_.data(), block), MakeBuffer(b_.data(), elems))
            .Wait();
      } else {
        return comm->Broadcast(MakeBuffer(a_.data(), elems), 0).Wait();
      }
    };
    Check(run(), "warm-up");
    Check(comm->Barrier().Wait(), "barrier");
    auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i) Check(run(), op.c_str());
    return MaxOverRanks(std::chrono::duration<double>(Clock::now() - t0).count() / iters);
  }

  double TimeGloo(const std::string& op, size_t elems, int iters) {
    Prepare(elems);
    const size_t block = elems / n_;
    std::unique_ptr<gloo::ReduceScatterHalvingDoubling<float>> rs;
    if (op == "reduce_scatter") {
      std::vector<int> recv(n_, static_cast<int>(block));
      rs = std::make_unique<gloo::ReduceScatterHalvingDoubling<float>>(
          gloo_, std::vector<float*>{a_.data()}, static_cast<int>(elems), recv);
    }
    uint32_t tag = 0;
    auto run = [&]() {
      ++tag;
      if (op == "all_reduce") {
        gloo::AllreduceOptions opts(gloo_);
        opts.setInput(a_.data(), elems);
        opts.setOutput(b_.data(), elems);
        opts.setTag(tag);
        opts.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(
            &gloo::sum<float>));
        gloo::allreduce(opts);
      } else if (op == "reduce_scatter") {
        rs->run();
      } else if (op == "all_gather") {
        gloo::AllgatherOptions opts(gloo_);
        opts.setInput(a_.data(), block);
        opts.setOutput(b_.data(), elems);
        opts.setTag(tag);
        gloo::allgather(opts);
      } else {
        gloo::BroadcastOptions opts(gloo_);
        opts.setOutput(a_.data(), elems);
        opts.setRoot(0);
        opts.setTag(tag);
        gloo::broadcast(opts);
      }
    };
    run();
    Check(ours_->Barrier().Wait(), "barrier");
    auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i) run();
    return MaxOverRanks(std::chrono::duration<double>(Clock::now() - t0).count() / iters);
  }

 private:
  void Prepare(size_t elems) {
    if (a_.size() < elems) {
      a_.assign(elems, 1.0f + rank_);
      b_.assign(elems, 0.0f);
    }
  }

  double MaxOverRanks(double v) {
    Check(ours_->AllReduce(MakeConstBuffer(&v, 1), MakeBuffer(&v, 1), ReduceOp::kMax).Wait(),
          "max over ranks");
    return v;
  }

  const int rank_, n_;
  std::vector<std::shared_ptr<Communicator>> comms_;  // per --backends entry
  std::shared_ptr<Communicator> ours_;                // the first: barriers and max-over-ranks
  std::shared_ptr<gloo::rendezvous::Context> gloo_;
  std::vector<float> a_, b_;
};

std::vector<int64_t> Sizes() {
  std::vector<int64_t> sizes;
  for (int64_t s = absl::GetFlag(FLAGS_min_bytes); s <= absl::GetFlag(FLAGS_max_bytes); s *= 4) {
    sizes.push_back(s);
  }
  return sizes;
}

int RunRank(int rank, int n, const std::string& dir) {
  RankBench bench(rank, n, dir);
  std::vector<std::string> ops = absl::StrSplit(absl::GetFlag(FLAGS_ops), ',');
  std::ofstream out;
  if (rank == 0) out.open(dir + "/rows.tsv");
  const int rounds = std::max(1, absl::GetFlag(FLAGS_rounds));
  for (const std::string& op : ops) {
    size_t previous_elems = 0;
    for (int64_t bytes : Sizes()) {
      const size_t elems = Elements(op, bytes, n);
      if (elems == previous_elems) continue;  // rounded up to the same size as the last one
      previous_elems = elems;
      const int iters = static_cast<int>(std::clamp<int64_t>(
          absl::GetFlag(FLAGS_bytes_per_round) / std::max<int64_t>(bytes, 1), 3, 200));
      const size_t nb = Backends().size();
      std::vector<double> ours(nb, 1e30);
      double gloo = 1e30;
      for (int r = 0; r < rounds; ++r) {
        // Alternate the order so no one always runs on a warmer machine.
        if (r % 2 == 0) {
          for (size_t b = 0; b < nb; ++b) {
            ours[b] = std::min(ours[b], bench.TimeOurs(b, op, elems, iters));
          }
          gloo = std::min(gloo, bench.TimeGloo(op, elems, iters));
        } else {
          gloo = std::min(gloo, bench.TimeGloo(op, elems, iters));
          for (size_t b = nb; b-- > 0;) {
            ours[b] = std::min(ours[b], bench.TimeOurs(b, op, elems, iters));
          }
        }
      }
      if (rank == 0) {
        out << op << "\t" << n << "\t" << elems * 4 << "\t" << gloo * 1e6;
        std::string line = absl::StrFormat("  %-14s n=%d %10zu B  gloo %10.1f us", op, n,
                                           elems * 4, gloo * 1e6);
        for (size_t b = 0; b < nb; ++b) {
          out << "\t" << ours[b] * 1e6;
          absl::StrAppendFormat(&line, "  %s %10.1f us", Backends()[b], ours[b] * 1e6);
        }
        out << "\n";
        out.flush();
        std::fprintf(stderr, "%s\n", line.c_str());
      }
    }
  }
  return 0;
}

// Single-core memcpy bandwidth (GB/s) for `bytes`, best of a few runs.
double MemcpyGBps(int64_t bytes) {
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  const int iters = static_cast<int>(std::clamp<int64_t>((64 << 20) / bytes, 3, 10000));
  double best = 1e30;
  for (int r = 0; r < 3; ++r) {
    auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i) {
      std::memcpy(dst.data(), src.data(), bytes);
      asm volatile("" : : "r"(dst.data()) : "memory");
    }
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count() / iters);
  }
  return bytes / best / 1e9;
}

// Single-core memcpy bandwidth (GB/s) for `bytes` with neither buffer in cache: the copies
// rotate through distinct buffers spanning >= 256 MiB (more than the last-level cache), so each
// runs at DRAM speed, as an all-reduce of that size does (the send, receive and scratch buffers
// of both ranks do not fit in cache). 0 below 1 MiB, where "out of cache" means nothing.
double MemcpyColdGBps(int64_t bytes) {
  if (bytes < (int64_t{1} << 20)) return 0;
  const int64_t pairs = std::max<int64_t>(2, (int64_t{256} << 20) / (2 * bytes));
  std::vector<std::vector<char>> src(pairs, std::vector<char>(bytes, 1));
  std::vector<std::vector<char>> dst(pairs, std::vector<char>(bytes, 0));
  double best = 1e30;
  for (int r = 0; r < 3; ++r) {
    auto t0 = Clock::now();
    for (int64_t i = 0; i < pairs; ++i) {
      std::memcpy(dst[i].data(), src[i].data(), bytes);
      asm volatile("" : : "r"(dst[i].data()) : "memory");
    }
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count() / pairs);
  }
  return bytes / best / 1e9;
}

int RunWorld(int n, const char* self, std::vector<Row>* rows) {
  std::string base = std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp";
  std::string dir_template = base + "/fs_bench_XXXXXX";
  std::vector<char> buf(dir_template.begin(), dir_template.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) == nullptr) return 1;
  std::string dir = buf.data();
  if (mkdir((dir + "/gloo").c_str(), 0700) != 0) {
    std::perror("mkdir");
    return 1;
  }
  std::vector<absl::StatusOr<int>> results = base::RunSelfCopies(
      n, {absl::StrCat("--min_bytes=", absl::GetFlag(FLAGS_min_bytes)),
                                     absl::StrCat("--max_bytes=", absl::GetFlag(FLAGS_max_bytes)),
                                     absl::StrCat("--ops=", absl::GetFlag(FLAGS_ops)),
                                     absl::StrCat("--rounds=", absl::GetFlag(FLAGS_rounds)),
                                     absl::StrCat("--bytes_per_round=",
                                                  absl::GetFlag(FLAGS_bytes_per_round)),
                                     absl::StrCat("--backends=", absl::GetFlag(FLAGS_backends)),
                                     absl::StrCat("--comm_options=",
                                                  absl::GetFlag(FLAGS_comm_options))},
      [&](int r) -> std::vector<std::string> {
        return {absl::StrCat("FS_BENCH_RANK=", r), absl::StrCat("FS_BENCH_SIZE=", n),
                absl::StrCat("FS_BENCH_DIR=", dir)};
      },
      absl::Seconds(absl::GetFlag(FLAGS_rank_timeout_s)));
  int failed = 0;
  for (int r = 0; r < n; ++r) {
    if (!results[r].ok() || *results[r] != 0) {
      std::fprintf(stderr, "collectives: rank %d: %s\n", r,
                   results[r].ok() ? absl::StrCat("exit code ", *results[r]).c_str()
                                   : results[r].status().ToString().c_str());
      ++failed;
    }
  }
  if (failed) {
    std::fprintf(stderr, "collectives: %d of %d ranks failed\n", failed, n);
    return 1;
  }
  std::ifstream in(dir + "/rows.tsv");
  std::string line;
  while (std::getline(in, line)) {
    std::vector<std::string> f = absl::StrSplit(line, '\t');
    if (f.size() != 4 + Backends().size()) continue;
    Row row;
    row.op = f[0];
    (void)absl::SimpleAtoi(f[1], &row.n);
    (void)absl::SimpleAtoi(f[2], &row.bytes);
    (void)absl::SimpleAtod(f[3], &row.gloo_us);
    for (size_t b = 0; b < Backends().size(); ++b) {
      row.ours_us.push_back(0);
      (void)absl::SimpleAtod(f[4 + b], &row.ours_us.back());
    }
    rows->push_back(row);
  }
  return 0;
}

std::string HumanBytes(int64_t b) {
  if (b >= (1 << 20)) return absl::StrCat(b >> 20, " MiB");
  if (b >= (1 << 10)) return absl::StrCat(b >> 10, " KiB");
  return absl::StrCat(b, " B");
}

int Main(const char* self) {
  std::vector<Row> rows;
  for (absl::string_view r : absl::StrSplit(absl::GetFlag(FLAGS_ranks), ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(r, &n) || n < 1) {
      std::fprintf(stderr, "collectives: bad --ranks entry '%s'\n", std::string(r).c_str());
      return 2;
    }
    std::fprintf(stderr, "world size %d:\n", n);
    if (RunWorld(n, self, &rows) != 0) return 1;
  }
  std::map<int64_t, double> memcpy_gbps, memcpy_cold_gbps;
  for (const Row& row : rows) {
    if (!memcpy_gbps.count(row.bytes)) {
      memcpy_gbps[row.bytes] = MemcpyGBps(row.bytes);
      memcpy_cold_gbps[row.bytes] = MemcpyColdGBps(row.bytes);
    }
  }
  // Per backend: time, busbw and busbw relative to Gloo's; then Gloo and memcpy.
  const std::vector<std::string> backends = Backends();
  std::string table = "| op | ranks | size |";
  std::string rule = "|---|---|---|";
  for (const std::string& b : backends) {
    absl::StrAppend(&table, " ", b, " us | ", b, " busbw GB/s | ", b, "/gloo |");
    absl::StrAppend(&rule, "---|---|---|");
  }
  absl::StrAppend(&table, " gloo us | gloo busbw GB/s | memcpy GB/s | memcpy cold GB/s |\n", rule,
                  "---|---|---|---|\n");
  for (const Row& row : rows) {
    const double f = BusFactor(row.op, row.n);
    const double gloo_bw = row.bytes / (row.gloo_us * 1e-6) / 1e9 * f;
    absl::StrAppendFormat(&table, "| %s | %d | %s |", row.op, row.n, HumanBytes(row.bytes));
    for (size_t b = 0; b < backends.size(); ++b) {
      const double bw = row.bytes / (row.ours_us[b] * 1e-6) / 1e9 * f;
      absl::StrAppendFormat(&table, " %.1f | %.3f | %.2f |", row.ours_us[b], bw,
                            row.gloo_us / row.ours_us[b]);
    }
    absl::StrAppendFormat(&table, " %.1f | %.3f | %.2f | %s |\n", row.gloo_us, gloo_bw,
                          memcpy_gbps[row.bytes],
                          memcpy_cold_gbps[row.bytes] > 0
                              ? absl::StrFormat("%.2f", memcpy_cold_gbps[row.bytes])
                              : std::string("-"));
  }
  std::fputs(table.c_str(), stdout);
  if (!absl::GetFlag(FLAGS_out).empty()) std::ofstream(absl::GetFlag(FLAGS_out)) << table;
  return 0;
}

}  // namespace
}  // namespace fairscale::comm

constexpr char kUsage[] =
    "our backends (tcp, ucx) vs Gloo per collective and message size, ranks as\n"
    "processes on 127.0.0.1, with memcpy bandwidth as the ceiling (comm/bench/README.md).\n"
    "\n"
    "  collectives --ranks=2,4 --max_bytes=268435456\n"
    "\n"
    "Environment read: TEST_TMPDIR (where the ranks' directory goes, else /tmp);\n"
    "FS_BENCH_RANK, FS_BENCH_SIZE, FS_BENCH_DIR are set by the benchmark for its ranks.";

int main(int argc, char** argv) {
  fairscale::base::ParseCommandLine(argc, argv, kUsage);
  const char* rank = std::getenv("FS_BENCH_RANK");
  if (rank != nullptr) {
    return fairscale::comm::RunRank(std::atoi(rank), std::atoi(std::getenv("FS_BENCH_SIZE")),
                                    std::getenv("FS_BENCH_DIR"));
  }
  return fairscale::comm::Main(argv[0]);
}
