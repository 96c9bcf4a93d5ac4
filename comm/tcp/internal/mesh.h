// Full-mesh connection setup of the tcp backend (internal to //comm/tcp; TcpTransport::Create
// calls it once per communicator).
//
// Every rank listens on `bind_address` with an OS-assigned port and publishes
// "nonce/<rank>" = a random 64-bit listener nonce, then "addr/<rank>" = "host:port", in the
// (communicator-private) store. Rank r connects to every rank below it and accepts every rank
// above it; both sides of each connection exchange and validate a Hello (magic, protocol
// version, the listener's nonce, ranks, world size). The nonce keeps communicators apart where
// the store cannot: a rank of an old communicator (an earlier epoch, comm/replace.h) that
// connects late to an address it read then, now a reused port of a new communicator's listener,
// sends the old nonce; the listener answers and drops it (logged, never joined, the new mesh
// goes on), and the stale side fails with kFailedPrecondition "... belongs to another
// communicator ...". All connects, retries and
// handshakes run concurrently in one poll loop, bounded by `timeout` (ranks slow to join), or by
// `refused_timeout` for a published address that refuses every connect. A connection that does
// not open with the magic (a port scanner, a stale client) is closed and ignored; a real peer
// whose rank, size or version disagree is kInvalidArgument naming it. The listener is closed on
// return.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/store/store.h"
#include "comm/tcp/internal/socket.h"

namespace fairscale::comm::tcp_internal {

struct MeshOptions {
  std::string bind_address = "127.0.0.1";
  absl::Duration timeout = absl::Minutes(1);
  // A peer published its address only once it listened there, so connects to it that keep
  // being refused (or find no route) mean that address is wrong from where this rank runs,
  // typically a loopback address advertised to a rank on another host: after this long (and at
  // least 3 attempts) ConnectMesh fails with kUnavailable instead of waiting out `timeout`.
  absl::Duration refused_timeout = absl::Seconds(5);
  // SO_SNDBUF / SO_RCVBUF of every connection; 0 keeps the kernel's autotuning.
  int send_buffer_bytes = 0;
  int recv_buffer_bytes = 0;
};

struct MeshPeer {
  UniqueFd fd;          // connected, non-blocking, TCP_NODELAY; invalid at index `rank`
  std::string address;  // the peer's "host:port", for error messages
};

// Returns one connection per rank (indexed by rank). Errors are prefixed with
// "tcp rendezvous rank r/n".
absl::StatusOr<std::vector<MeshPeer>> ConnectMesh(Store& store, int rank, int size,
                                                  const MeshOptions& options);

struct Hello;  // wire.h

// Validation of a peer's Hello, pure (ConnectMesh applies it; //comm/tcp/fuzz fuzzes it). OK, or
// kInvalidArgument naming the peer and `address` (ConnectMesh prefixes its rank).
// CheckHello: the first Hello on a connection this rank (`rank` of `size`) accepted, whose
// magic the caller has checked (a stray connection without it is dropped unanswered): the
// version, the world size, and that it comes from a higher rank and is meant for this one.
absl::Status CheckHello(const Hello& hello, int rank, int size, absl::string_view address);
// CheckReply: the answer on a connection this rank opened to `peer`.
absl::Status CheckReply(const Hello& hello, int rank, int size, int peer,
                        absl::string_view address);

}  // namespace fairscale::comm::tcp_internal
