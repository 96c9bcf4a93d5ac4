// TCPStore: the multi-machine rendezvous Store (//comm/store:tcp_store). One process (rank 0, or
// the launcher's agent) creates it with is_server = true and hosts the key-value server; every
// other process creates a client pointed at that host:port. CreateCommunicatorFromEnv builds one
// from MASTER_ADDR/MASTER_PORT.
//
// Compared with c10d's TCPStore:
// * Nothing blocks without a deadline: the initial connect retries with backoff until
//   `timeout`, every request waits at most `timeout` (Get/Wait: their own timeout, enforced by
//   the server too; a timeout under 50 ms still allows one 50 ms round trip so that a present
//   key is returned), and a dead server is noticed at once (kUnavailable naming host:port), not
//   after a hang. Name resolution (getaddrinfo) is the one step the deadline cannot interrupt.
// * One connection serves many threads at once: requests carry an id and replies are matched
//   by id, so a Get parked on the server does not block a Set from another thread.
// * The server is one poll()-driven thread over non-blocking sockets. It parks Get/Wait until
//   the keys exist (or their timeout passes), rejects malformed or oversized frames before
//   buffering them (see wire.h) by closing that connection only, and applies backpressure to a
//   client that stops reading its replies.
// * A job token (TCPStoreOptions::token) keeps other jobs' and stray clients off the server:
//   every connection opens with a Hello carrying it, and a wrong or missing token is answered
//   with kUnauthenticated and the connection closed.
// * What a client can cost the server is bounded (TCPStoreServerLimits). Until a connection has
//   presented the token, the server accepts only a Hello of at most 1 KiB and closes the
//   connection at the header of anything else, without buffering its body; at most
//   max_unauthenticated_connections (128) wait for their Hello at once (a new one beyond that
//   evicts the oldest, so a flood cannot lock legitimate clients out, and clients reconnect
//   when closed before their Hello is answered), and each must present the token within
//   handshake_timeout (10 s) of being accepted. An admitted connection may announce a request
//   of at most max_request_bytes, and all partly received requests together may hold at most
//   max_buffered_bytes (512 MiB): past either the client gets kResourceExhausted and the
//   connection closes. A connection stalled in the middle of a frame for read_timeout (30 s)
//   is closed; one idle between requests (a Get parked for an hour) never is. When accept()
//   runs out of descriptors the server stops polling the listener for 100 ms-1 s (backing
//   off) instead of spinning, and such events are logged at most once per 10 s with a count.
//
// Thread-safety: all methods may be called concurrently. The server, if any, stops (and every
// client connected to it sees kUnavailable) when the TCPStore that hosts it is destroyed.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/store/store.h"

namespace fairscale::comm {

// Server only: the bounds on what clients can cost the server (see the header comment).
struct TCPStoreServerLimits {
  // Connections that have not presented the job token yet (servers with a token only).
  int max_unauthenticated_connections = 128;
  // How long a connection may take to present the job token after it is accepted.
  absl::Duration handshake_timeout = absl::Seconds(10);
  // How long a connection may stall in the middle of a frame (idle connections are exempt).
  absl::Duration read_timeout = absl::Seconds(30);
  // The largest request frame (header, key and value) a connection may announce. The default
  // admits every valid request (a CompareSet of two 64 MiB values).
  uint64_t max_request_bytes = 24 + kMaxStoreKeyBytes + 8 + 2 * uint64_t{kMaxStoreValueBytes};
  // All partly received requests of all connections together (announced frame sizes).
  uint64_t max_buffered_bytes = uint64_t{512} << 20;
};

struct TCPStoreOptions {
  // Server: the address to bind (loopback unless told otherwise). Client: where to connect.
  std::string host = "127.0.0.1";
  // 0 lets the OS pick (server only); port() reports the real one.
  int port = 0;
  bool is_server = false;
  // Bounds the initial connect, and every request other than Get/Wait unless request_timeout
  // is set.
  absl::Duration timeout = absl::Minutes(5);
  // When positive, bounds every request other than Get/Wait instead of `timeout`: a process that
  // must not stall long on an unreachable server (fs_launch supervising its ranks) waits long
  // for the first connect and briefly for each request. A request that timed out may still
  // reach the server later (its reply is then dropped): prefer idempotent ones (Set, Check).
  absl::Duration request_timeout = absl::ZeroDuration();
  // When num_workers > 0, every TCPStore (the server's included) counts itself in on creation,
  // and with wait_for_workers the server's Create returns only once num_workers have (or fails
  // with kDeadlineExceeded after `timeout`).
  int num_workers = 0;
  bool wait_for_workers = false;
  // The job's shared secret (the launcher passes it as FS_STORE_TOKEN). Server: when non-empty,
  // a client must present it first thing, or its connection is closed. Client: presented on
  // connect; a server that rejects it makes Create fail with kUnauthenticated at once.
  // Not a substitute for a private network: it travels in clear text.
  std::string token;
  // Server only.
  TCPStoreServerLimits server_limits;
};

namespace tcp_store_internal {
class Server;
class Client;
}  // namespace tcp_store_internal

class TCPStore : public Store {
 public:
  // Server: binds and starts the server thread, then connects a client to it. Client: connects,
  // retrying until options.timeout (kDeadlineExceeded naming host:port and the last error).
  static absl::StatusOr<std::unique_ptr<TCPStore>> Create(TCPStoreOptions options);
  ~TCPStore() override;

  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override;
  absl::StatusOr<std::string> CompareSet(absl::string_view key, absl::string_view expected,
                                         absl::string_view desired) override;
  absl::StatusOr<bool> Delete(absl::string_view key) override;
  absl::Status Wait(absl::Span<const std::string> keys, absl::Duration timeout) override;
  absl::StatusOr<bool> Check(absl::string_view key) override;

  const std::string& host() const { return options_.host; }
  // The server's port (the OS-assigned one when options.port was 0).
  int port() const { return options_.port; }
  bool is_server() const { return server_ != nullptr; }

  // Key under which workers count themselves in when num_workers > 0.
  static constexpr absl::string_view kWorkersKey = "__tcpstore/workers";
  static constexpr absl::string_view kWorkersReadyKey = "__tcpstore/workers_ready";

 private:
  explicit TCPStore(TCPStoreOptions options);
  absl::Time RequestDeadline() const;

  TCPStoreOptions options_;
  // Declared before client_ so the client (connected to it) is destroyed first.
  std::unique_ptr<tcp_store_internal::Server> server_;
  std::unique_ptr<tcp_store_internal::Client> client_;
};

}  // namespace fairscale::comm
