// TcpTransport with 2-4 ranks as threads of this process, sharing a HashStore: data movement,
// mismatches, deadlines, Cancel, and peers that fail, shut down or vanish mid-message.
#include "comm/tcp/tcp_transport.h"

#include <sys/socket.h>
#include <sys/uio.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/store/hash_store.h"
#include "comm/tcp/internal/mesh.h"
#include "comm/tcp/internal/same_host.h"
#include "comm/tcp/internal/wire.h"
#include "comm/testing/rank_runner.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::comm {
namespace {

using ::fairscale::base::testing::IsOk;
using ::fairscale::base::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;

constexpr absl::Duration kTimeout = absl::Seconds(20);

absl::Time Deadline() { return absl::Now() + kTimeout; }

// How large messages travel between ranks of this host: through the socket, or read by the
// receiver from the sender's memory (the default; ranks that are threads of one process do
// that too).
enum class Path { kSocket, kSameHost };

CommConfig Config(Path path = Path::kSameHost) {
  CommConfig config;
  config.timeout = kTimeout;
  if (path == Path::kSocket) config.options["tcp.cma_min_bytes"] = "0";
  return config;
}

using Mesh = std::vector<std::unique_ptr<TcpTransport>>;

// `literal` as a regular expression (POSIX extended) matching exactly it.
std::string Re(absl::string_view literal) {
  std::string out;
  for (char c : literal) {
    if (std::strchr("\\^$.|?*+()[]{}", c) != nullptr) out.push_back('\\');
    out.push_back(c);
  }
  return out;
}
// How errors name peer `p` of a mesh on 127.0.0.1: its rank and the address it published.
std::string PeerRe(int p) { return absl::StrCat("peer ", p, " \\(127\\.0\\.0\\.1:[0-9]+\\)"); }

// Bounds a whole mesh setup or RunRanks (each operation has its own kTimeout deadline).
constexpr absl::Duration kRunTimeout = absl::Seconds(60);

// n transports over `store`, connected by n rank threads (testing::RunThreads); a failed rank
// leaves its entry null and is reported by ExpectAllOk.
Mesh MakeMesh(int n, Path path = Path::kSameHost,
              std::shared_ptr<Store> store = std::make_shared<HashStore>()) {
  Mesh mesh(n);
  testing::ExpectAllOk(testing::RunThreads(
                           n,
                           [&](int r) -> absl::Status {
                             FS_ASSIGN_OR_RETURN(mesh[r],
                                                 TcpTransport::Create(store, r, n, Config(path)));
                             return absl::OkStatus();
                           },
                           kRunTimeout),
                       "MakeMesh");
  return mesh;
}

// Runs fn(rank, transport) as the ranks of testing::RunThreads; returns each rank's status.
std::vector<absl::Status> RunRanks(Mesh& mesh,
                                   const std::function<absl::Status(int, Transport&)>& fn) {
  return testing::RunThreads(
      static_cast<int>(mesh.size()), [&](int r) { return fn(r, *mesh[r]); }, kRunTimeout);
}

std::vector<uint8_t> Pattern(size_t bytes, int seed) {
  std::vector<uint8_t> v(bytes);
  for (size_t i = 0; i < bytes; ++i) v[i] = static_cast<uint8_t>(i * 131 + seed * 7 + (i >> 12));
  return v;
}

uint64_t Tag(uint64_t seq) { return MakeTag(OpType::kAllReduce, seq); }

// The data-path tests run over both paths.
class TcpTransportPath : public ::testing::TestWithParam<Path> {};
INSTANTIATE_TEST_SUITE_P(Paths, TcpTransportPath, ::testing::Values(Path::kSocket, Path::kSameHost),
                         [](const ::testing::TestParamInfo<Path>& info) {
                           return info.param == Path::kSocket ? "Socket" : "SameHost";
                         });

TEST(TcpTransport, SingleRankNeedsNoPeers) {
  Mesh mesh = MakeMesh(1);
  ASSERT_NE(mesh[0], nullptr);
  EXPECT_OK(mesh[0]->Wait({}, Deadline()));
  EXPECT_OK(mesh[0]->Poll());
}

TEST_P(TcpTransportPath, PingPongAllSizes) {
  Mesh mesh = MakeMesh(2, GetParam());
  const std::vector<size_t> sizes = {0, 1, 7, 8, 4096, 65537, 1 << 20, 5 << 20};
  auto statuses = RunRanks(mesh, [&](int rank, Transport& t) -> absl::Status {
    uint64_t seq = 0;
    for (size_t bytes : sizes) {
      for (int iter = 0; iter < 5; ++iter) {
        ++seq;
        std::vector<uint8_t> out = Pattern(bytes, static_cast<int>(seq)), in(bytes);
        if (rank == 0) {
          auto s = t.Isend(1, Tag(seq), out.data(), bytes);
          auto r = t.Irecv(1, Tag(seq), in.data(), bytes);
          FS_RETURN_IF_ERROR(t.Wait({s, r}, Deadline()));
        } else {
          auto r = t.Irecv(0, Tag(seq), in.data(), bytes);
          FS_RETURN_IF_ERROR(t.Wait({r}, Deadline()));
          auto s = t.Isend(0, Tag(seq), in.data(), bytes);
          FS_RETURN_IF_ERROR(t.Wait({s}, Deadline()));
        }
        if (rank == 0 && in != out) return absl::DataLossError(absl::StrCat("bytes ", bytes));
      }
    }
    return absl::OkStatus();
  });
  for (const auto& s : statuses) EXPECT_OK(s);
}

TEST_P(TcpTransportPath, ZeroByteMessagesWithNullBuffers) {
  Mesh mesh = MakeMesh(3, GetParam());
  auto statuses = RunRanks(mesh, [&](int rank, Transport& t) -> absl::Status {
    std::vector<Transport::Request> reqs;
    for (int round = 1; round <= 50; ++round) {
      for (int p = 0; p < 3; ++p) {
        if (p == rank) continue;
        reqs.push_back(t.Isend(p, MakeTag(OpType::kBarrier, round), nullptr, 0));
        reqs.push_back(t.Irecv(p, MakeTag(OpType::kBarrier, round), nullptr, 0));
      }
    }
    return t.Wait(reqs, Deadline());
  });
  for (const auto& s : statuses) EXPECT_OK(s);
}

// Every rank posts many sends of assorted sizes to every other rank before any receive, then
// all receives, then waits for everything at once.
TEST_P(TcpTransportPath, ManyMessagesAllDirectionsAtOnce) {
  constexpr int kRanks = 4;
  constexpr int kMessages = 150;
  Mesh mesh = MakeMesh(kRanks, GetParam());
  auto size_of = [](int from, int to, int i) {
    return static_cast<size_t>((i * 977 + from * 31 + to * 17) % 70000);
  };
  auto statuses = RunRanks(mesh, [&](int rank, Transport& t) -> absl::Status {
    std::vector<std::vector<uint8_t>> out, in;
    std::vector<Transport::Request> reqs;
    for (int p = 0; p < kRanks; ++p) {
      if (p == rank) continue;
      for (int i = 0; i < kMessages; ++i) {
        out.push_back(Pattern(size_of(rank, p, i), rank * 1000 + i));
        reqs.push_back(t.Isend(p, Tag(i), out.back().data(), out.back().size()));
      }
    }
    in.reserve(kRanks * kMessages);
    for (int p = 0; p < kRanks; ++p) {
      if (p == rank) continue;
      for (int i = 0; i < kMessages; ++i) {
        in.emplace_back(size_of(p, rank, i));
        reqs.push_back(t.Irecv(p, Tag(i), in.back().data(), in.back().size()));
      }
    }
    FS_RETURN_IF_ERROR(t.Wait(reqs, Deadline()));
    size_t k = 0;
    for (int p = 0; p < kRanks; ++p) {
      if (p == rank) continue;
      for (int i = 0; i < kMessages; ++i, ++k) {
        if (in[k] != Pattern(size_of(p, rank, i), p * 1000 + i)) {
          return absl::DataLossError(absl::StrCat("message ", i, " from ", p));
        }
      }
    }
    return absl::OkStatus();
  });
  for (const auto& s : statuses) EXPECT_OK(s);
}

// Both sides send 64 MiB before either receives: progress must interleave reads and writes.
TEST_P(TcpTransportPath, FullDuplexLargeMessagesDoNotDeadlock) {
  constexpr size_t kBytes = 64 << 20;
  Mesh mesh = MakeMesh(2, GetParam());
  auto statuses = RunRanks(mesh, [&](int rank, Transport& t) -> absl::Status {
    std::vector<uint8_t> out = Pattern(kBytes, rank), in(kBytes);
    const int peer = 1 - rank;
    auto s = t.Isend(peer, Tag(1), out.data(), kBytes);
    auto r = t.Irecv(peer, Tag(1), in.data(), kBytes);
    FS_RETURN_IF_ERROR(t.Wait({s}, Deadline()));
    FS_RETURN_IF_ERROR(t.Wait({r}, Deadline()));
    if (in != Pattern(kBytes, peer)) return absl::DataLossError("payload differs");
    return absl::OkStatus();
  });
  for (const auto& s : statuses) EXPECT_OK(s);
}

TEST_P(TcpTransportPath, SizeMismatchNamesPeerTagsAndSizes) {
  Mesh mesh = MakeMesh(2, GetParam());
  std::vector<uint8_t> out(40), in(80);
  auto statuses = RunRanks(mesh, [&](int rank, Transport& t) -> absl::Status {
    if (rank == 1) return t.Wait({t.Isend(0, Tag(3), out.data(), 40)}, Deadline());
    return t.Wait({t.Irecv(1, Tag(3), in.data(), 80)}, Deadline());
  });
  EXPECT_OK(statuses[1]);
  EXPECT_THAT(statuses[0],
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "peer 1 sent all_reduce #3 with 40 bytes but this rank expects "
                       "all_reduce #3 with 80 bytes"));
  // Broken for good: later calls fail with the first error.
  std::vector<uint8_t> more(8);
  auto r = mesh[0]->Irecv(1, Tag(4), more.data(), 8);
  EXPECT_THAT(mesh[0]->Wait({r}, Deadline()), StatusIs(absl::StatusCode::kInvalidArgument,
                                                       HasSubstr("with 40 bytes")));
  EXPECT_THAT(mesh[0]->Poll(), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_P(TcpTransportPath, TagMismatchNamesBothTags) {
  Mesh mesh = MakeMesh(2, GetParam());
  std::vector<uint8_t> buf(16);
  auto statuses = RunRanks(mesh, [&](int rank, Transport& t) -> absl::Status {
    if (rank == 0) {
      return t.Wait({t.Isend(1, MakeTag(OpType::kBroadcast, 7), buf.data(), 16)}, Deadline());
    }
    return t.Wait({t.Irecv(0, MakeTag(OpType::kAllGather, 7), buf.data(), 16)}, Deadline());
  });
  EXPECT_THAT(statuses[1],
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "peer 0 sent broadcast #7 with 16 bytes but this rank expects "
                       "all_gather #7 with 16 bytes"));
}

TEST(TcpTransport, DeadlineListsWhatIsPending) {
  Mesh mesh = MakeMesh(3);
  std::vector<uint8_t> buf(4096);
  Transport& t = *mesh[2];
  auto r = t.Irecv(1, Tag(3), buf.data(), buf.size());
  const absl::Time start = absl::Now();
  const absl::Status s = t.Wait({r}, absl::Now() + absl::Milliseconds(200));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kDeadlineExceeded,
                          ContainsRegex("waiting for " + PeerRe(1) + Re(": received 0/4096 bytes of all_reduce #3"))));
  EXPECT_THAT(t.Poll(), StatusIs(absl::StatusCode::kDeadlineExceeded));
}

// A send that the peer never receives stays in the kernel (the receiver reads nothing it was
// not asked for), so the sender's deadline reports how far it got.
TEST(TcpTransport, UnreceivedDataStaysInTheKernel) {
  constexpr size_t kBytes = 64 << 20;
  Mesh mesh = MakeMesh(2, Path::kSocket);
  std::vector<uint8_t> big(kBytes);
  auto s = mesh[0]->Isend(1, Tag(1), big.data(), kBytes);
  EXPECT_OK(mesh[1]->Poll());  // health check only: must not consume the message
  const absl::Status status = mesh[0]->Wait({s}, absl::Now() + absl::Milliseconds(200));
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kDeadlineExceeded,
                               HasSubstr(" bytes of all_reduce #1")));
  EXPECT_THAT(std::string(status.message()), HasSubstr(absl::StrCat("/", kBytes, " bytes")));
  EXPECT_OK(mesh[1]->Poll());
}

TEST(TcpTransport, CancelFromAnotherThreadWakesWaitPromptly) {
  Mesh mesh = MakeMesh(2);
  std::vector<uint8_t> buf(8);
  auto r = mesh[0]->Irecv(1, Tag(1), buf.data(), 8);
  absl::Time cancelled_at;
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(100));
    cancelled_at = absl::Now();
    mesh[0]->Cancel(absl::AbortedError("stop now"));
  });
  const absl::Status s = mesh[0]->Wait({r}, Deadline());
  const absl::Time returned_at = absl::Now();
  canceller.join();
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kAborted, "stop now"));
  EXPECT_LT(returned_at - cancelled_at, absl::Milliseconds(300));  // ~immediate; slack for load
  // Also the next Wait, and an OK reason becomes kAborted.
  EXPECT_THAT(mesh[0]->Wait({}, Deadline()), StatusIs(absl::StatusCode::kAborted));
  mesh[1]->Cancel(absl::OkStatus());
  EXPECT_THAT(mesh[1]->Poll(), StatusIs(absl::StatusCode::kAborted));
}

TEST(TcpTransport, PeerShutdownWithErrorFailsWaitersWithItsReason) {
  Mesh mesh = MakeMesh(3);
  std::vector<uint8_t> buf(1024);
  auto r = mesh[1]->Irecv(0, Tag(5), buf.data(), buf.size());
  std::thread killer([&] {
    absl::SleepFor(absl::Milliseconds(50));
    mesh[0]->Shutdown(absl::InternalError("all_reduce #5 rank 0/3 [tcp]: out of memory"));
  });
  const absl::Status s = mesh[1]->Wait({r}, Deadline());
  killer.join();
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kUnavailable,
                          MatchesRegex(PeerRe(0) + Re(" failed: all_reduce #5 rank 0/3 [tcp]: out of memory"))));
  // Rank 2 had nothing posted to rank 0: its idle health check notices too.
  absl::Status idle;
  for (int i = 0; i < 200 && idle.ok(); ++i) {
    idle = mesh[2]->Poll();
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_THAT(idle, StatusIs(absl::StatusCode::kUnavailable, ContainsRegex(PeerRe(0) + " failed: ")));
  // The shut-down side itself is broken with its own reason.
  EXPECT_THAT(mesh[0]->Poll(), StatusIs(absl::StatusCode::kInternal));
}

// Rank 1 fails halfway through writing a large message while rank 0 streams to it and nobody
// reads rank 0's bytes on rank 1: the shutdown completes the half-written frame, so the reason
// still reaches rank 0 behind it.
TEST_P(TcpTransportPath, PeerShutdownMidStreamStillDeliversTheReason) {
  constexpr size_t kBytes = 32 << 20;
  Mesh mesh = MakeMesh(2, GetParam());
  std::vector<uint8_t> a(kBytes), b(kBytes), c(kBytes);
  auto s = mesh[0]->Isend(1, Tag(1), a.data(), kBytes);
  auto r = mesh[0]->Irecv(1, Tag(1), b.data(), kBytes);
  auto s1 = mesh[1]->Isend(0, Tag(1), c.data(), kBytes);  // partly written, then queued
  std::thread killer([&] {
    absl::SleepFor(absl::Milliseconds(50));
    mesh[1]->Shutdown(absl::CancelledError("watchdog fired"));
  });
  const absl::Status status = mesh[0]->Wait({s, r}, Deadline());
  killer.join();
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kUnavailable, MatchesRegex(PeerRe(1) + " failed: watchdog fired")));
  EXPECT_THAT(mesh[1]->Wait({s1}, Deadline()), StatusIs(absl::StatusCode::kCancelled));
}

TEST(TcpTransport, PeerShutdownOkIsAClosedConnection) {
  Mesh mesh = MakeMesh(2);
  std::vector<uint8_t> buf(100);
  // A message sent before the shutdown is still delivered.
  auto s = mesh[0]->Isend(1, Tag(1), buf.data(), 100);
  EXPECT_OK(mesh[0]->Wait({s}, Deadline()));
  mesh[0]->Shutdown(absl::OkStatus());
  EXPECT_OK(mesh[1]->Wait({mesh[1]->Irecv(0, Tag(1), buf.data(), 100)}, Deadline()));
  auto r = mesh[1]->Irecv(0, Tag(2), buf.data(), 100);
  EXPECT_THAT(mesh[1]->Wait({r}, Deadline()),
              StatusIs(absl::StatusCode::kUnavailable, ContainsRegex(PeerRe(0) + " shut down")));
  EXPECT_THAT(mesh[0]->Poll(), StatusIs(absl::StatusCode::kAborted));
}

// Ranks finish at different times: a peer that shut down cleanly after sending still delivers
// what it sent, even when this rank noticed the close before posting the receives.
TEST_P(TcpTransportPath, CleanShutdownStillDeliversWhatThePeerSent) {
  Mesh mesh = MakeMesh(3, GetParam());
  std::vector<uint8_t> a = Pattern(100, 1), b = Pattern(32 << 10, 2);
  std::vector<Transport::Request> sends = {mesh[0]->Isend(1, Tag(1), a.data(), a.size()),
                                           mesh[0]->Isend(1, Tag(2), b.data(), b.size()),
                                           mesh[0]->Isend(1, Tag(3), nullptr, 0)};
  ASSERT_OK(mesh[0]->Wait(sends, Deadline()));
  mesh[0]->Shutdown(absl::OkStatus());
  // Rank 1's idle health checks see the close; a clean one is not an error.
  for (int i = 0; i < 20; ++i) {
    ASSERT_OK(mesh[1]->Poll());
    absl::SleepFor(absl::Milliseconds(5));
  }
  std::vector<uint8_t> ra(100), rb(32 << 10);
  EXPECT_OK(mesh[1]->Wait({mesh[1]->Irecv(0, Tag(1), ra.data(), ra.size()),
                           mesh[1]->Irecv(0, Tag(2), rb.data(), rb.size()),
                           mesh[1]->Irecv(0, Tag(3), nullptr, 0)},
                          Deadline()));
  EXPECT_EQ(ra, a);
  EXPECT_EQ(rb, b);
  // Rank 1 and rank 2 still talk to each other.
  EXPECT_OK(mesh[1]->Wait({mesh[1]->Isend(2, Tag(1), a.data(), a.size())}, Deadline()));
  EXPECT_OK(mesh[2]->Wait({mesh[2]->Irecv(1, Tag(1), ra.data(), ra.size())}, Deadline()));
  // Asking the departed peer for more is an error.
  std::vector<uint8_t> more(8);
  EXPECT_THAT(mesh[1]->Wait({mesh[1]->Irecv(0, Tag(4), more.data(), 8)}, Deadline()),
              StatusIs(absl::StatusCode::kUnavailable,
                       MatchesRegex(PeerRe(0) + Re(" shut down and closed the connection after 0/8 "
                                                 "bytes of all_reduce #4"))));
  // So is sending to it.
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_OK(mesh[2]->Poll());
  EXPECT_THAT(mesh[2]->Wait({mesh[2]->Isend(0, Tag(9), more.data(), 8)}, Deadline()),
              StatusIs(absl::StatusCode::kUnavailable,
                       ContainsRegex(PeerRe(0) + Re(" shut down and closed the connection while this "
                                                  "rank was sending all_reduce #9"))));
}

TEST(TcpTransport, DestroyedPeerIsAClosedConnection) {
  Mesh mesh = MakeMesh(2);
  std::vector<uint8_t> buf(100);
  auto r = mesh[1]->Irecv(0, Tag(9), buf.data(), 100);
  mesh[0].reset();
  EXPECT_THAT(mesh[1]->Wait({r}, Deadline()),
              StatusIs(absl::StatusCode::kUnavailable,
                       MatchesRegex(PeerRe(0) + Re(" closed the connection after 0/100 bytes of all_reduce #9"))));
}

TEST_P(TcpTransportPath, SendToClosedPeerFailsWithoutSigpipe) {
  Mesh mesh = MakeMesh(2, GetParam());
  mesh[1].reset();
  std::vector<uint8_t> buf(1 << 20);
  absl::Status s;
  for (int i = 1; i <= 20 && s.ok(); ++i) {
    s = mesh[0]->Wait({mesh[0]->Isend(1, Tag(i), buf.data(), buf.size())},
                      absl::Now() + absl::Seconds(5));
  }
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kUnavailable, ContainsRegex(PeerRe(1) + " closed the connection")));
}

// Rank 0 is a hand-rolled peer that writes part of a message and hangs up.
TEST(TcpTransport, PeerClosingMidMessageReportsByteCount) {
  auto store = std::make_shared<HashStore>();
  std::unique_ptr<TcpTransport> rank1;
  absl::Status rank1_status;
  std::thread t1([&] {
    auto t = TcpTransport::Create(store, 1, 2, Config());
    rank1_status = t.status();
    if (t.ok()) rank1 = *std::move(t);
  });
  tcp_internal::MeshOptions options;
  options.timeout = kTimeout;
  auto raw = tcp_internal::ConnectMesh(*store, 0, 2, options);
  // The hand-rolled peer declines same-host copies.
  ASSERT_OK(raw.status());
  ASSERT_OK(tcp_internal::NegotiateSameHost(*raw, 0, 0, Deadline()).status());
  t1.join();
  ASSERT_OK(rank1_status);
  const uint64_t tag = Tag(12);
  tcp_internal::FrameHeader h{static_cast<uint32_t>(tcp_internal::FrameKind::kData), 0, tag,
                              8192};
  std::vector<char> half(4096, 'x');
  iovec iov[2] = {{&h, sizeof(h)}, {half.data(), half.size()}};
  ASSERT_EQ(::writev((*raw)[1].fd.get(), iov, 2), static_cast<ssize_t>(sizeof(h) + 4096));
  std::vector<char> buf(8192);
  auto r = rank1->Irecv(0, tag, buf.data(), buf.size());
  std::thread closer([&] {
    absl::SleepFor(absl::Milliseconds(50));
    (*raw)[1].fd.Reset();
  });
  EXPECT_THAT(rank1->Wait({r}, Deadline()),
              StatusIs(absl::StatusCode::kUnavailable,
                       MatchesRegex(PeerRe(0) + Re(" closed the connection after 4096/8192 bytes of all_reduce #12"))));
  closer.join();
}

TEST(TcpTransport, UnknownOptionIsInvalidArgument) {
  CommConfig config = Config();
  config.options["tcp.nagle"] = "1";
  EXPECT_THAT(ParseTcpOptions(config),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tcp.nagle")));
  config.options.clear();
  config.options["algo.chunk_bytes"] = "4096";
  ASSERT_OK_AND_ASSIGN(TcpOptions defaults, ParseTcpOptions(config));
  EXPECT_EQ(defaults.send_buffer_bytes, 512 << 10);
  EXPECT_EQ(defaults.recv_buffer_bytes, 0);
  config.options["tcp.send_buffer_bytes"] = "0";
  config.options["tcp.recv_buffer_bytes"] = "4194304";
  ASSERT_OK_AND_ASSIGN(TcpOptions options, ParseTcpOptions(config));
  EXPECT_EQ(options.send_buffer_bytes, 0);
  EXPECT_EQ(options.recv_buffer_bytes, 4194304);
  config.options["tcp.send_buffer_bytes"] = "lots";
  EXPECT_THAT(ParseTcpOptions(config), StatusIs(absl::StatusCode::kInvalidArgument));
  config.options["tcp.send_buffer_bytes"] = "0";
  config.options["tcp.recv_buffer_bytes"] = "4096";
  EXPECT_THAT(ParseTcpOptions(config),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("below the minimum")));
}

TEST(TcpTransport, TinySocketBuffersStillMoveData) {
  auto store = std::make_shared<HashStore>();
  Mesh mesh(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      CommConfig config = Config(Path::kSocket);
      // Small buffers: every message moves in many partial writes and reads.
      config.options["tcp.send_buffer_bytes"] = "4096";
      config.options["tcp.recv_buffer_bytes"] = "65536";
      auto t = TcpTransport::Create(store, r, 2, config);
      if (t.ok()) mesh[r] = *std::move(t);
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(mesh[0] && mesh[1]);
  auto statuses = RunRanks(mesh, [&](int rank, Transport& t) -> absl::Status {
    std::vector<uint8_t> out = Pattern(3 << 20, rank), in(3 << 20);
    auto s = t.Isend(1 - rank, Tag(1), out.data(), out.size());
    auto r = t.Irecv(1 - rank, Tag(1), in.data(), in.size());
    FS_RETURN_IF_ERROR(t.Wait({s, r}, Deadline()));
    return in == Pattern(3 << 20, 1 - rank) ? absl::OkStatus() : absl::DataLossError("differs");
  });
  for (const auto& s : statuses) EXPECT_OK(s);
}

// ---- Same-host copies (PULL frames): which messages take that path, and its semantics.

// n transports whose ranks use the given tcp.cma_min_bytes values ("" = the default).
Mesh MakeMeshWith(const std::vector<std::string>& cma_min_bytes) {
  const int n = static_cast<int>(cma_min_bytes.size());
  auto store = std::make_shared<HashStore>();
  Mesh mesh(n);
  testing::ExpectAllOk(testing::RunThreads(
                           n,
                           [&](int r) -> absl::Status {
                             CommConfig config = Config();
                             if (!cma_min_bytes[r].empty()) {
                               config.options["tcp.cma_min_bytes"] = cma_min_bytes[r];
                             }
                             FS_ASSIGN_OR_RETURN(mesh[r], TcpTransport::Create(store, r, n, config));
                             return absl::OkStatus();
                           },
                           kRunTimeout),
                       "MakeMeshWith");
  return mesh;
}

// Every rank sends every other rank one message of each size (in that order) and checks what
// it receives.
absl::Status ExchangeSizes(int rank, Transport& t, const std::vector<size_t>& sizes) {
  std::vector<std::vector<uint8_t>> out, in;
  std::vector<Transport::Request> reqs;
  for (int p = 0; p < t.size(); ++p) {
    if (p == rank) continue;
    for (size_t i = 0; i < sizes.size(); ++i) {
      out.push_back(Pattern(sizes[i], rank * 100 + p * 10 + static_cast<int>(i)));
      in.emplace_back(sizes[i]);
      reqs.push_back(t.Isend(p, Tag(i + 1), out.back().data(), sizes[i]));
      reqs.push_back(t.Irecv(p, Tag(i + 1), in.back().data(), sizes[i]));
    }
  }
  FS_RETURN_IF_ERROR(t.Wait(reqs, Deadline()));
  size_t k = 0;
  for (int p = 0; p < t.size(); ++p) {
    if (p == rank) continue;
    for (size_t i = 0; i < sizes.size(); ++i, ++k) {
      if (in[k] != Pattern(sizes[i], p * 100 + rank * 10 + static_cast<int>(i))) {
        return absl::DataLossError(absl::StrCat("message of ", sizes[i], " bytes from ", p));
      }
    }
  }
  return absl::OkStatus();
}

TEST(TcpTransportSameHost, LargeMessagesAreReadFromTheSendersMemory) {
  constexpr size_t kMin = 64 << 10;  // the default threshold
  Mesh mesh = MakeMesh(3);
  for (const auto& t : mesh) EXPECT_EQ(t->same_host_peers(), 2);
  const std::vector<size_t> sizes = {0, 100, kMin - 1, kMin, (3 << 20) + 5};
  testing::ExpectAllOk(RunRanks(mesh, [&](int rank, Transport& t) {
    return ExchangeSizes(rank, t, sizes);
  }));
  // From each of 2 peers: the two messages of at least kMin.
  for (const auto& t : mesh) EXPECT_EQ(t->pulled_messages(), 4u);
}

TEST(TcpTransportSameHost, BothEndsMustAgreeAndTheLargerThresholdWins) {
  {
    Mesh mesh = MakeMeshWith({"0", ""});  // rank 0 declines: both directions use the socket
    for (const auto& t : mesh) EXPECT_EQ(t->same_host_peers(), 0);
    testing::ExpectAllOk(RunRanks(mesh, [&](int rank, Transport& t) {
      return ExchangeSizes(rank, t, {1 << 20});
    }));
    for (const auto& t : mesh) EXPECT_EQ(t->pulled_messages(), 0u);
  }
  Mesh mesh = MakeMeshWith({"1048576", "65536"});
  for (const auto& t : mesh) EXPECT_EQ(t->same_host_peers(), 1);
  testing::ExpectAllOk(RunRanks(mesh, [&](int rank, Transport& t) {
    return ExchangeSizes(rank, t, {512 << 10, (1 << 20) - 1, 1 << 20});
  }));
  for (const auto& t : mesh) EXPECT_EQ(t->pulled_messages(), 1u);
}

TEST(TcpTransportSameHost, OptionMustBeAByteCount) {
  CommConfig config = Config();
  config.options["tcp.cma_min_bytes"] = "-1";
  EXPECT_THAT(ParseTcpOptions(config),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tcp.cma_min_bytes")));
  config.options["tcp.cma_min_bytes"] = "0";
  ASSERT_OK_AND_ASSIGN(TcpOptions options, ParseTcpOptions(config));
  EXPECT_EQ(options.cma_min_bytes, 0);
}

// A pulled send completes once the receiver has read it, not before (rendezvous), and a
// deadline says so.
TEST(TcpTransportSameHost, PulledSendCompletesWhenReceived) {
  Mesh mesh = MakeMesh(2);
  std::vector<uint8_t> out = Pattern(1 << 20, 1), in(1 << 20);
  auto s = mesh[0]->Isend(1, Tag(1), out.data(), out.size());
  EXPECT_THAT(mesh[0]->Wait({s}, absl::Now() + absl::Milliseconds(100)),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       MatchesRegex("deadline exceeded while waiting for " + PeerRe(1) +
                                    Re(": waiting for peer 1 to read all_reduce #1 (1048576 "
                                       "bytes) from this rank's memory"))));
  // The receiver still gets the message: its sender was only too impatient.
  EXPECT_OK(mesh[1]->Wait({mesh[1]->Irecv(0, Tag(1), in.data(), in.size())}, Deadline()));
  EXPECT_EQ(in, out);
}

// A rank waiting for its PULL's ACK reads past what it has not posted yet: small DATA frames
// are staged and PULL frames queued, so the send completes; a DATA frame larger than the
// read-ahead budget stays in the kernel until its receive is posted, and the ACK behind it
// waits with it. Everything is delivered in order once the receives are posted.
TEST(TcpTransportSameHost, AcksAreReadAheadOfUnpostedMessages) {
  constexpr size_t kMin = 4 << 20;  // so that a 2 MiB message is a DATA frame
  Mesh mesh = MakeMeshWith({std::to_string(kMin), std::to_string(kMin)});
  const std::vector<size_t> sizes = {100, kMin, 0};
  std::vector<std::vector<uint8_t>> from1, got(3);
  for (size_t i = 0; i < sizes.size(); ++i) from1.push_back(Pattern(sizes[i], 10 + i));
  for (size_t i = 0; i < sizes.size(); ++i) got[i].resize(sizes[i]);
  std::vector<uint8_t> from0 = Pattern(kMin, 1), at1(kMin);
  // Rank 1 sends its three messages, then receives rank 0's (and acknowledges it).
  std::thread rank1([&] {
    std::vector<Transport::Request> reqs;
    for (size_t i = 0; i < sizes.size(); ++i) {
      reqs.push_back(mesh[1]->Isend(0, Tag(i + 1), from1[i].data(), sizes[i]));
    }
    reqs.push_back(mesh[1]->Irecv(0, Tag(9), at1.data(), at1.size()));
    EXPECT_OK(mesh[1]->Wait(reqs, Deadline()));
  });
  // Rank 0 waits for its send alone: the ACK is behind a staged DATA frame and a PULL.
  EXPECT_OK(mesh[0]->Wait({mesh[0]->Isend(1, Tag(9), from0.data(), from0.size())}, Deadline()));
  std::vector<Transport::Request> reqs;
  for (size_t i = 0; i < sizes.size(); ++i) {
    reqs.push_back(mesh[0]->Irecv(1, Tag(i + 1), got[i].data(), sizes[i]));
  }
  EXPECT_OK(mesh[0]->Wait(reqs, Deadline()));
  rank1.join();
  EXPECT_EQ(at1, from0);
  for (size_t i = 0; i < sizes.size(); ++i) EXPECT_EQ(got[i], from1[i]) << i;

  // Now a 2 MiB DATA frame (over the 1 MiB read-ahead budget) ahead of the ACK.
  std::vector<uint8_t> mid = Pattern(2 << 20, 5), mid_got(2 << 20), small_got(100);
  std::thread again([&] {
    EXPECT_OK(mesh[1]->Wait({mesh[1]->Isend(0, Tag(20), from1[0].data(), 100),
                             mesh[1]->Isend(0, Tag(21), mid.data(), mid.size()),
                             mesh[1]->Irecv(0, Tag(22), at1.data(), at1.size())},
                            Deadline()));
  });
  auto s = mesh[0]->Isend(1, Tag(22), from0.data(), from0.size());
  for (int i = 0; i < 20; ++i) {  // reads ahead as far as it may
    ASSERT_OK(mesh[0]->Poll());
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_OK(mesh[0]->Wait({mesh[0]->Irecv(1, Tag(20), small_got.data(), 100),
                           mesh[0]->Irecv(1, Tag(21), mid_got.data(), mid_got.size()), s},
                          Deadline()));
  again.join();
  EXPECT_EQ(small_got, std::vector<uint8_t>(from1[0].begin(), from1[0].end()));
  EXPECT_EQ(mid_got, mid);
}

TEST(TcpTransportSameHost, MismatchedPulledMessageNamesBothSizes) {
  for (const size_t expected : {size_t{512} << 10, size_t{1000}}) {
    Mesh mesh = MakeMesh(2);
    std::vector<uint8_t> out(1 << 20), in(expected + 64, 0xAB);
    auto statuses = RunRanks(mesh, [&](int rank, Transport& t) -> absl::Status {
      if (rank == 1) return t.Wait({t.Isend(0, Tag(3), out.data(), out.size())}, Deadline());
      absl::Status status = t.Wait({t.Irecv(1, Tag(3), in.data(), expected)}, Deadline());
      // As a communicator does when it breaks: the sender, whose send waits for this rank to
      // read it, learns why at once.
      if (!status.ok()) t.Shutdown(status);
      return status;
    });
    const std::string error = absl::StrCat(
        "peer 1 sent all_reduce #3 with 1048576 bytes but this rank expects all_reduce #3 with ",
        expected, " bytes");
    EXPECT_THAT(statuses[0], StatusIs(absl::StatusCode::kInvalidArgument, error));
    EXPECT_THAT(statuses[1],
                StatusIs(absl::StatusCode::kUnavailable, MatchesRegex(PeerRe(0) + Re(absl::StrCat(" failed: ", error)))));
    // Nothing was written past the posted buffer.
    for (size_t i = expected; i < in.size(); ++i) ASSERT_EQ(in[i], 0xAB) << i;
  }
}

// Ranks as processes: the copies cross process boundaries, and a PULL whose sender died is a
// clear error naming the peer and the message ("peer 1 closed the connection after 0/N bytes of
// all_reduce #1", or "reading all_reduce #1 (N bytes) from the memory of peer 1 (pid P,
// same-host copy) failed: No such process").
TEST(TcpTransportSameHost, AcrossProcesses) {
  const size_t kBytes = (3 << 20) + 1;
  testing::ExpectAllOk(testing::RunProcesses(
      3,
      [&](int rank) -> absl::Status {
        const CommConfig config = testing::RankConfig(kTimeout);
        FS_ASSIGN_OR_RETURN(auto t, TcpTransport::Create(config.store, rank, 3, config));
        FS_RETURN_IF_ERROR(testing::Check(t->same_host_peers() == 2, "same_host_peers"));
        FS_RETURN_IF_ERROR(ExchangeSizes(rank, *t, {100, kBytes}));
        return testing::Check(t->pulled_messages() == 2, "pulled_messages");
      },
      kRunTimeout));
  const auto statuses = testing::RunProcesses(
      2,
      [&](int rank) -> absl::Status {
        const CommConfig config = testing::RankConfig(kTimeout);
        FS_ASSIGN_OR_RETURN(auto t, TcpTransport::Create(config.store, rank, 2, config));
        std::vector<uint8_t> buf(kBytes);
        if (rank == 1) {
          t->Isend(0, Tag(1), buf.data(), buf.size());
          std::_Exit(3);  // with its PULL unread
        }
        absl::SleepFor(absl::Milliseconds(300));
        return t->Wait({t->Irecv(1, Tag(1), buf.data(), buf.size())}, Deadline());
      },
      kRunTimeout);
  // Either the close is noticed first or the read finds the process gone.
  EXPECT_THAT(statuses[0], StatusIs(absl::StatusCode::kUnavailable,
                                    AllOf(HasSubstr("peer 1 "), HasSubstr("all_reduce #1"))));
  EXPECT_FALSE(statuses[1].ok());
}

}  // namespace
}  // namespace fairscale::comm
