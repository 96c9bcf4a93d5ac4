// Internals of TCPStore (//comm/store:tcp_store): the server, the client connection and the
// socket helpers they share. Split out so that tcp_store.cc (the Store methods),
// tcp_store_server.cc and tcp_store_client.cc each hold one part. Not for use outside
// comm/store.
#pragma once

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "comm/store/store_util.h"
#include "comm/store/tcp_store.h"
#include "comm/store/wire.h"

namespace fairscale::comm::tcp_store_internal {

using wire::Message;
using wire::WireCommand;

// "'key'" with non-printable bytes escaped; QuoteAll joins several.
std::string Quote(absl::string_view key);
std::string QuoteAll(absl::Span<const std::string> keys);
// "host:port" ("[v6]:port" for IPv6 literals).
std::string HostPort(absl::string_view host, int port);
// Milliseconds until `deadline` for poll(), rounded up; -1 for the infinite future.
int PollMs(absl::Time deadline);
// Now + d (negative d counts as zero); an infinite duration gives the infinite future.
absl::Time DeadlineAfter(absl::Duration d);
// The peer address of a connected socket, for log lines.
std::string PeerName(int fd);
void SetNoDelay(int fd);
// getaddrinfo for a TCP socket; the caller frees the list.
absl::StatusOr<addrinfo*> Resolve(const std::string& host, int port, bool passive);

// ---------------------------------------------------------------------------------------------
// Server: one thread, poll() over the listening socket, a wake-up eventfd and every connection.
// It owns the map outright, so nothing in it needs a lock.
class Server {
 public:
  // A non-empty `token` admits only clients whose first request is a Hello carrying it.
  // `limits` are checked by TCPStore::Create.
  static absl::StatusOr<std::unique_ptr<Server>> Start(const std::string& host, int port,
                                                       std::string token,
                                                       const TCPStoreServerLimits& limits);
  ~Server();

  int port() const { return port_; }

 private:
  struct Conn {
    Conn(uint64_t id, int fd, absl::Time now)
        : id(id),
          fd(fd),
          decoder(wire::Decoder::Direction::kRequests),
          accepted(now),
          last_read(now) {}
    uint64_t id;
    int fd;
    std::string peer;
    wire::Decoder decoder;
    std::string out;  // Replies not yet written, from out_offset on.
    size_t out_offset = 0;
    bool closing = false;
    bool authenticated = false;  // Presented the token (from the start when the server has none).
    absl::Time accepted;
    // When a byte last arrived, or the server last chose not to read (backpressure).
    absl::Time last_read;
    // The announced size of the frame being received, counted in buffered_total_.
    uint64_t reserved = 0;
    absl::flat_hash_set<uint64_t> waiters;

    size_t pending_out() const { return out.size() - out_offset; }
  };

  // A parked Get (one key) or Wait (its keys), answered when every key exists.
  struct Waiter {
    uint64_t conn_id;
    uint32_t request_id;
    WireCommand command;
    std::vector<std::string> keys;
    absl::Time deadline;
  };

  // Stop reading from a client whose unread replies exceed this (backpressure), and drop one
  // whose replies exceed the hard cap (it parked many Gets and stopped reading).
  static constexpr size_t kBackpressureBytes = 8 << 20;
  static constexpr size_t kMaxPendingOutBytes = 512 << 20;
  // Parked Get/Wait requests one connection may hold.
  static constexpr size_t kMaxWaitersPerConn = 4096;
  // Bytes read from one connection per poll round, so one busy client cannot starve the rest.
  static constexpr size_t kReadBudgetBytes = 4 << 20;
  // Connections accepted per poll round, so a flood of connects cannot starve the clients
  // already connected (and a newcomer is read before the next batch can evict it).
  static constexpr int kMaxAcceptsPerRound = 64;
  // Backoff of the listener after accept() fails for lack of descriptors or memory.
  static constexpr absl::Duration kMinAcceptBackoff = absl::Milliseconds(100);
  static constexpr absl::Duration kMaxAcceptBackoff = absl::Seconds(1);
  // Log lines about a class of hostile or failing connections: at most one per this interval.
  static constexpr absl::Duration kLogInterval = absl::Seconds(10);

  // Lets one log line through per kLogInterval and counts the events in between.
  struct LogLimiter {
    absl::Time next = absl::InfinitePast();
    int64_t events = 0;  // Since the last line, this one included.
    // Counts an event; true when a line may be logged now (then reports and resets the count
    // through *count).
    bool Allow(absl::Time now, int64_t* count) {
      ++events;
      if (now < next) return false;
      *count = events;
      events = 0;
      next = now + kLogInterval;
      return true;
    }
  };

  Server(int listen_fd, int wake_fd, int port, std::string name, std::string token,
         const TCPStoreServerLimits& limits)
      : listen_fd_(listen_fd),
        wake_fd_(wake_fd),
        port_(port),
        name_(std::move(name)),
        token_(std::move(token)),
        limits_(limits) {}

  void Run();
  void Accept();
  void ReadFrom(uint64_t id, Conn& conn);
  // Charges the frame `conn` is receiving to the per-connection and total bounds; refuses it
  // (kResourceExhausted to the client, connection closing) and returns false past either.
  bool Reserve(Conn& conn);
  // When `conn` must be closed unless something arrives (InfiniteFuture: never).
  absl::Time Deadline(const Conn& conn) const;
  // Closes the connections past their Deadline.
  void ExpireConns(absl::Time now);
  void Flush(Conn& conn);
  void Close(Conn& conn, const absl::Status& why);
  // Close for a connection that never presented the token: rate-limited logging.
  void CloseUnauthenticated(Conn& conn, const absl::Status& why);
  void Handle(uint64_t conn_id, Conn& conn, Message& m);
  // Admits or rejects a connection on its first request (and checks any later Hello). Returns
  // false when the request must not be handled (the connection is then closing).
  bool Authenticate(Conn& conn, const Message& m);
  void Reply(Conn& conn, absl::FunctionRef<void(std::string*)> encode);
  void Park(uint64_t conn_id, Conn& conn, Message& m);
  bool AllPresent(const std::vector<std::string>& keys) const;
  void AnswerWaiter(const Waiter& w);
  void RemoveWaiter(uint64_t waiter_id);
  void KeyChanged(const std::string& key);
  void ExpireWaiters();

  const int listen_fd_;
  const int wake_fd_;
  const int port_;
  const std::string name_;  // "TCPStore server 127.0.0.1:29500" for log lines
  const std::string token_;  // Empty: every client is admitted.
  const TCPStoreServerLimits limits_;
  std::thread thread_;

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;

  // Owned by the server thread.
  std::map<uint64_t, Conn> conns_;
  uint64_t next_conn_id_ = 1;
  absl::flat_hash_map<std::string, std::string> data_;
  std::map<uint64_t, Waiter> waiters_;
  uint64_t next_waiter_id_ = 1;
  absl::flat_hash_map<std::string, absl::flat_hash_set<uint64_t>> waiters_by_key_;
  std::set<std::pair<absl::Time, uint64_t>> waiter_deadlines_;
  // Connections still to present the token, oldest first.
  std::set<uint64_t> unauthenticated_;
  // The sum of every connection's `reserved`.
  uint64_t buffered_total_ = 0;
  // accept() failed for lack of resources: the listener is not polled until then.
  absl::Time accept_paused_until_ = absl::InfinitePast();
  absl::Duration accept_backoff_ = kMinAcceptBackoff;
  LogLimiter accept_failures_log_;
  LogLimiter evictions_log_;
  LogLimiter unauthenticated_log_;
};

// ---------------------------------------------------------------------------------------------
// Client: one connection shared by every thread. Callers write their request under a write
// turn, then wait for the reply with their id, which a reader thread files under pending_.
class Client {
 public:
  // Connects (retrying until `timeout`), then presents `token` in a Hello. A server that
  // rejects the token gives kUnauthenticated naming host:port and FS_STORE_TOKEN.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& host, int port,
                                                         absl::Duration timeout,
                                                         absl::string_view token);
  ~Client();

  // Sends the frame that `encode` appends (given the request id) and returns the reply, or
  // kDeadlineExceeded at `deadline`, or kUnavailable once the connection is gone. `what` names
  // the request in errors ("get 'key'").
  absl::StatusOr<Message> Call(absl::FunctionRef<absl::Status(uint32_t, std::string*)> encode,
                               absl::Time deadline, absl::string_view what);

  const std::string& address() const { return address_; }

 private:
  Client(int fd, int wake_fd, std::string address)
      : fd_(fd), wake_fd_(wake_fd), address_(std::move(address)) {}

  absl::Status Hello(absl::string_view token, absl::Time deadline);
  void ReadLoop();
  void Break(absl::Status status) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status WriteFrame(absl::string_view frame, absl::Time deadline);

  const int fd_;
  const int wake_fd_;
  const std::string address_;  // host:port, for messages
  std::thread reader_;

  absl::Mutex mu_;
  uint32_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  // Requests in flight; the reader fills in the reply. Late replies (their caller timed out and
  // erased the slot) are dropped.
  absl::flat_hash_map<uint32_t, std::optional<Message>> pending_ ABSL_GUARDED_BY(mu_);
  // Non-OK once the connection is unusable (server gone, stream broken, closing).
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  // Whether a thread is writing a frame (frames must not interleave). A flag rather than a
  // second mutex so that waiting for the turn can time out.
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace fairscale::comm::tcp_store_internal
