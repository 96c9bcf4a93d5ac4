// TcpTransport, the part that deals with endings: peers that fail, vanish or shut down (error
// frames, draining their stream into the stash, when their departure becomes this rank's error),
// the deadline message, and this rank's own Shutdown(). The data path is in tcp_transport.cc.
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/tcp/tcp_transport.h"

namespace fairscale::comm {

using tcp_internal::ErrnoString;
using tcp_internal::FrameHeader;
using tcp_internal::FrameIov;
using tcp_internal::FrameKind;
using tcp_internal::PayloadSent;
using tcp_internal::PollTimeoutMs;
using tcp_internal::WouldBlock;

namespace {
constexpr absl::Duration kShutdownBudget = absl::Milliseconds(100);
constexpr int kMaxIov = 64;
}  // namespace

absl::Status TcpTransport::MismatchError(int p, uint64_t tag, uint64_t bytes) const {
  const RecvOp& op = peers_[p].recvs.front();
  return absl::InvalidArgumentError(absl::StrCat(
      "peer ", p, " sent ", DescribeTag(tag), " with ", bytes, " bytes but this rank expects ",
      DescribeTag(op.tag), " with ", op.bytes, " bytes"));
}

void TcpTransport::FinishErrorFrame(int p) {
  Peer& peer = peers_[p];
  const auto code = static_cast<absl::StatusCode>(peer.rx_header.tag);
  peer.rx_mode = RxMode::kHeader;
  peer.rx_got = 0;
  // Nothing follows an ERROR frame.
  if (code == absl::StatusCode::kOk) {
    Depart(p, Departure::kShutDown, "");
  } else {
    Depart(p, Departure::kFailed, std::move(peer.rx_reason));
  }
}

void TcpTransport::PeerClosed(int p, int err) {
  if (!broken_.ok() || peers_[p].departed != Departure::kNone) return;
  // Read what the peer wrote before it went away, in order: messages for posted receives
  // complete, later ones are stashed, and its ERROR frame, if it sent one, says why it left.
  int drain_err = 0;
  const Pump r = PumpRecv(p, /*drain=*/true, &drain_err);
  if (!broken_.ok() || peers_[p].departed != Departure::kNone) return;
  if (r == Pump::kClosed && drain_err != 0) err = drain_err;
  Depart(p, Departure::kVanished,
         err != 0 && err != EPIPE ? absl::StrCat(" (", ErrnoString(err), ")") : "");
}

void TcpTransport::Depart(int p, Departure how, std::string detail) {
  Peer& peer = peers_[p];
  peer.departed = how;
  if (how != Departure::kShutDown) departures_ = true;
  peer.departure_detail = std::move(detail);
  peer.fd.Reset();
  // A message cut off mid-stash can never be delivered.
  if (peer.rx_mode == RxMode::kStash) {
    if (peer.ahead.back().counted) peer.ahead_bytes -= peer.ahead.back().bytes;
    peer.ahead.pop_back();
    peer.rx_mode = RxMode::kHeader;
  }
  // ACKs owed to it are moot.
  peer.sends.erase(std::remove_if(peer.sends.begin(), peer.sends.end(),
                                  [](const SendOp& op) { return op.index == kControl; }),
                   peer.sends.end());
  ServeDeparted(p);
}

void TcpTransport::ServeDeparted(int p) {
  Peer& peer = peers_[p];
  // A receive whose message was cut off mid-payload cannot complete.
  if (broken_.ok() && !peer.recvs.empty() && peer.rx_mode == RxMode::kData) {
    return Fail(DepartureError(p));
  }
  ServeAhead(p);
  // Nothing left that the receives could be satisfied from, or sends nobody will read.
  if (broken_.ok() && (!peer.recvs.empty() || !peer.sends.empty() || !peer.unacked.empty())) {
    Fail(DepartureError(p));
  }
}

bool TcpTransport::FailForDepartedPeer(bool idle) {
  int culprit = -1;
  for (int p = 0; p < size_ && culprit < 0; ++p) {
    const Peer& peer = peers_[p];
    const bool gone =
        peer.departed == Departure::kFailed || peer.departed == Departure::kVanished;
    // While an operation runs, what the peer sent before leaving is consumed first.
    if (gone && (idle || peer.ahead.empty())) culprit = p;
  }
  if (culprit < 0 || !broken_.ok()) return false;
  // Messages from the others that caused this departure are already in our sockets (the failure
  // happened after they were sent): let them complete what they can before the error lands.
  if (!idle) ProgressAll();
  Fail(DepartureError(culprit));
  return true;
}

absl::Status TcpTransport::DepartureError(int p) const {
  const Peer& peer = peers_[p];
  switch (peer.departed) {
    case Departure::kFailed:
      return absl::UnavailableError(
          absl::StrCat(PeerName(p), " failed: ", peer.departure_detail));
    case Departure::kShutDown:
      return absl::UnavailableError(
          absl::StrCat(PeerName(p), " shut down and closed the connection", Progress(p)));
    case Departure::kVanished:
    case Departure::kNone:
      break;
  }
  return absl::UnavailableError(absl::StrCat(PeerName(p), " closed the connection", Progress(p),
                                             peer.departure_detail));
}

std::string TcpTransport::PeerName(int p) const {
  const std::string& address = peers_[p].address;
  return address.empty() ? absl::StrCat("peer ", p) : absl::StrCat("peer ", p, " (", address, ")");
}

std::string TcpTransport::Progress(int p) const {
  const Peer& peer = peers_[p];
  if (!peer.recvs.empty()) {
    const RecvOp& op = peer.recvs.front();
    const size_t got = peer.rx_mode == RxMode::kData ? peer.rx_got : 0;
    return absl::StrCat(" after ", got, "/", op.bytes, " bytes of ", DescribeTag(op.tag));
  }
  if (!peer.unacked.empty()) {
    const Unacked& u = peer.unacked.front();
    return absl::StrCat(" before reading ", DescribeTag(u.tag), " (", u.bytes,
                        " bytes) from this rank's memory");
  }
  for (const SendOp& op : peer.sends) {
    if (op.index == kControl) continue;
    return absl::StrCat(" while this rank was sending ", DescribeTag(op.header.tag), " (",
                        PayloadSent(op.done, op.bytes), "/", op.bytes, " bytes sent)");
  }
  return "";
}

absl::Status TcpTransport::DeadlineError() const {
  return absl::DeadlineExceededError(
      absl::StrCat("deadline exceeded while waiting for ", Outstanding()));
}

std::string TcpTransport::Outstanding() const {
  std::vector<std::string> waiting;
  for (int p = 0; p < size_; ++p) {
    const Peer& peer = peers_[p];
    std::vector<std::string> what;
    if (!peer.recvs.empty()) {
      const RecvOp& op = peer.recvs.front();
      const size_t got = peer.rx_mode == RxMode::kData ? peer.rx_got : 0;
      what.push_back(absl::StrCat("received ", got, "/", op.bytes, " bytes of ",
                                  DescribeTag(op.tag)));
      if (peer.recvs.size() > 1) {
        absl::StrAppend(&what.back(), " (+", peer.recvs.size() - 1, " more receives)");
      }
    }
    if (!peer.unacked.empty()) {
      const Unacked& u = peer.unacked.front();
      what.push_back(absl::StrCat("waiting for peer ", p, " to read ", DescribeTag(u.tag), " (",
                                  u.bytes, " bytes) from this rank's memory"));
      if (peer.unacked.size() > 1) {
        absl::StrAppend(&what.back(), " (+", peer.unacked.size() - 1, " more)");
      }
    }
    const auto first = std::find_if(peer.sends.begin(), peer.sends.end(),
                                    [](const SendOp& op) { return op.index != kControl; });
    if (first != peer.sends.end()) {
      const size_t more = std::count_if(first + 1, peer.sends.end(),
                                        [](const SendOp& op) { return op.index != kControl; });
      what.push_back(absl::StrCat("sent ", PayloadSent(first->done, first->bytes), "/",
                                  first->header.kind == static_cast<uint32_t>(FrameKind::kPull)
                                      ? first->header.bytes
                                      : first->bytes,
                                  " bytes of ", DescribeTag(first->header.tag)));
      if (more > 0) absl::StrAppend(&what.back(), " (+", more, " more sends)");
    }
    if (!what.empty()) {
      waiting.push_back(absl::StrCat(PeerName(p), ": ", absl::StrJoin(what, ", ")));
    }
  }
  return absl::StrJoin(waiting, "; ");
}

void TcpTransport::Shutdown(const absl::Status& reason) {
  if (shut_down_) return;
  shut_down_ = true;
  SendErrorFrames(reason);
  for (int p = 0; p < size_; ++p) {
    Peer& peer = peers_[p];
    if (!peer.fd.valid()) continue;
    ::shutdown(peer.fd.get(), SHUT_WR);
    // Closing a socket with unread bytes sends a reset, which can overtake our ERROR frame on
    // its way to the peer's application: discard what already arrived first.
    char sink[4096];
    for (int i = 0; i < 256; ++i) {
      if (::recv(peer.fd.get(), sink, sizeof(sink), MSG_DONTWAIT) <= 0) break;
    }
    peer.fd.Reset();
  }
  Fail(reason.ok() ? absl::AbortedError("transport was shut down") : reason);
}

void TcpTransport::SendErrorFrames(const absl::Status& reason) {
  std::string message = reason.ok() ? "shut down" : std::string(reason.message());
  if (message.size() > tcp_internal::kMaxErrorReasonBytes) {
    message.resize(tcp_internal::kMaxErrorReasonBytes);
  }
  const FrameHeader header{static_cast<uint32_t>(FrameKind::kError), 0,
                           static_cast<uint64_t>(reason.code()), message.size(), 0};
  // Per peer, the bytes still to write: the rest of a half-written message (a frame cannot be
  // interrupted), then the ERROR frame.
  struct Out {
    int peer;
    std::vector<iovec> parts;
    size_t first = 0;
  };
  std::vector<Out> outs;
  for (int p = 0; p < size_; ++p) {
    Peer& peer = peers_[p];
    if (p == rank_ || !peer.fd.valid()) continue;
    Out out{p, {}, 0};
    iovec iov[3];
    if (!peer.sends.empty() && peer.sends.front().done > 0) {
      const SendOp& op = peer.sends.front();
      out.parts.insert(out.parts.end(), iov, iov + FrameIov(&op.header, op.data, op.done, iov));
    }
    out.parts.insert(out.parts.end(), iov, iov + FrameIov(&header, message.data(), 0, iov));
    outs.push_back(std::move(out));
  }
  const absl::Time deadline = absl::Now() + kShutdownBudget;
  std::vector<pollfd> fds;
  while (true) {
    fds.clear();
    for (Out& out : outs) {
      while (out.first < out.parts.size()) {
        msghdr msg{};
        msg.msg_iov = &out.parts[out.first];
        msg.msg_iovlen = std::min<size_t>(out.parts.size() - out.first, kMaxIov);
        const ssize_t r =
            ::sendmsg(peers_[out.peer].fd.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
          if (!WouldBlock(errno)) out.first = out.parts.size();  // the peer is gone
          break;
        }
        size_t left = r;
        while (left > 0 && out.first < out.parts.size()) {
          iovec& part = out.parts[out.first];
          const size_t take = std::min(left, part.iov_len);
          part.iov_base = static_cast<char*>(part.iov_base) + take;
          part.iov_len -= take;
          left -= take;
          if (part.iov_len == 0) ++out.first;
        }
      }
      if (out.first < out.parts.size()) fds.push_back({peers_[out.peer].fd.get(), POLLOUT, 0});
    }
    const absl::Duration left = deadline - absl::Now();
    if (fds.empty() || left <= absl::ZeroDuration()) return;
    ::poll(fds.data(), fds.size(), PollTimeoutMs(left));
  }
}

}  // namespace fairscale::comm
