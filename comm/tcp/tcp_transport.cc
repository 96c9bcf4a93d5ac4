#include "comm/tcp/tcp_transport.h"

#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "comm/tcp/internal/mesh.h"

namespace fairscale::comm {

using tcp_internal::ErrnoString;
using tcp_internal::FrameBytes;
using tcp_internal::FrameHeader;
using tcp_internal::FrameIov;
using tcp_internal::FrameKind;
using tcp_internal::FramePad;
using tcp_internal::kHeaderBytes;
using tcp_internal::PollTimeoutMs;
using tcp_internal::UniqueFd;
using tcp_internal::WouldBlock;

namespace {

// Request = ((index + 1) << 21) | (is_recv << 20) | peer, where index counts the requests posted
// to that peer in that direction. Requests complete in that order, so completion is a compare.
constexpr int kPeerBits = 20;
constexpr uint64_t kPeerMask = (uint64_t{1} << kPeerBits) - 1;
constexpr Transport::Request kInvalidRequest = ~uint64_t{0};
constexpr int kMaxIov = 64;
constexpr size_t kScratchBytes = 64 << 10;

Transport::Request MakeRequest(int peer, bool recv, uint64_t index) {
  return ((index + 1) << (kPeerBits + 1)) | (uint64_t{recv} << kPeerBits) |
         static_cast<uint64_t>(peer);
}

FrameHeader DataHeader(uint64_t tag, size_t bytes) {
  return FrameHeader{static_cast<uint32_t>(FrameKind::kData), 0, tag, bytes, 0};
}

}  // namespace

absl::StatusOr<TcpOptions> ParseTcpOptions(const CommConfig& config) {
  TcpOptions options;
  for (const auto& [key, value] : config.options) {
    if (absl::StartsWith(key, "algo.")) continue;  // the algorithms' keys
    int* field = key == "tcp.send_buffer_bytes"   ? &options.send_buffer_bytes
                 : key == "tcp.recv_buffer_bytes" ? &options.recv_buffer_bytes
                                                  : nullptr;
    if (field == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "[tcp] unknown option '", key,
          "'; the tcp backend accepts tcp.send_buffer_bytes, tcp.recv_buffer_bytes and algo.*"));
    }
    if (!absl::SimpleAtoi(value, field) || *field < 0 || *field > (1 << 30)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "[tcp] option ", key, "='", value, "' is not a byte count in [0, 1073741824]"));
    }
    // A receive window below one segment (64 KiB on loopback) stalls TCP in zero-window probes.
    if (field == &options.recv_buffer_bytes && *field > 0 && *field < kMinRecvBufferBytes) {
      return absl::InvalidArgumentError(absl::StrCat("[tcp] option ", key, "='", value,
                                                     "' is below the minimum of ",
                                                     kMinRecvBufferBytes, " (or 0 for autotuning)"));
    }
  }
  return options;
}

absl::StatusOr<std::unique_ptr<TcpTransport>> TcpTransport::Create(std::shared_ptr<Store> store,
                                                                   int rank, int size,
                                                                   const CommConfig& config) {
  if (store == nullptr) {
    return absl::InvalidArgumentError("[tcp] the tcp backend needs CommConfig::store");
  }
  FS_ASSIGN_OR_RETURN(const TcpOptions options, ParseTcpOptions(config));
  tcp_internal::MeshOptions mesh_options;
  mesh_options.bind_address = config.bind_address;
  mesh_options.timeout = config.timeout;
  mesh_options.send_buffer_bytes = options.send_buffer_bytes;
  mesh_options.recv_buffer_bytes = options.recv_buffer_bytes;
  FS_ASSIGN_OR_RETURN(std::vector<tcp_internal::MeshPeer> mesh,
                      tcp_internal::ConnectMesh(*store, rank, size, mesh_options));
  UniqueFd event_fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!event_fd.valid()) {
    return absl::InternalError(absl::StrCat("[tcp] eventfd: ", ErrnoString(errno)));
  }
  std::vector<Peer> peers(size);
  for (int p = 0; p < size; ++p) {
    peers[p].fd = std::move(mesh[p].fd);
    peers[p].address = std::move(mesh[p].address);
  }
  return std::unique_ptr<TcpTransport>(
      new TcpTransport(rank, size, std::move(peers), std::move(event_fd)));
}

TcpTransport::TcpTransport(int rank, int size, std::vector<Peer> peers, UniqueFd event_fd)
    : rank_(rank), size_(size), peers_(std::move(peers)), event_fd_(std::move(event_fd)) {}

// The sockets and the eventfd close with their UniqueFds.
TcpTransport::~TcpTransport() = default;

void TcpTransport::Fail(absl::Status status) {
  if (broken_.ok()) broken_ = std::move(status);
}

void TcpTransport::CheckCancel() {
  if (!cancelled_.load(std::memory_order_acquire)) return;
  absl::MutexLock lock(&cancel_mu_);
  Fail(cancel_reason_);
}

void TcpTransport::Cancel(const absl::Status& reason) {
  {
    absl::MutexLock lock(&cancel_mu_);
    if (cancel_reason_.ok()) {
      cancel_reason_ = reason.ok() ? absl::AbortedError("transport cancelled") : reason;
    }
  }
  cancelled_.store(true, std::memory_order_release);
  const uint64_t one = 1;
  // Wakes a poll() in Wait(). It cannot fail short of a full counter, which is readable anyway.
  [[maybe_unused]] const ssize_t n = ::write(event_fd_.get(), &one, sizeof(one));
}

Transport::Request TcpTransport::Isend(int peer, uint64_t tag, const void* data, size_t bytes) {
  if (peer < 0 || peer >= size_ || peer == rank_) {
    Fail(absl::InvalidArgumentError(
        absl::StrCat("send of ", DescribeTag(tag), " to invalid peer ", peer)));
    return kInvalidRequest;
  }
  Peer& p = peers_[peer];
  const Request request = MakeRequest(peer, /*recv=*/false, p.sends_posted++);
  SendOp op{static_cast<const char*>(data), bytes, 0, DataHeader(tag, bytes)};
  if (broken_.ok() && p.sends.empty() && p.departed == Departure::kNone) {
    // Latency: most messages fit in the socket buffer, so write header and payload right now
    // with one syscall and never queue them.
    iovec iov[3];
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = FrameIov(&op.header, op.data, 0, iov);
    const ssize_t n = ::sendmsg(p.fd.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0 && static_cast<size_t>(n) == FrameBytes(bytes)) {
      ++p.sends_done;
      return request;
    }
    if (n > 0) op.done = n;
    if (n < 0 && !WouldBlock(errno) && errno != EINTR) {
      const int err = errno;
      p.sends.push_back(op);
      PeerClosed(peer, err);
      return request;
    }
  }
  p.sends.push_back(op);
  if (p.departed != Departure::kNone) ServeDeparted(peer);  // fails: nobody will read it
  return request;
}

Transport::Request TcpTransport::Irecv(int peer, uint64_t tag, void* data, size_t bytes) {
  if (peer < 0 || peer >= size_ || peer == rank_) {
    Fail(absl::InvalidArgumentError(
        absl::StrCat("receive of ", DescribeTag(tag), " from invalid peer ", peer)));
    return kInvalidRequest;
  }
  Peer& p = peers_[peer];
  p.recvs.push_back(RecvOp{static_cast<char*>(data), bytes, tag});
  return MakeRequest(peer, /*recv=*/true, p.recvs_posted++);
}

bool TcpTransport::IsDone(Request request) const {
  const Peer& p = peers_[request & kPeerMask];
  const uint64_t index = (request >> (kPeerBits + 1)) - 1;
  return ((request >> kPeerBits) & 1) ? p.recvs_done > index : p.sends_done > index;
}

absl::Status TcpTransport::Wait(absl::Span<const Request> requests, absl::Time deadline) {
  CheckCancel();
  if (!broken_.ok()) return broken_;
  for (const Request r : requests) {
    const uint64_t peer = r & kPeerMask;
    const uint64_t index = (r >> (kPeerBits + 1)) - 1;
    const bool recv = (r >> kPeerBits) & 1;
    if (peer >= static_cast<uint64_t>(size_) || peer == static_cast<uint64_t>(rank_) ||
        (r >> (kPeerBits + 1)) == 0 ||
        index >= (recv ? peers_[peer].recvs_posted : peers_[peer].sends_posted)) {
      Fail(absl::InternalError(absl::StrCat("Wait on unknown request 0x", absl::Hex(r))));
      return broken_;
    }
  }
  const auto all_done = [&] {
    for (const Request r : requests) {
      if (!IsDone(r)) return false;
    }
    return true;
  };
  if (all_done()) return absl::OkStatus();
  ProgressAll();
  while (true) {
    // Requests that completed before an error are still reported as done.
    if (all_done()) return absl::OkStatus();
    CheckCancel();
    if (departures_ && FailForDepartedPeer(/*idle=*/false) && all_done()) return absl::OkStatus();
    if (!broken_.ok()) return broken_;
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      Fail(DeadlineError());
      return broken_;
    }
    PollOnce(left);
  }
}

absl::Status TcpTransport::Poll() {
  CheckCancel();
  if (!broken_.ok()) return broken_;
  ProgressAll();
  if (broken_.ok()) PollOnce(absl::ZeroDuration());
  if (departures_) FailForDepartedPeer(/*idle=*/true);
  CheckCancel();
  return broken_;
}

void TcpTransport::ProgressAll() {
  for (int p = 0; p < size_ && broken_.ok(); ++p) {
    if (p == rank_) continue;
    if (!peers_[p].sends.empty()) PumpSend(p);
    if (!peers_[p].recvs.empty() && broken_.ok()) ServiceRecv(p);
  }
}

bool TcpTransport::PollOnce(absl::Duration timeout) {
  pollfds_.clear();
  poll_peers_.clear();
  pollfds_.push_back({event_fd_.get(), POLLIN, 0});
  for (int p = 0; p < size_; ++p) {
    const Peer& peer = peers_[p];
    if (p == rank_ || !peer.fd.valid()) continue;
    // Always POLLRDHUP: a peer that closes is noticed even when nothing is posted to it. POLLIN
    // only with a posted receive: unrequested data stays in the kernel (back-pressure).
    short events = POLLRDHUP;
    if (!peer.recvs.empty()) events |= POLLIN;
    if (!peer.sends.empty()) events |= POLLOUT;
    pollfds_.push_back({peer.fd.get(), events, 0});
    poll_peers_.push_back(p);
  }
  const int n = ::poll(pollfds_.data(), pollfds_.size(), PollTimeoutMs(timeout));
  if (n < 0) {
    if (errno != EINTR) Fail(absl::InternalError(absl::StrCat("poll: ", ErrnoString(errno))));
    return false;
  }
  if (n == 0) return false;
  for (size_t i = 0; i < poll_peers_.size() && broken_.ok(); ++i) {
    const short revents = pollfds_[i + 1].revents;
    if (revents == 0) continue;
    const int p = poll_peers_[i];
    if (revents & POLLOUT) PumpSend(p);
    if ((revents & POLLIN) && broken_.ok()) ServiceRecv(p);
    if ((revents & (POLLRDHUP | POLLHUP | POLLERR)) && broken_.ok()) PeerClosed(p, 0);
  }
  return true;
}

void TcpTransport::PumpSend(int p) {
  Peer& peer = peers_[p];
  if (peer.departed != Departure::kNone) return ServeDeparted(p);
  while (!peer.sends.empty()) {
    // Gather as many queued messages as fit in one sendmsg.
    iovec iov[kMaxIov];
    int n = 0;
    size_t want = 0;
    for (const SendOp& op : peer.sends) {
      if (n + 3 > kMaxIov) break;
      n += FrameIov(&op.header, op.data, op.done, iov + n);
      want += FrameBytes(op.bytes) - op.done;
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = n;
    const ssize_t r = ::sendmsg(peer.fd.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (!WouldBlock(errno)) PeerClosed(p, errno);
      return;
    }
    size_t left = r;
    while (left > 0) {
      SendOp& op = peer.sends.front();
      const size_t remaining = FrameBytes(op.bytes) - op.done;
      if (left < remaining) {
        op.done += left;
        break;
      }
      left -= remaining;
      peer.sends.pop_front();
      ++peer.sends_done;
    }
    // A short write means the socket buffer is full: wait for POLLOUT instead of an EAGAIN.
    if (static_cast<size_t>(r) < want) return;
  }
}

void TcpTransport::ServiceRecv(int p) {
  if (peers_[p].departed != Departure::kNone) return ServeDeparted(p);
  int err = 0;
  if (PumpRecv(p, /*drain=*/false, &err) == Pump::kClosed) PeerClosed(p, err);
}

TcpTransport::Pump TcpTransport::PumpRecv(int p, bool drain, int* err) {
  Peer& peer = peers_[p];
  while (true) {
    if (!broken_.ok() || peer.departed != Departure::kNone) return Pump::kStopped;
    iovec iov[3];
    int n = 0;
    switch (peer.rx_mode) {
      case RxMode::kHeader:
        if (peer.recvs.empty() && !drain) return Pump::kIdle;
        // The previous frame's padding, then this frame's header.
        if (peer.rx_skip > 0) iov[n++] = {pad_sink_, peer.rx_skip};
        iov[n++] = {reinterpret_cast<char*>(&peer.rx_header) + peer.rx_header_got,
                    kHeaderBytes - peer.rx_header_got};
        // Speculatively read the payload with the header (one syscall per small message). If
        // the header turns out not to match, the request fails anyway, and nothing lands
        // outside the posted buffer.
        if (!peer.recvs.empty() && peer.recvs.front().bytes > 0) {
          iov[n++] = {peer.recvs.front().data, peer.recvs.front().bytes};
        }
        break;
      case RxMode::kData: {
        const RecvOp& op = peer.recvs.front();
        iov[n++] = {op.data + peer.rx_got, op.bytes - peer.rx_got};
        break;
      }
      case RxMode::kStash:
        if (scratch_.empty()) scratch_.resize(kScratchBytes);
        iov[n++] = {scratch_.data(), std::min<size_t>(scratch_.size(),
                                                      peer.rx_header.bytes - peer.rx_got)};
        break;
      case RxMode::kError:
        iov[n++] = {&peer.rx_reason[peer.rx_got], peer.rx_header.bytes - peer.rx_got};
        break;
    }
    size_t want = 0;
    for (int i = 0; i < n; ++i) want += iov[i].iov_len;
    const ssize_t r = ::readv(peer.fd.get(), iov, n);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (WouldBlock(errno)) return Pump::kBlocked;
      *err = errno;
      return Pump::kClosed;
    }
    if (r == 0) {
      *err = 0;
      return Pump::kClosed;
    }
    switch (peer.rx_mode) {
      case RxMode::kHeader: {
        size_t left = r;
        const size_t skipped = std::min(left, peer.rx_skip);
        peer.rx_skip -= skipped;
        left -= skipped;
        const size_t header_part = std::min(left, kHeaderBytes - peer.rx_header_got);
        peer.rx_header_got += header_part;
        left -= header_part;
        if (peer.rx_header_got == kHeaderBytes) {
          peer.rx_header_got = 0;
          OnHeader(p, left);
        }
        break;
      }
      case RxMode::kData:
        peer.rx_got += r;
        if (peer.rx_got == peer.recvs.front().bytes) CompleteRecv(peer);
        break;
      case RxMode::kStash:
        peer.stash.back().payload.append(scratch_.data(), r);
        peer.rx_got += r;
        if (peer.rx_got == peer.rx_header.bytes) {
          peer.rx_mode = RxMode::kHeader;
          peer.rx_got = 0;
          peer.rx_skip = FramePad(peer.rx_header.bytes);
        }
        break;
      case RxMode::kError:
        peer.rx_got += r;
        if (peer.rx_got == peer.rx_header.bytes) FinishErrorFrame(p);
        break;
    }
    // A short read means the socket is empty: wait for POLLIN instead of an EAGAIN. Draining a
    // closed peer reads on to the end of its stream.
    if (static_cast<size_t>(r) < want && !drain) return Pump::kBlocked;
  }
}

void TcpTransport::OnHeader(int p, size_t spill) {
  Peer& peer = peers_[p];
  const FrameHeader& h = peer.rx_header;
  peer.rx_got = 0;
  if (h.kind == static_cast<uint32_t>(FrameKind::kError)) {
    if (h.bytes > tcp_internal::kMaxErrorReasonBytes) {
      Fail(absl::InternalError(absl::StrCat("peer ", p, " sent an error frame of ", h.bytes,
                                            " bytes; the connection is out of sync")));
      return;
    }
    peer.rx_reason.assign(h.bytes, '\0');
    // The start of the reason may have landed in the posted buffer (speculative read).
    const size_t take = std::min<size_t>(spill, h.bytes);
    if (take > 0) std::memcpy(&peer.rx_reason[0], peer.recvs.front().data, take);
    peer.rx_got = take;
    peer.rx_mode = RxMode::kError;
    if (take == h.bytes) FinishErrorFrame(p);
    return;
  }
  if (h.kind != static_cast<uint32_t>(FrameKind::kData)) {
    Fail(absl::InternalError(absl::StrCat("peer ", p, " sent a corrupt frame header (kind 0x",
                                          absl::Hex(h.kind),
                                          "); the connection is out of sync")));
    return;
  }
  if (peer.recvs.empty()) {
    // Draining a peer that is closing: nobody asked for this message yet. Keep it, in case the
    // peer turns out to have shut down cleanly (see ServeFromStash).
    peer.stash.push_back({h.tag, {}});
    peer.rx_mode = h.bytes > 0 ? RxMode::kStash : RxMode::kHeader;
    return;
  }
  const RecvOp& op = peer.recvs.front();
  if (h.tag != op.tag || h.bytes != op.bytes) return Fail(MismatchError(p, h.tag, h.bytes));
  peer.rx_mode = RxMode::kData;
  peer.rx_got = spill;
  if (spill == op.bytes) CompleteRecv(peer);
}

void TcpTransport::CompleteRecv(Peer& peer) {
  peer.rx_skip = FramePad(peer.recvs.front().bytes);
  peer.recvs.pop_front();
  ++peer.recvs_done;
  peer.rx_mode = RxMode::kHeader;
  peer.rx_got = 0;
}

absl::StatusOr<std::unique_ptr<Transport>> CreateTcpTransport(std::shared_ptr<Store> store,
                                                              int rank, int size,
                                                              const CommConfig& config) {
  FS_ASSIGN_OR_RETURN(std::unique_ptr<TcpTransport> transport,
                      TcpTransport::Create(std::move(store), rank, size, config));
  return std::unique_ptr<Transport>(std::move(transport));
}

}  // namespace fairscale::comm
