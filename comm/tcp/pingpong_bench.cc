// Ping-pong microbenchmark of TcpTransport against Gloo's TCP transport: two threads of this
// process bounce one message back and forth over loopback, for sizes min_bytes..max_bytes
// (x4 steps by default, x2 with --fine). Rounds alternate ours and Gloo; reports the one-way time (half the round trip) and
// the ping-pong bandwidth (bytes / one-way time), best of --rounds.
//
//   ./bazelw run //comm/tcp:pingpong_bench -- --max_bytes=16777216
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/flags.h"
#include "comm/store/hash_store.h"
#include "comm/tcp/tcp_transport.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/hash_store.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/transport/unbound_buffer.h"

ABSL_FLAG(int64_t, min_bytes, 8, "smallest message");
ABSL_FLAG(int64_t, max_bytes, 16 << 20, "largest message");
ABSL_FLAG(bool, fine, false, "double the size at each step instead of x4");
ABSL_FLAG(int64_t, bytes_per_size, 128 << 20, "round trips per size = this / size, in [20, 4000]");
ABSL_FLAG(int, rounds, 5, "repetitions per size; the best is kept");
ABSL_FLAG(std::string, send_buffer_bytes, "", "tcp.send_buffer_bytes for ours (\"\": default)");
ABSL_FLAG(std::string, recv_buffer_bytes, "", "tcp.recv_buffer_bytes for ours (\"\": default)");
ABSL_FLAG(bool, gloo, true, "also measure Gloo's TCP transport");
ABSL_FLAG(bool, pin, false, "pin rank r's thread to CPU r");
ABSL_FLAG(bool, ours, true, "measure TcpTransport (--noours: Gloo alone, e.g. under perf)");

namespace fairscale::comm {
namespace {

std::vector<size_t> Sizes() {
  std::vector<size_t> sizes;
  const size_t step = absl::GetFlag(FLAGS_fine) ? 2 : 4;
  for (size_t s = absl::GetFlag(FLAGS_min_bytes); s <= size_t(absl::GetFlag(FLAGS_max_bytes));
       s *= step) {
    sizes.push_back(s);
  }
  return sizes;
}

int Iterations(size_t bytes) {
  return static_cast<int>(
      std::clamp<int64_t>(absl::GetFlag(FLAGS_bytes_per_size) / std::max<size_t>(bytes, 1),
                          20, 4000));
}

void Check(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "pingpong_bench: %s\n", s.ToString().c_str());
    std::exit(1);
  }
}

// One rank of both meshes. Rounds alternate ours and Gloo so that both see the same machine
// load (the machine is shared and noisy); the best round of each is kept.
struct Best {
  std::vector<double> ours, gloo;  // one-way seconds per size, measured on rank 0
};

void RankMain(int rank, const std::vector<size_t>& sizes, std::shared_ptr<Store> store,
              std::shared_ptr<gloo::rendezvous::HashStore> gloo_store, Best* best) {
  if (absl::GetFlag(FLAGS_pin)) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(rank, &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  }
  CommConfig config;
  config.timeout = absl::Seconds(60);
  if (std::string b = absl::GetFlag(FLAGS_send_buffer_bytes); !b.empty()) {
    config.options["tcp.send_buffer_bytes"] = b;
  }
  if (std::string b = absl::GetFlag(FLAGS_recv_buffer_bytes); !b.empty()) {
    config.options["tcp.recv_buffer_bytes"] = b;
  }
  auto created = TcpTransport::Create(store, rank, 2, config);
  Check(created.status());
  Transport& t = **created;
  const bool with_gloo = absl::GetFlag(FLAGS_gloo);
  std::shared_ptr<gloo::rendezvous::Context> context;
  if (with_gloo) {
    gloo::transport::tcp::attr attr;
    attr.hostname = "127.0.0.1";
    context = std::make_shared<gloo::rendezvous::Context>(rank, 2);
    context->setTimeout(std::chrono::seconds(60));
    auto device = gloo::transport::tcp::CreateDevice(attr);
    context->connectFullMesh(*gloo_store, device);
  }
  const int peer = 1 - rank;
  std::vector<char> buf(sizes.back(), 1);
  uint64_t seq = 0;
  uint64_t slot = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const size_t bytes = sizes[i];
    const int iters = Iterations(bytes);
    auto ub = with_gloo ? context->createUnboundBuffer(buf.data(), bytes) : nullptr;
    for (int round = 0; round < absl::GetFlag(FLAGS_rounds); ++round) {
      absl::Time start;
      for (int it = -2; it < (absl::GetFlag(FLAGS_ours) ? iters : -2); ++it) {  // 2 warm-ups
        if (it == 0) start = absl::Now();
        const uint64_t tag = MakeTag(OpType::kSend, ++seq);
        const absl::Time deadline = absl::Now() + absl::Seconds(60);
        if (rank == 0) {
          auto s = t.Isend(peer, tag, buf.data(), bytes);
          auto r = t.Irecv(peer, tag, buf.data(), bytes);
          Check(t.Wait({s, r}, deadline));
        } else {
          Check(t.Wait({t.Irecv(peer, tag, buf.data(), bytes)}, deadline));
          Check(t.Wait({t.Isend(peer, tag, buf.data(), bytes)}, deadline));
        }
      }
      if (rank == 0) {
        best->ours[i] =
            std::min(best->ours[i], absl::ToDoubleSeconds(absl::Now() - start) / (2 * iters));
      }
      if (!with_gloo) continue;
      for (int it = -2; it < iters; ++it) {
        if (it == 0) start = absl::Now();
        ++slot;
        if (rank == 0) {
          ub->send(peer, slot);
          ub->recv(peer, slot);
          ub->waitSend();
          ub->waitRecv();
        } else {
          ub->recv(peer, slot);
          ub->waitRecv();
          ub->send(peer, slot);
          ub->waitSend();
        }
      }
      if (rank == 0) {
        best->gloo[i] =
            std::min(best->gloo[i], absl::ToDoubleSeconds(absl::Now() - start) / (2 * iters));
      }
    }
  }
  t.Shutdown(absl::OkStatus());
}

std::string Size(size_t bytes) {
  if (bytes >= (1 << 20)) return absl::StrCat(bytes >> 20, " MiB");
  if (bytes >= (1 << 10)) return absl::StrCat(bytes >> 10, " KiB");
  return absl::StrCat(bytes, " B");
}

}  // namespace
}  // namespace fairscale::comm

constexpr char kUsage[] =
    "one-way time and bandwidth of TcpTransport vs Gloo's TCP transport, two\n"
    "threads over loopback, message sizes --min_bytes..--max_bytes.\n"
    "\n"
    "  pingpong_bench --max_bytes=16777216\n"
    "\n"
    "Environment read: none.";

int main(int argc, char** argv) {
  using namespace fairscale::comm;  // NOLINT
  fairscale::base::ParseCommandLine(argc, argv, kUsage);
  const std::vector<size_t> sizes = Sizes();
  Best best{std::vector<double>(sizes.size(), 1e30), std::vector<double>(sizes.size(), 1e30)};
  auto store = std::make_shared<HashStore>();
  auto gloo_store = std::make_shared<gloo::rendezvous::HashStore>();
  std::thread other(RankMain, 1, sizes, store, gloo_store, &best);
  RankMain(0, sizes, store, gloo_store, &best);
  other.join();
  const bool with_gloo = absl::GetFlag(FLAGS_gloo);
  std::printf("%10s | %12s %10s | %12s %10s\n", "size", "ours us", "ours GB/s", "gloo us",
              "gloo GB/s");
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::printf("%10s | %12.2f %10.3f", Size(sizes[i]).c_str(), best.ours[i] * 1e6,
                sizes[i] / best.ours[i] / 1e9);
    if (with_gloo) {
      std::printf(" | %12.2f %10.3f", best.gloo[i] * 1e6, sizes[i] / best.gloo[i] / 1e9);
    }
    std::printf("\n");
  }
  return 0;
}
