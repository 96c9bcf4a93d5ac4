// Fuzz target for the tcp backend's receive path: a real TcpTransport (rank 0 or 1 of 2) over one
// end of a socketpair, the fuzzer playing the peer by writing bytes into the other end. Built two
// ways: //comm/tcp/fuzz:tcp_transport_fuzz_test (gcc; seeds plus deterministic mutations on every
// test run, //base:fuzz_replay_main) and run_libfuzzer.sh (clang, -fsanitize=fuzzer,address,
// undefined). The input layout is in README.md; make_corpus.py writes the seeds.
//
// What the peer's bytes reach: the frame decoder (DATA, ERROR, PULL, ACK headers, padding,
// speculative payload reads), read-ahead and parking while this rank waits for ACKs, same-host
// PULLs (enabled only with this process's own pid, so a PULL reads our own memory or fails with
// EFAULT), the departure paths (peer closes, half-closes, sends an ERROR frame), and, when the
// input asks, the same-host offer/answer exchange before the transport starts and the mesh's
// Hello checks (CheckHello, CheckReply).
//
// For every input it checks that
//   * every status is OK or kUnavailable / kInvalidArgument / kInternal / kDeadlineExceeded, and
//     an error names the peer ("peer 1");
//   * a half-closed or closed peer never leaves a Wait to its deadline (it must end the wait);
//   * no byte around a posted receive buffer is written, before or after the transport is gone;
//   * once broken, Wait, Poll and new requests all return the same error;
//   * what the transport wrote to the peer is well formed: the posted sends in order (DATA with
//     their payload and zero padding, or PULL naming their address), and at most one ACK per
//     message it pulled.
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/fuzz_check.h"
#include "comm/tcp/internal/mesh.h"
#include "comm/tcp/internal/same_host.h"
#include "comm/tcp/internal/socket.h"
#include "comm/tcp/internal/transport_for_testing.h"
#include "comm/tcp/internal/wire.h"
#include "comm/tcp/tcp_transport.h"

namespace {

namespace ti = fairscale::comm::tcp_internal;
using fairscale::comm::TcpTransport;
using fairscale::comm::Transport;

// Flags (input byte 0).
constexpr uint8_t kPullFrom = 1 << 0;   // this rank accepts PULL frames (reads its own memory)
constexpr uint8_t kPullTo = 1 << 1;     // large sends go out as PULLs and wait for ACKs
constexpr uint8_t kHalfClose = 1 << 2;  // shutdown(SHUT_WR) the peer end after the stream
constexpr uint8_t kClose = 1 << 3;      // close the peer end after the stream
constexpr uint8_t kNegotiate = 1 << 4;  // run the same-host offer/answer on the stream first
constexpr uint8_t kDrip = 1 << 5;       // write the second part in small pieces, Poll() between
constexpr uint8_t kRank1 = 1 << 6;      // be rank 1 (the peer is rank 0)
constexpr uint8_t kShutdown = 1 << 7;   // Shutdown(error) at the end, not just the destructor

// Sizes and tags a request can have (op byte: bit 0 send, bits 1-4 size, bits 5-7 tag). The tags
// are real MakeTag-style values (op type, signature, sequence number) so errors describe them.
constexpr size_t kSizes[16] = {0, 1, 2, 7, 8, 15, 16, 17, 31, 32, 33, 64, 100, 255, 1024, 4096};
constexpr uint64_t kTags[8] = {0x0000000000000107ull, 0x0000000100000107ull,
                               0x0000000200001101ull, 0x0000000300000003ull,
                               0x000000040001020aull, 0x0000000500000007ull,
                               0xffffffff00000000ull, 0x00000006ffffffffull};
// Same-host threshold (bits 5-6 of input byte 1): PULLs below it are out of sync.
constexpr uint64_t kMinBytes[4] = {1, 16, 64, 4096};
constexpr size_t kCanary = 32;
constexpr char kCanaryByte = static_cast<char>(0xa5);
constexpr size_t kMaxOps = 8;

// Memory a PULL can name: mapped once at a fixed address (if free), so that seeds (and the
// fuzzer) reach successful same-host copies and the ACKs they send. Elsewhere a PULL reads
// whatever this process has mapped there, or fails with EFAULT.
constexpr uint64_t kPullRegion = 0x5a5a00000000ull;
constexpr size_t kPullRegionBytes = 64 << 10;
void MapPullRegion() {
  static const bool mapped = [] {
    void* want = reinterpret_cast<void*>(kPullRegion);
    void* got = ::mmap(want, kPullRegionBytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    if (got != want) {
      if (got != MAP_FAILED) ::munmap(got, kPullRegionBytes);  // a kernel without NOREPLACE
      return false;
    }
    for (size_t i = 0; i < kPullRegionBytes; ++i) static_cast<char*>(got)[i] = static_cast<char>(i);
    return true;
  }();
  (void)mapped;
}

struct Posted {
  bool send;
  uint64_t tag;
  size_t bytes;
  std::vector<char> buffer;  // receives: kCanary + bytes + kCanary; sends: the payload
  Transport::Request request;
};

bool KnownCode(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kOk:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kDeadlineExceeded:
      return true;
    default:
      return false;
  }
}

void CheckStatus(const absl::Status& s, int peer) {
  if (KnownCode(s) && (s.ok() || absl::StrContains(s.message(), absl::StrCat("peer ", peer)))) {
    return;
  }
  std::fprintf(stderr, "unexpected status: %s\n", s.ToString().c_str());
  FS_FUZZ_CHECK(KnownCode(s));
  FS_FUZZ_CHECK(absl::StrContains(s.message(), absl::StrCat("peer ", peer)));
}

void CheckCanaries(const std::vector<Posted>& ops) {
  for (const Posted& op : ops) {
    if (op.send) continue;
    for (size_t i = 0; i < kCanary; ++i) {
      FS_FUZZ_CHECK(op.buffer[i] == kCanaryByte);
      FS_FUZZ_CHECK(op.buffer[kCanary + op.bytes + i] == kCanaryByte);
    }
  }
}

// Writes as much of `bytes` as the socket takes (it is far larger than a fuzz input).
void WriteAll(int fd, const char* data, size_t bytes) {
  while (bytes > 0) {
    const ssize_t n = ::send(fd, data, bytes, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    data += n;
    bytes -= n;
  }
}

std::string ReadAvailable(int fd) {
  std::string out;
  char chunk[4096];
  while (true) {
    const ssize_t n = ::recv(fd, chunk, sizeof(chunk), MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return out;
    out.append(chunk, n);
  }
}

// The transport's output must be the posted sends in order, interleaved with ACKs.
void CheckOutput(const std::string& out, const std::vector<Posted>& ops, uint64_t pulled,
                 bool pull_to, uint64_t min_bytes) {
  size_t pos = 0;
  size_t next_send = 0;
  uint64_t acks = 0;
  while (out.size() - pos >= ti::kHeaderBytes) {
    ti::FrameHeader h;
    std::memcpy(&h, out.data() + pos, sizeof(h));
    FS_FUZZ_CHECK(h.reserved0 == 0);
    if (h.kind == static_cast<uint32_t>(ti::FrameKind::kAck)) {
      FS_FUZZ_CHECK(h.aux == 0);
      ++acks;
      pos += ti::kHeaderBytes;
      continue;
    }
    while (next_send < ops.size() && !ops[next_send].send) ++next_send;
    FS_FUZZ_CHECK(next_send < ops.size());
    const Posted& op = ops[next_send++];
    FS_FUZZ_CHECK(h.tag == op.tag && h.bytes == op.bytes);
    const bool pull = pull_to && op.bytes >= min_bytes;
    if (pull) {
      FS_FUZZ_CHECK(h.kind == static_cast<uint32_t>(ti::FrameKind::kPull));
      FS_FUZZ_CHECK(h.aux == reinterpret_cast<uint64_t>(op.buffer.data()));
      pos += ti::kHeaderBytes;
      continue;
    }
    FS_FUZZ_CHECK(h.kind == static_cast<uint32_t>(ti::FrameKind::kData));
    FS_FUZZ_CHECK(h.aux == 0);
    const size_t frame = ti::FrameBytes(op.bytes);
    const size_t have = std::min(frame, out.size() - pos);  // the last may be partly written
    for (size_t i = ti::kHeaderBytes; i < have; ++i) {
      const size_t k = i - ti::kHeaderBytes;
      FS_FUZZ_CHECK(out[pos + i] == (k < op.bytes ? op.buffer[k] : '\0'));
    }
    pos += have;
  }
  FS_FUZZ_CHECK(acks <= pulled);
}

// The mesh's Hello checks, as rank 1 of 4 (peers above and below): accepted exactly when every
// field agrees, otherwise kInvalidArgument naming the peer.
void CheckHellos(const ti::Hello& h) {
  const bool common = h.version == ti::kProtocolVersion && h.size == 4 && h.to_rank == 1;
  const absl::Status in = ti::CheckHello(h, 1, 4, "fuzz");
  FS_FUZZ_CHECK(in.ok() == (common && (h.from_rank == 2 || h.from_rank == 3)));
  if (!in.ok()) {
    FS_FUZZ_CHECK(in.code() == absl::StatusCode::kInvalidArgument);
    FS_FUZZ_CHECK(absl::StartsWith(in.message(), absl::StrCat("peer ", h.from_rank, " at fuzz ")));
  }
  const absl::Status reply = ti::CheckReply(h, 1, 4, 0, "fuzz");
  FS_FUZZ_CHECK(reply.ok() == (common && h.magic == ti::kHandshakeMagic && h.from_rank == 0));
  if (!reply.ok()) {
    FS_FUZZ_CHECK(reply.code() == absl::StatusCode::kInvalidArgument);
    FS_FUZZ_CHECK(absl::StartsWith(reply.message(), "peer 0 at fuzz "));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  MapPullRegion();
  const uint8_t flags = data[0];
  const size_t num_ops = std::min<size_t>(1 + (data[1] & 7), kMaxOps);
  const bool split_ops = (data[1] & 8) != 0;  // post half the requests after the first Poll
  const uint64_t min_bytes = kMinBytes[(data[1] >> 5) & 3];
  const uint8_t split = data[2];  // where the stream is cut between the two writes
  size_t pos = 3;
  const int rank = (flags & kRank1) ? 1 : 0;
  const int peer = 1 - rank;

  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, fds) != 0) {
    std::fprintf(stderr, "socketpair: %s\n", std::strerror(errno));
    std::abort();
  }
  ti::UniqueFd remote(fds[1]);
  std::vector<ti::MeshPeer> mesh(2);
  mesh[peer].fd = ti::UniqueFd(fds[0]);
  mesh[peer].address = "fuzz";

  std::vector<Posted> ops;
  for (size_t i = 0; i < num_ops && pos < size; ++i, ++pos) {
    const uint8_t b = data[pos];
    Posted op{(b & 1) != 0, kTags[b >> 5], kSizes[(b >> 1) & 15], {}, 0};
    if (op.send) {
      op.buffer.resize(std::max<size_t>(op.bytes, 1));
      for (size_t k = 0; k < op.bytes; ++k) op.buffer[k] = static_cast<char>(k * 7 + i);
    } else {
      op.buffer.assign(kCanary + op.bytes + kCanary, kCanaryByte);
    }
    ops.push_back(std::move(op));
  }
  if ((data[1] & 0x80) && size - pos >= sizeof(ti::Hello)) {  // the stream opens with a Hello
    ti::Hello hello;
    std::memcpy(&hello, data + pos, sizeof(hello));
    CheckHellos(hello);
    pos += sizeof(hello);
  }
  const char* stream = reinterpret_cast<const char*>(data + pos);
  const size_t stream_bytes = size - pos;
  const size_t first_part = stream_bytes * split / 256;
  bool written = false;  // the whole stream is in the socket already

  // Same-host negotiation over the stream: an AF_UNIX socket is never "same host" to this rank,
  // so it only parses (and never probes) the peer's offer and answer.
  if (flags & kNegotiate) {
    WriteAll(remote.get(), stream, stream_bytes);  // the negotiation reads exact records
    written = true;
    auto agreed = ti::NegotiateSameHost(mesh, rank, min_bytes, absl::Now());
    if (!agreed.ok()) {
      const absl::Status& s = agreed.status();
      FS_FUZZ_CHECK(s.code() == absl::StatusCode::kInternal ||
                    s.code() == absl::StatusCode::kUnavailable ||
                    s.code() == absl::StatusCode::kDeadlineExceeded);
      FS_FUZZ_CHECK(absl::StrContains(s.message(), absl::StrCat("peer ", peer)));
      FS_FUZZ_CHECK(absl::StartsWith(s.message(), absl::StrCat("tcp rendezvous rank ", rank)));
      return 0;
    }
    FS_FUZZ_CHECK(agreed->size() == 2);
    const ti::SameHostPeer& got = (*agreed)[peer];
    FS_FUZZ_CHECK(!got.pull_from && !got.pull_to && got.min_bytes == ti::kNeverPull);
    // The peer end holds our offer (48 bytes) and answer (16 bytes): not part of the frames.
    std::string ours = ReadAvailable(remote.get());
    FS_FUZZ_CHECK(ours.size() == sizeof(ti::SameHostOffer) + sizeof(ti::SameHostAnswer));
  }

  std::vector<ti::SameHostPeer> same_host(2);
  same_host[peer].pid = ::getpid();  // only ever this process
  same_host[peer].pull_from = (flags & kPullFrom) != 0;
  same_host[peer].pull_to = (flags & kPullTo) != 0;
  if (same_host[peer].pull_from || same_host[peer].pull_to) same_host[peer].min_bytes = min_bytes;
  auto created = ti::TcpTransportForTesting::Create(rank, std::move(mesh), same_host);
  FS_FUZZ_CHECK(created.ok());
  std::unique_ptr<TcpTransport> transport = *std::move(created);

  const auto post = [&](Posted& op) {
    op.request = op.send ? transport->Isend(peer, op.tag, op.buffer.data(), op.bytes)
                         : transport->Irecv(peer, op.tag, op.buffer.data() + kCanary, op.bytes);
  };
  const size_t first_ops = split_ops ? ops.size() / 2 : ops.size();
  for (size_t i = 0; i < first_ops; ++i) post(ops[i]);
  if (!written) WriteAll(remote.get(), stream, first_part);
  absl::Status status = transport->Poll();
  CheckStatus(status, peer);
  for (size_t i = first_ops; i < ops.size(); ++i) post(ops[i]);
  if (!written) {
    const char* rest = stream + first_part;
    size_t left = stream_bytes - first_part;
    if (flags & kDrip) {
      // Headers and payloads cut at every offset: up to 64 pieces of 1..16 bytes, Poll() after
      // each (errors are sticky: the final Wait must return the first one).
      const size_t piece = 1 + split % 16;
      for (int i = 0; i < 64 && left > 0 && status.ok(); ++i) {
        const size_t n = std::min(piece, left);
        WriteAll(remote.get(), rest, n);
        rest += n;
        left -= n;
        status = transport->Poll();
        CheckStatus(status, peer);
      }
    }
    WriteAll(remote.get(), rest, left);
  }
  const bool closed = (flags & (kHalfClose | kClose)) != 0;
  if (flags & kClose) {
    remote.Reset();
  } else if (flags & kHalfClose) {
    ::shutdown(remote.get(), SHUT_WR);
  }

  std::vector<Transport::Request> requests;
  for (const Posted& op : ops) requests.push_back(op.request);
  // Everything is in the socket already: an open peer gets no wait at all (a deadline in the
  // past still makes one round of progress); a closed one must end the wait long before its
  // 10 s deadline.
  const absl::Duration wait = closed ? absl::Seconds(10) : absl::ZeroDuration();
  if (status.ok()) {
    status = transport->Wait(requests, absl::Now() + wait);
    CheckStatus(status, peer);
    if (closed) FS_FUZZ_CHECK(status.code() != absl::StatusCode::kDeadlineExceeded);
  }
  CheckCanaries(ops);
  static const bool trace = std::getenv("FS_FUZZ_TRACE") != nullptr;
  if (trace) {
    std::fprintf(stderr, "flags 0x%02x, %zu requests, pulled %llu: %s\n", flags, ops.size(),
                 static_cast<unsigned long long>(transport->pulled_messages()),
                 status.ToString().c_str());
  }

  if (!status.ok()) {
    // Broken for good, with the same error.
    FS_FUZZ_CHECK(transport->Poll() == status);
    FS_FUZZ_CHECK(transport->Wait(requests, absl::Now()) == status);
    char byte = 0;
    const Transport::Request more = transport->Irecv(peer, kTags[0], &byte, 1);
    FS_FUZZ_CHECK(transport->Wait({&more, 1}, absl::Now()) == status);
  }

  if (remote.valid()) {
    CheckOutput(ReadAvailable(remote.get()), ops, transport->pulled_messages(),
                same_host[peer].pull_to, min_bytes);
  }
  if (flags & kShutdown) transport->Shutdown(absl::InternalError("fuzz harness shuts down"));
  transport.reset();
  CheckCanaries(ops);
  return 0;
}
