// TcpTransport: the Transport of the tcp backend (//comm/tcp:tcp_transport), a Gloo-style full
// mesh of TCP connections. //comm/tcp turns it into a Communicator through
// CreateTransportCommunicator; tests and benchmarks may drive it directly.
//
// Design (see transport.h for the contract it implements):
// * Setup: one connection per peer, made through the store (internal/mesh.h), bounded by
//   CommConfig::timeout. Every socket is non-blocking with TCP_NODELAY.
// * Wire: each message is a 32-byte header (kind, tag, bytes), the payload, and zero padding to a
//   16-byte boundary (internal/wire.h). Sends write all three with one sendmsg; receives read the
//   header and the payload straight into the user's buffer (no staging copy, no allocation per
//   byte).
// * Back-pressure: bytes from a peer are read only while a receive from that peer is posted, so a
//   fast sender is throttled by the kernel's socket buffers, never by our memory. A closed peer
//   is still noticed at once (POLLRDHUP).
// * Progress: single-threaded, inside Wait()/Poll(). Isend tries to write the whole message
//   before returning; Wait first makes progress without sleeping and only then poll()s the
//   sockets and an eventfd that Cancel() signals.
// * Failure: the first error breaks the transport. Shutdown(reason) sends the reason to every
//   peer (bounded to ~100 ms) before closing, so their errors read "peer 3 (10.0.0.2:41234)
//   failed: <reason>". A peer that vanishes without one is "peer 3 (10.0.0.2:41234) closed the
//   connection after 4096/8192 bytes of all_reduce #12". Every error about a peer names its
//   rank and the address it published (the host, on a multi-host job). Ranks fail and finish at different times, so whatever a departed peer sent
//   before it left is still delivered: once its close is noticed, the rest of its stream is read
//   out of the kernel into a stash (bounded by the socket buffers). A peer that failed or
//   vanished breaks this transport as soon as its stash is consumed (after one more sweep of the
//   other peers' sockets, so an operation whose messages have all arrived still completes) and
//   at the next Poll(). A clean Shutdown(OK) (a communicator that finished) breaks it only when
//   this rank sends to that peer or posts a receive its stash cannot satisfy. The code is in
//   tcp_transport_errors.cc.
// * Same host: where a peer runs on this host and may be read with process_vm_readv (negotiated
//   per connection at setup, internal/same_host.h; the socket is used wherever it fails), a
//   message of at least "tcp.cma_min_bytes" travels as a PULL frame naming its address: the
//   receiver copies it straight from the sender's memory into the posted buffer (one copy
//   instead of two plus the TCP stack) and answers with an ACK, which completes the send. Such
//   sends complete only once the receiver has matched them (rendezvous, which the Communicator
//   contract allows and the collective schedules are built for). To read ACKs while nothing is
//   posted from that peer, a rank with unacknowledged PULLs reads ahead in the peer's stream:
//   PULL frames (no payload) are queued, small DATA frames are staged up to kReadAheadBytes, and
//   a larger one stops the read-ahead until its receive is posted (back-pressure still holds).
#pragma once

#include <poll.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "comm/algorithms/transport.h"
#include "comm/config.h"
#include "comm/store/store.h"
#include "comm/tcp/internal/same_host.h"
#include "comm/tcp/internal/socket.h"
#include "comm/tcp/internal/wire.h"

namespace fairscale::comm {

namespace tcp_internal {
class TcpTransportForTesting;  // internal/transport_for_testing.h (test-only)
}  // namespace tcp_internal

// Options of the tcp backend, parsed from CommConfig::options (keys "tcp.*"; "algo.*" keys are
// left to the algorithms, anything else is kInvalidArgument). Byte counts; 0 = kernel autotuning.
//   "tcp.send_buffer_bytes"  SO_SNDBUF of every connection (default 512 KiB, which the kernel
//                            doubles). Measured on loopback: a send buffer this small keeps the
//                            bytes in flight cache-resident and beat autotuning (up to 4 MiB) by
//                            1.3-2x for messages of 512 KiB and up.
//   "tcp.recv_buffer_bytes"  SO_RCVBUF (default 0: autotuning; pinning it only lost bandwidth).
//                            At least kMinRecvBufferBytes: a window below one segment stalls.
//   "tcp.cma_min_bytes"      messages of at least this many bytes to a peer on the same host are
//                            read by the receiver from the sender's memory (default 64 KiB; 0
//                            keeps everything on the socket). The two ends of a connection use
//                            the larger of their values.
inline constexpr int kMinRecvBufferBytes = 64 << 10;
struct TcpOptions {
  int send_buffer_bytes = 512 << 10;
  int recv_buffer_bytes = 0;
  int cma_min_bytes = 64 << 10;
};
// Read-ahead of a peer that owes this rank ACKs: DATA frames of up to this many bytes in all are
// staged while no receive is posted for them.
inline constexpr size_t kReadAheadBytes = 1 << 20;
absl::StatusOr<TcpOptions> ParseTcpOptions(const CommConfig& config);

class TcpTransport final : public Transport {
 public:
  // Connects the full mesh (blocking, collective, bounded by config.timeout). `store` should be
  // private to this communicator (TransportCommunicator passes a PrefixStore); config.rank and
  // config.size are ignored in favour of `rank` and `size`.
  static absl::StatusOr<std::unique_ptr<TcpTransport>> Create(std::shared_ptr<Store> store,
                                                              int rank, int size,
                                                              const CommConfig& config);
  ~TcpTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Request Isend(int peer, uint64_t tag, const void* data, size_t bytes) override;
  Request Irecv(int peer, uint64_t tag, void* data, size_t bytes) override;
  absl::Status Wait(absl::Span<const Request> requests, absl::Time deadline) override;
  absl::Status Poll() override;
  void Cancel(const absl::Status& reason) override;
  std::string PeerAddress(int peer) const override { return peers_[peer].address; }
  void Shutdown(const absl::Status& reason) override;

  // Peers whose large messages this rank reads from their memory (same-host copies).
  int same_host_peers() const;
  // Messages received that way so far.
  uint64_t pulled_messages() const { return pulled_messages_; }

 private:
  friend class tcp_internal::TcpTransportForTesting;

  // Index of a SendOp that is not a request (an ACK).
  static constexpr uint64_t kControl = ~uint64_t{0};
  struct SendOp {
    const char* data;
    size_t bytes;  // payload bytes on the wire (0 for PULL and ACK frames)
    size_t done;   // of tcp_internal::FrameBytes(bytes)
    tcp_internal::FrameHeader header;
    uint64_t index;  // the request's per-peer index, or kControl
  };
  // A PULL this rank sent whose ACK has not arrived: its request is not done yet.
  struct Unacked {
    uint64_t index;
    uint64_t tag;
    uint64_t bytes;
  };
  struct RecvOp {
    char* data;
    size_t bytes;
    uint64_t tag;
  };
  // What the bytes arriving from a peer are being read into. kParked: a DATA header was read
  // ahead and its payload stays in the socket until a receive is posted for it.
  enum class RxMode { kHeader, kData, kStash, kError, kParked };
  // How a peer left: Shutdown(OK), Shutdown(error), or without a word (crash, reset).
  enum class Departure { kNone, kShutDown, kFailed, kVanished };
  // A message read before this rank posted its receive: read ahead (a PULL, or a small DATA
  // frame) while waiting for ACKs, or drained from a closing peer.
  struct Ahead {
    uint64_t tag;
    uint64_t bytes;
    bool pulled;      // a PULL: the message is still in the peer's memory at `address`
    uint64_t address;
    std::string payload;  // DATA: the message
    bool counted;         // its payload counts towards Peer::ahead_bytes
  };
  struct Peer {
    tcp_internal::UniqueFd fd;
    std::string address;
    std::deque<SendOp> sends;
    std::deque<RecvOp> recvs;
    // Receives complete in posting order, so "done" is a count. Sends are written in order; a
    // written one is done unless it is a PULL still waiting for its ACK.
    uint64_t sends_posted = 0, sends_written = 0;
    uint64_t recvs_posted = 0, recvs_done = 0;
    std::deque<Unacked> unacked;
    tcp_internal::SameHostPeer same_host;
    tcp_internal::FrameHeader rx_header{};
    size_t rx_header_got = 0;
    RxMode rx_mode = RxMode::kHeader;
    size_t rx_got = 0;  // payload bytes of the current frame consumed so far
    std::string rx_reason;
    size_t rx_skip = 0;  // padding of the previous frame still to be read
    // Set once the peer is gone (fd closed). `ahead` holds the messages it sent that no receive
    // has claimed yet (in order); they are still delivered.
    Departure departed = Departure::kNone;
    std::string departure_detail;  // kFailed: the peer's reason; kVanished: the socket error
    std::deque<Ahead> ahead;
    size_t ahead_bytes = 0;  // staged DATA payload in `ahead` while the peer is connected
  };
  enum class Pump { kIdle, kBlocked, kClosed, kStopped };

  TcpTransport(int rank, int size, std::vector<Peer> peers, tcp_internal::UniqueFd event_fd);
  // The transport over connections that are set up (handshake and same-host negotiation done):
  // Create's last step, and what the test-only factory builds on.
  static absl::StatusOr<std::unique_ptr<TcpTransport>> FromConnections(
      int rank, std::vector<tcp_internal::MeshPeer> mesh,
      const std::vector<tcp_internal::SameHostPeer>& same_host);

  bool IsDone(Request request) const;
  void Fail(absl::Status status);
  void CheckCancel();
  void ProgressAll();
  bool PollOnce(absl::Duration timeout);
  void PumpSend(int p);
  Pump PumpRecv(int p, bool drain, int* err);
  void ServiceRecv(int p);
  void OnHeader(int p, size_t spill, bool drain);
  void AcceptData(int p, size_t spill);
  void ServeAhead(int p);
  bool Pull(int p, char* dst, uint64_t address, uint64_t tag, uint64_t bytes);
  void QueueAck(int p, uint64_t tag, uint64_t bytes);
  void SendWritten(Peer& peer, const SendOp& op);
  bool ReadsAhead(const Peer& peer) const;
  bool WantsRead(const Peer& peer) const;
  void FinishRecv(Peer& peer);
  void CompleteRecv(Peer& peer);
  void FinishErrorFrame(int p);
  void PeerClosed(int p, int err);
  void Depart(int p, Departure how, std::string detail);
  void ServeDeparted(int p);
  absl::Status DepartureError(int p) const;
  bool FailForDepartedPeer(bool idle);
  absl::Status MismatchError(int p, uint64_t tag, uint64_t bytes) const;
  std::string Progress(int p) const;
  // "peer 3 (10.0.0.2:41234)": the rank and where it is (the address it published), so that an
  // error on a multi-host job names the host whose link, process or machine failed.
  std::string PeerName(int p) const;
  absl::Status DeadlineError() const;
  // What this rank is still waiting for, per peer ("peer 1 (10.0.0.1:4000): received 0/4000
  // bytes of all_reduce #3; ..."); "" when nothing is outstanding.
  std::string Outstanding() const;
  void SendErrorFrames(const absl::Status& reason);

  const int rank_;
  const int size_;
  std::vector<Peer> peers_;
  tcp_internal::UniqueFd event_fd_;
  absl::Status broken_;
  bool shut_down_ = false;
  bool departures_ = false;  // some peer failed or vanished (Departure::kFailed / kVanished)
  std::vector<char> scratch_;  // staging for frames read past the posted receives while draining
  char pad_sink_[tcp_internal::kStreamAlignment];  // sink for frame padding
  std::vector<pollfd> pollfds_;
  std::vector<int> poll_peers_;
  uint64_t pulled_messages_ = 0;

  std::atomic<bool> cancelled_{false};
  absl::Mutex cancel_mu_;
  absl::Status cancel_reason_ ABSL_GUARDED_BY(cancel_mu_);
};

// TransportFactory for CreateTransportCommunicator (see transport_communicator.h).
absl::StatusOr<std::unique_ptr<Transport>> CreateTcpTransport(std::shared_ptr<Store> store,
                                                              int rank, int size,
                                                              const CommConfig& config);

}  // namespace fairscale::comm
