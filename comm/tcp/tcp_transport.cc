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

FrameHeader MakeHeader(FrameKind kind, uint64_t tag, size_t bytes, uint64_t aux = 0) {
  return FrameHeader{static_cast<uint32_t>(kind), 0, tag, bytes, aux};
}

}  // namespace

absl::StatusOr<TcpOptions> ParseTcpOptions(const CommConfig& config) {
  TcpOptions options;
  for (const auto& [key, value] : config.options) {
    if (absl::StartsWith(key, "algo.")) continue;  // the algorithms' keys
    int* field = key == "tcp.send_buffer_bytes"   ? &options.send_buffer_bytes
                 : key == "tcp.recv_buffer_bytes" ? &options.recv_buffer_bytes
                 : key == "tcp.cma_min_bytes"     ? &options.cma_min_bytes
                                                  : nullptr;
    if (field == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "[tcp] unknown option '", key,
          "'; the tcp backend accepts tcp.send_buffer_bytes, tcp.recv_buffer_bytes, "
          "tcp.cma_min_bytes and algo.*"));
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
  FS_ASSIGN_OR_RETURN(std::vector<tcp_internal::SameHostPeer> same_host,
                      tcp_internal::NegotiateSameHost(mesh, rank, options.cma_min_bytes,
                                                      absl::Now() + config.timeout));
  return FromConnections(rank, std::move(mesh), same_host);
}

absl::StatusOr<std::unique_ptr<TcpTransport>> TcpTransport::FromConnections(
    int rank, std::vector<tcp_internal::MeshPeer> mesh,
    const std::vector<tcp_internal::SameHostPeer>& same_host) {
  const int size = static_cast<int>(mesh.size());
  UniqueFd event_fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!event_fd.valid()) {
    return absl::InternalError(absl::StrCat("[tcp] eventfd: ", ErrnoString(errno)));
  }
  std::vector<Peer> peers(size);
  for (int p = 0; p < size; ++p) {
    peers[p].fd = std::move(mesh[p].fd);
    peers[p].address = std::move(mesh[p].address);
    peers[p].same_host = same_host[p];
  }
  return std::unique_ptr<TcpTransport>(
      new TcpTransport(rank, size, std::move(peers), std::move(event_fd)));
}

TcpTransport::TcpTransport(int rank, int size, std::vector<Peer> peers, UniqueFd event_fd)
    : rank_(rank), size_(size), peers_(std::move(peers)), event_fd_(std::move(event_fd)) {}

// The sockets and the eventfd close with their UniqueFds.
TcpTransport::~TcpTransport() = default;

int TcpTransport::same_host_peers() const {
  int n = 0;
  for (const Peer& peer : peers_) n += peer.same_host.pull_from ? 1 : 0;
  return n;
}

void TcpTransport::Fail(absl::Status status) {
  if (broken_.ok()) broken_ = std::move(status);
}

void TcpTransport::CheckCancel() {
  if (!cancelled_.load(std::memory_order_acquire) || !broken_.ok()) return;
  absl::Status reason;
  {
    absl::MutexLock lock(&cancel_mu_);
    reason = cancel_reason_;
  }
  // A cancel from outside the operation (the heartbeat monitor naming a silent rank or a silent
  // store) also says what this rank was waiting for, so the error names the peers and addresses
  // involved even when the reason names only the store. Abort() (kAborted) says just that.
  const std::string waiting = reason.code() == absl::StatusCode::kAborted ? "" : Outstanding();
  if (!waiting.empty()) {
    reason = absl::Status(reason.code(),
                          absl::StrCat(reason.message(), "; this rank was waiting for ", waiting));
  }
  Fail(reason);
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
  const uint64_t index = p.sends_posted++;
  const Request request = MakeRequest(peer, /*recv=*/false, index);
  // Large messages to a same-host peer: only their address goes out; the peer copies them.
  const bool pull = p.same_host.pull_to && bytes >= p.same_host.min_bytes;
  SendOp op{static_cast<const char*>(data), pull ? 0 : bytes, 0,
            pull ? MakeHeader(FrameKind::kPull, tag, bytes, reinterpret_cast<uint64_t>(data))
                 : MakeHeader(FrameKind::kData, tag, bytes),
            index};
  if (broken_.ok() && p.sends.empty() && p.departed == Departure::kNone) {
    // Latency: most messages fit in the socket buffer, so write header and payload right now
    // with one syscall and never queue them.
    iovec iov[3];
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = FrameIov(&op.header, op.data, 0, iov);
    const ssize_t n = ::sendmsg(p.fd.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0 && static_cast<size_t>(n) == FrameBytes(op.bytes)) {
      SendWritten(p, op);
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

void TcpTransport::SendWritten(Peer& peer, const SendOp& op) {
  if (op.index == kControl) return;
  ++peer.sends_written;
  if (op.header.kind == static_cast<uint32_t>(FrameKind::kPull)) {
    peer.unacked.push_back({op.index, op.header.tag, op.header.bytes});
  }
}

bool TcpTransport::IsDone(Request request) const {
  const Peer& p = peers_[request & kPeerMask];
  const uint64_t index = (request >> (kPeerBits + 1)) - 1;
  if ((request >> kPeerBits) & 1) return p.recvs_done > index;
  if (p.sends_written <= index) return false;
  // Written; done unless it is a PULL still waiting for its ACK (`unacked` is in index order).
  const auto it = std::lower_bound(p.unacked.begin(), p.unacked.end(), index,
                                   [](const Unacked& u, uint64_t i) { return u.index < i; });
  return it == p.unacked.end() || it->index != index;
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
    if ((!peers_[p].recvs.empty() || ReadsAhead(peers_[p])) && broken_.ok()) ServiceRecv(p);
  }
}

// A rank waiting for ACKs reads past the receives it has posted (see the header comment).
bool TcpTransport::ReadsAhead(const Peer& peer) const {
  return !peer.unacked.empty() && peer.ahead_bytes < kReadAheadBytes &&
         peer.rx_mode != RxMode::kParked;
}

bool TcpTransport::WantsRead(const Peer& peer) const {
  if (peer.rx_mode == RxMode::kParked) return false;  // resumes when a receive is posted
  return !peer.recvs.empty() || ReadsAhead(peer);
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
    if (WantsRead(peer)) events |= POLLIN;
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
      SendWritten(peer, op);
      peer.sends.pop_front();
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
    // Messages read ahead come first (the last one may still be arriving).
    if (!peer.recvs.empty() && !peer.ahead.empty() &&
        !(peer.rx_mode == RxMode::kStash && peer.ahead.size() == 1)) {
      ServeAhead(p);
      continue;
    }
    iovec iov[3];
    int n = 0;
    switch (peer.rx_mode) {
      case RxMode::kParked: {
        const FrameHeader& h = peer.rx_header;
        if (!peer.recvs.empty()) {
          AcceptData(p, 0);
          continue;
        }
        if (!drain) return Pump::kIdle;
        peer.ahead.push_back({h.tag, h.bytes, false, 0, {}, false});
        peer.rx_mode = h.bytes > 0 ? RxMode::kStash : RxMode::kHeader;
        continue;
      }
      case RxMode::kHeader: {
        if (peer.recvs.empty() && !drain && !ReadsAhead(peer)) return Pump::kIdle;
        // The previous frame's padding, then this frame's header.
        if (peer.rx_skip > 0) iov[n++] = {pad_sink_, peer.rx_skip};
        iov[n++] = {reinterpret_cast<char*>(&peer.rx_header) + peer.rx_header_got,
                    kHeaderBytes - peer.rx_header_got};
        // Speculatively read the payload with the header (one syscall per small message). If
        // the header turns out not to match, the request fails anyway, and nothing lands
        // outside the posted buffer. Not where the next frame may have no payload: an ACK
        // (while PULLs are unacknowledged) or the PULL this receive expects.
        const RecvOp* front = peer.recvs.empty() ? nullptr : &peer.recvs.front();
        if (front != nullptr && front->bytes > 0 && peer.unacked.empty() &&
            !(peer.same_host.pull_from && front->bytes >= peer.same_host.min_bytes)) {
          iov[n++] = {front->data, front->bytes};
        }
        break;
      }
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
          OnHeader(p, left, drain);
        }
        break;
      }
      case RxMode::kParked:
        break;  // not reached: nothing is read while parked
      case RxMode::kData:
        peer.rx_got += r;
        if (peer.rx_got == peer.recvs.front().bytes) CompleteRecv(peer);
        break;
      case RxMode::kStash:
        peer.ahead.back().payload.append(scratch_.data(), r);
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

void TcpTransport::OnHeader(int p, size_t spill, bool drain) {
  Peer& peer = peers_[p];
  const FrameHeader& h = peer.rx_header;
  peer.rx_got = 0;
  const auto out_of_sync = [&](absl::string_view what) {
    Fail(absl::InternalError(
        absl::StrCat("peer ", p, " sent ", what, "; the connection is out of sync")));
  };
  switch (static_cast<FrameKind>(h.kind)) {
    case FrameKind::kError:
      if (h.bytes > tcp_internal::kMaxErrorReasonBytes) {
        return out_of_sync(absl::StrCat("an error frame of ", h.bytes, " bytes"));
      }
      peer.rx_reason.assign(h.bytes, '\0');
      // The start of the reason may have landed in the posted buffer (speculative read).
      if (const size_t take = std::min<size_t>(spill, h.bytes); take > 0) {
        std::memcpy(&peer.rx_reason[0], peer.recvs.front().data, take);
        peer.rx_got = take;
      }
      peer.rx_mode = RxMode::kError;
      if (peer.rx_got == h.bytes) FinishErrorFrame(p);
      return;
    case FrameKind::kAck:
      // Never read speculatively (no speculation while PULLs are unacknowledged).
      if (spill > 0 || peer.unacked.empty() || peer.unacked.front().tag != h.tag ||
          peer.unacked.front().bytes != h.bytes) {
        return out_of_sync(absl::StrCat("an acknowledgement of ", DescribeTag(h.tag), " (",
                                        h.bytes, " bytes) that this rank is not waiting for"));
      }
      peer.unacked.pop_front();
      peer.rx_mode = RxMode::kHeader;
      return;
    case FrameKind::kPull: {
      // A receive that expected a socket message read on past this header: a size mismatch.
      if (spill > 0) return Fail(MismatchError(p, h.tag, h.bytes));
      if (!peer.same_host.pull_from || h.bytes < peer.same_host.min_bytes) {
        return out_of_sync("a same-host PULL frame, which this connection did not negotiate");
      }
      peer.rx_mode = RxMode::kHeader;
      peer.ahead.push_back({h.tag, h.bytes, true, h.aux, {}, false});
      if (!peer.recvs.empty()) ServeAhead(p);
      return;
    }
    case FrameKind::kData:
      if (!peer.recvs.empty()) return AcceptData(p, spill);
      // Nobody asked for this message yet: stage it if it is small (reading ahead for ACKs)
      // or the peer is closing (its stream is drained); otherwise leave it in the socket.
      if (!drain && (h.bytes > kReadAheadBytes - peer.ahead_bytes)) {
        peer.rx_mode = RxMode::kParked;
        return;
      }
      peer.ahead.push_back({h.tag, h.bytes, false, 0, {}, !drain});
      if (!drain) peer.ahead_bytes += h.bytes;
      peer.rx_mode = h.bytes > 0 ? RxMode::kStash : RxMode::kHeader;
      return;
  }
  out_of_sync(absl::StrCat("a corrupt frame header (kind 0x", absl::Hex(h.kind), ")"));
}

// The DATA frame in rx_header is for the posted receive at the front; `spill` of its payload
// bytes already landed there.
void TcpTransport::AcceptData(int p, size_t spill) {
  Peer& peer = peers_[p];
  const FrameHeader& h = peer.rx_header;
  const RecvOp& op = peer.recvs.front();
  if (h.tag != op.tag || h.bytes != op.bytes) return Fail(MismatchError(p, h.tag, h.bytes));
  peer.rx_mode = RxMode::kData;
  peer.rx_got = spill;
  if (spill == op.bytes) CompleteRecv(peer);
}

// Completes posted receives from the messages read ahead, in order.
void TcpTransport::ServeAhead(int p) {
  Peer& peer = peers_[p];
  while (broken_.ok() && !peer.recvs.empty() && !peer.ahead.empty() &&
         !(peer.rx_mode == RxMode::kStash && peer.ahead.size() == 1)) {
    Ahead& m = peer.ahead.front();
    const RecvOp& op = peer.recvs.front();
    if (m.tag != op.tag || m.bytes != op.bytes) return Fail(MismatchError(p, m.tag, m.bytes));
    if (m.pulled) {
      // A peer that left may have freed the buffer: its message is lost with it.
      if (peer.departed != Departure::kNone) return Fail(DepartureError(p));
      if (!Pull(p, op.data, m.address, m.tag, m.bytes)) return;
      QueueAck(p, m.tag, m.bytes);
    } else {
      if (op.bytes > 0) std::memcpy(op.data, m.payload.data(), op.bytes);
      if (m.counted) peer.ahead_bytes -= m.bytes;
    }
    peer.ahead.pop_front();
    FinishRecv(peer);
  }
}

bool TcpTransport::Pull(int p, char* dst, uint64_t address, uint64_t tag, uint64_t bytes) {
  const pid_t pid = peers_[p].same_host.pid;
  const int err = tcp_internal::ReadProcessMemory(pid, address, dst, bytes);
  if (err != 0) {
    Fail(absl::UnavailableError(absl::StrCat(
        "reading ", DescribeTag(tag), " (", bytes, " bytes) from the memory of peer ", p,
        " (pid ", pid, ", same-host copy) failed: ", ErrnoString(err),
        err == ESRCH ? "; the peer's process is gone" : "")));
    return false;
  }
  ++pulled_messages_;
  return true;
}

// Queues (and tries to write at once) the ACK of a pulled message. A write error is left for
// PumpSend to find, so the receive path never closes a peer under itself.
void TcpTransport::QueueAck(int p, uint64_t tag, uint64_t bytes) {
  Peer& peer = peers_[p];
  SendOp op{nullptr, 0, 0, MakeHeader(FrameKind::kAck, tag, bytes), kControl};
  if (peer.sends.empty() && peer.fd.valid()) {
    const ssize_t n =
        ::send(peer.fd.get(), &op.header, kHeaderBytes, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n == static_cast<ssize_t>(kHeaderBytes)) return;
    if (n > 0) op.done = n;
  }
  peer.sends.push_back(op);
}

void TcpTransport::FinishRecv(Peer& peer) {
  peer.recvs.pop_front();
  ++peer.recvs_done;
}

void TcpTransport::CompleteRecv(Peer& peer) {
  peer.rx_skip = FramePad(peer.recvs.front().bytes);
  FinishRecv(peer);
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
