#include "comm/store/tcp_store.h"

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
#include "comm/store/wire.h"

namespace fairscale::comm {
namespace tcp_store_internal {
namespace {

using wire::Message;
using wire::WireCommand;

std::string Quote(absl::string_view key) { return absl::StrCat("'", absl::CHexEscape(key), "'"); }

std::string QuoteAll(absl::Span<const std::string> keys) {
  std::vector<std::string> quoted;
  quoted.reserve(keys.size());
  for (const std::string& k : keys) quoted.push_back(Quote(k));
  return absl::StrCat("[", absl::StrJoin(quoted, ", "), "]");
}

std::string HostPort(absl::string_view host, int port) {
  // IPv6 literals need brackets to be unambiguous.
  if (host.find(':') != absl::string_view::npos) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

// poll() timeout in ms until `deadline`: rounded up (never spin), clamped to int.
int PollMs(absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) return -1;
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  const int64_t ms = absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1)));
  return static_cast<int>(std::min<int64_t>(ms, INT_MAX));
}

absl::Time DeadlineAfter(absl::Duration d) {
  if (d == absl::InfiniteDuration()) return absl::InfiniteFuture();
  return absl::Now() + std::max(d, absl::ZeroDuration());
}

std::string PeerName(int fd) {
  sockaddr_storage addr;
  socklen_t len = sizeof(addr);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "unknown peer";
  char host[NI_MAXHOST];
  char serv[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, host, sizeof(host), serv,
                  sizeof(serv), NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return "unknown peer";
  }
  int port = 0;
  (void)absl::SimpleAtoi(serv, &port);
  return HostPort(host, port);
}

void SetNoDelay(int fd) {
  int one = 1;
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// getaddrinfo() for a TCP endpoint. Errors name host:port.
absl::StatusOr<addrinfo*> Resolve(const std::string& host, int port, bool passive) {
  addrinfo hints;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* result = nullptr;
  const std::string service = absl::StrCat(port);
  const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints,
                             &result);
  if (rc != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", HostPort(host, port), ": ",
                                               gai_strerror(rc)));
  }
  return result;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Server: one thread, poll() over the listening socket, a wake-up eventfd and every connection.
// It owns the map outright, so nothing in it needs a lock.
class Server {
 public:
  static absl::StatusOr<std::unique_ptr<Server>> Start(const std::string& host, int port);
  ~Server();

  int port() const { return port_; }

 private:
  struct Conn {
    explicit Conn(int fd) : fd(fd), decoder(wire::Decoder::Direction::kRequests) {}
    int fd;
    std::string peer;
    wire::Decoder decoder;
    std::string out;  // Replies not yet written, from out_offset on.
    size_t out_offset = 0;
    bool closing = false;
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

  Server(int listen_fd, int wake_fd, int port, std::string name)
      : listen_fd_(listen_fd), wake_fd_(wake_fd), port_(port), name_(std::move(name)) {}

  void Run();
  void Accept();
  void ReadFrom(uint64_t id, Conn& conn);
  void Flush(Conn& conn);
  void Close(Conn& conn, const absl::Status& why);
  void Handle(uint64_t conn_id, Conn& conn, Message& m);
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
};

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const std::string& host, int port) {
  FS_ASSIGN_OR_RETURN(addrinfo * addrs, Resolve(host, port, /*passive=*/true));
  int fd = -1;
  std::string last_error = "no address";
  for (addrinfo* a = addrs; a != nullptr; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    int one = 1;
    // A restarted job may reuse MASTER_PORT while old connections linger in TIME_WAIT.
    (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, SOMAXCONN) == 0) break;
    last_error = std::strerror(errno);
    close(fd);
    fd = -1;
  }
  freeaddrinfo(addrs);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("TCPStore server cannot listen on ",
                                               HostPort(host, port), ": ", last_error));
  }
  sockaddr_storage bound;
  socklen_t len = sizeof(bound);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
    const int err = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("TCPStore server getsockname: ", std::strerror(err)));
  }
  const int real_port =
      bound.ss_family == AF_INET6
          ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
          : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  const int wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd < 0) {
    const int err = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("TCPStore server eventfd: ", std::strerror(err)));
  }
  std::unique_ptr<Server> server(new Server(
      fd, wake_fd, real_port, absl::StrCat("TCPStore server ", HostPort(host, real_port))));
  server->thread_ = std::thread([s = server.get()] { s->Run(); });
  return server;
}

Server::~Server() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  thread_.join();
  for (auto& [id, conn] : conns_) close(conn.fd);
  close(listen_fd_);
  close(wake_fd_);
}

void Server::Run() {
  std::vector<pollfd> fds;
  std::vector<uint64_t> ids;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
    }
    fds.clear();
    ids.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    for (auto& [id, conn] : conns_) {
      short events = 0;
      if (conn.pending_out() < kBackpressureBytes) events |= POLLIN;
      if (conn.pending_out() > 0) events |= POLLOUT;
      fds.push_back({conn.fd, events, 0});
      ids.push_back(id);
    }
    const absl::Time next_deadline =
        waiter_deadlines_.empty() ? absl::InfiniteFuture() : waiter_deadlines_.begin()->first;
    const int rc = poll(fds.data(), fds.size(), PollMs(next_deadline));
    if (rc < 0 && errno != EINTR) {
      FS_LOG(ERROR) << name_ << ": poll failed: " << std::strerror(errno);
      absl::SleepFor(absl::Milliseconds(10));  // Do not spin on a persistent error.
      continue;
    }
    if (rc > 0) {
      if (fds[0].revents & POLLIN) {
        uint64_t drained;
        (void)!read(wake_fd_, &drained, sizeof(drained));
      }
      if (fds[1].revents & POLLIN) Accept();
      for (size_t i = 0; i < ids.size(); ++i) {
        const short revents = fds[i + 2].revents;
        if (revents == 0) continue;
        auto it = conns_.find(ids[i]);
        if (it == conns_.end()) continue;
        Conn& conn = it->second;
        if (!conn.closing && (revents & POLLOUT)) Flush(conn);
        if (!conn.closing && (revents & (POLLIN | POLLHUP | POLLERR))) ReadFrom(ids[i], conn);
      }
    }
    ExpireWaiters();
    for (auto it = conns_.begin(); it != conns_.end();) {
      if (it->second.closing) {
        // Parked requests of a closed connection will never be answered.
        std::vector<uint64_t> waiters(it->second.waiters.begin(), it->second.waiters.end());
        for (uint64_t w : waiters) RemoveWaiter(w);
        close(it->second.fd);
        it = conns_.erase(it);
      } else {
        ++it;
      }
    }
  }
}

void Server::Accept() {
  while (true) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        // EMFILE and friends: keep serving the existing clients; the next poll retries.
        FS_LOG(WARNING) << name_ << ": accept failed: " << std::strerror(errno);
      }
      return;
    }
    SetNoDelay(fd);
    const uint64_t id = next_conn_id_++;
    Conn& conn = conns_.emplace(id, fd).first->second;
    conn.peer = PeerName(fd);
  }
}

void Server::ReadFrom(uint64_t id, Conn& conn) {
  char buf[64 << 10];
  size_t budget = kReadBudgetBytes;
  std::vector<Message> messages;
  while (budget > 0 && !conn.closing && conn.pending_out() < kBackpressureBytes) {
    const ssize_t n = recv(conn.fd, buf, std::min(sizeof(buf), budget), 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      Close(conn, absl::UnavailableError(std::strerror(errno)));
      return;
    }
    if (n == 0) {
      Close(conn, absl::OkStatus());  // An orderly goodbye.
      return;
    }
    budget -= static_cast<size_t>(n);
    messages.clear();
    const absl::Status s = conn.decoder.Feed(absl::string_view(buf, n), &messages);
    // Answer what decoded cleanly before the bad frame, then hang up.
    for (Message& m : messages) {
      if (conn.closing) break;
      Handle(id, conn, m);
    }
    if (!s.ok()) {
      Close(conn, s);
      return;
    }
  }
}

void Server::Flush(Conn& conn) {
  while (conn.pending_out() > 0) {
    const ssize_t n = send(conn.fd, conn.out.data() + conn.out_offset, conn.pending_out(),
                           MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      // The peer is gone; the read side will see it too. Drop the connection now.
      conn.closing = true;
      FS_VLOG(1) << name_ << ": write to " << conn.peer << " failed: " << std::strerror(errno);
      return;
    }
    conn.out_offset += static_cast<size_t>(n);
  }
  if (conn.out_offset == conn.out.size()) {
    conn.out.clear();
    conn.out_offset = 0;
  } else if (conn.out_offset > conn.out.size() / 2) {
    conn.out.erase(0, conn.out_offset);
    conn.out_offset = 0;
  }
}

void Server::Close(Conn& conn, const absl::Status& why) {
  if (conn.closing) return;
  if (!why.ok()) {
    FS_LOG(WARNING) << name_ << ": closing the connection from " << conn.peer << ": " << why;
  }
  conn.closing = true;  // Run() closes it (and drops its parked requests) after this round.
}

void Server::Reply(Conn& conn, absl::FunctionRef<void(std::string*)> encode) {
  if (conn.closing) return;
  encode(&conn.out);
  if (conn.pending_out() > kMaxPendingOutBytes) {
    FS_LOG(WARNING) << name_ << ": closing the connection from " << conn.peer << ": "
                    << conn.pending_out() << " bytes of replies unread (limit "
                    << kMaxPendingOutBytes << ")";
    conn.closing = true;
    return;
  }
  Flush(conn);
}

bool Server::AllPresent(const std::vector<std::string>& keys) const {
  for (const std::string& k : keys) {
    if (!data_.contains(k)) return false;
  }
  return true;
}

void Server::Handle(uint64_t conn_id, Conn& conn, Message& m) {
  const uint32_t id = m.request_id;
  switch (m.command) {
    case WireCommand::kSet:
      data_[m.key] = std::move(m.value);
      Reply(conn, [&](std::string* out) { wire::EncodeOk(id, out); });
      KeyChanged(m.key);
      return;
    case WireCommand::kGet: {
      auto it = data_.find(m.key);
      if (it != data_.end()) {
        Reply(conn, [&](std::string* out) { wire::EncodeValue(id, it->second, out); });
        return;
      }
      Park(conn_id, conn, m);
      return;
    }
    case WireCommand::kAdd: {
      auto it = data_.find(m.key);
      absl::StatusOr<std::string> next = store_internal::AddToValue(
          m.key, it == data_.end() ? absl::string_view() : absl::string_view(it->second),
          m.number);
      if (!next.ok()) {
        Reply(conn, [&](std::string* out) { wire::EncodeError(id, next.status(), out); });
        return;
      }
      int64_t value = 0;
      (void)absl::SimpleAtoi(*next, &value);
      data_[m.key] = std::move(*next);
      Reply(conn, [&](std::string* out) { wire::EncodeInt(id, value, out); });
      KeyChanged(m.key);
      return;
    }
    case WireCommand::kCompareSet: {
      auto it = data_.find(m.key);
      const absl::string_view current =
          it == data_.end() ? absl::string_view() : absl::string_view(it->second);
      if (current != m.expected) {
        Reply(conn, [&](std::string* out) { wire::EncodeValue(id, current, out); });
        return;
      }
      data_[m.key] = m.value;
      Reply(conn, [&](std::string* out) { wire::EncodeValue(id, m.value, out); });
      KeyChanged(m.key);
      return;
    }
    case WireCommand::kDelete: {
      const bool existed = data_.erase(m.key) > 0;
      Reply(conn, [&](std::string* out) { wire::EncodeBool(id, existed, out); });
      return;
    }
    case WireCommand::kCheck: {
      const bool present = data_.contains(m.key);
      Reply(conn, [&](std::string* out) { wire::EncodeBool(id, present, out); });
      return;
    }
    case WireCommand::kWait:
      if (AllPresent(m.keys)) {
        Reply(conn, [&](std::string* out) { wire::EncodeOk(id, out); });
        return;
      }
      Park(conn_id, conn, m);
      return;
    default:
      // The request decoder admits requests only.
      Reply(conn, [&](std::string* out) {
        wire::EncodeError(id, absl::InternalError("not a request"), out);
      });
      return;
  }
}

void Server::Park(uint64_t conn_id, Conn& conn, Message& m) {
  std::vector<std::string> keys =
      m.command == WireCommand::kGet ? std::vector<std::string>{m.key} : std::move(m.keys);
  const uint32_t id = m.request_id;
  if (m.number == 0) {
    Reply(conn, [&](std::string* out) {
      wire::EncodeError(id, absl::DeadlineExceededError(
                                absl::StrCat("keys ", QuoteAll(keys), " not set")), out);
    });
    return;
  }
  if (conn.waiters.size() >= kMaxWaitersPerConn) {
    Reply(conn, [&](std::string* out) {
      wire::EncodeError(id, absl::ResourceExhaustedError(absl::StrCat(
                                "more than ", kMaxWaitersPerConn,
                                " Get/Wait requests parked on one connection")), out);
    });
    return;
  }
  const uint64_t waiter_id = next_waiter_id_++;
  const absl::Time deadline = DeadlineAfter(absl::Milliseconds(m.number));
  for (const std::string& k : keys) waiters_by_key_[k].insert(waiter_id);
  waiter_deadlines_.insert({deadline, waiter_id});
  conn.waiters.insert(waiter_id);
  waiters_.emplace(waiter_id, Waiter{conn_id, id, m.command, std::move(keys), deadline});
}

void Server::AnswerWaiter(const Waiter& w) {
  auto it = conns_.find(w.conn_id);
  if (it == conns_.end()) return;
  if (w.command == WireCommand::kGet) {
    const std::string& value = data_.at(w.keys[0]);
    Reply(it->second, [&](std::string* out) { wire::EncodeValue(w.request_id, value, out); });
  } else {
    Reply(it->second, [&](std::string* out) { wire::EncodeOk(w.request_id, out); });
  }
}

void Server::RemoveWaiter(uint64_t waiter_id) {
  auto it = waiters_.find(waiter_id);
  if (it == waiters_.end()) return;
  const Waiter& w = it->second;
  for (const std::string& k : w.keys) {
    auto by_key = waiters_by_key_.find(k);
    if (by_key == waiters_by_key_.end()) continue;
    by_key->second.erase(waiter_id);
    if (by_key->second.empty()) waiters_by_key_.erase(by_key);
  }
  waiter_deadlines_.erase({w.deadline, waiter_id});
  auto conn = conns_.find(w.conn_id);
  if (conn != conns_.end()) conn->second.waiters.erase(waiter_id);
  waiters_.erase(it);
}

void Server::KeyChanged(const std::string& key) {
  auto by_key = waiters_by_key_.find(key);
  if (by_key == waiters_by_key_.end()) return;
  std::vector<uint64_t> ids(by_key->second.begin(), by_key->second.end());
  std::sort(ids.begin(), ids.end());  // Answer in arrival order.
  for (uint64_t waiter_id : ids) {
    auto it = waiters_.find(waiter_id);
    if (it == waiters_.end() || !AllPresent(it->second.keys)) continue;
    AnswerWaiter(it->second);
    RemoveWaiter(waiter_id);
  }
}

void Server::ExpireWaiters() {
  const absl::Time now = absl::Now();
  while (!waiter_deadlines_.empty() && waiter_deadlines_.begin()->first <= now) {
    const uint64_t waiter_id = waiter_deadlines_.begin()->second;
    waiter_deadlines_.erase(waiter_deadlines_.begin());
    auto it = waiters_.find(waiter_id);
    if (it != waiters_.end()) {
      const Waiter& w = it->second;
      auto conn = conns_.find(w.conn_id);
      if (conn != conns_.end()) {
        std::vector<std::string> missing;
        for (const std::string& k : w.keys) {
          if (!data_.contains(k)) missing.push_back(k);
        }
        const absl::Status timeout =
            absl::DeadlineExceededError(absl::StrCat("keys ", QuoteAll(missing), " not set"));
        Reply(conn->second,
              [&](std::string* out) { wire::EncodeError(w.request_id, timeout, out); });
      }
    }
    RemoveWaiter(waiter_id);
  }
}

// ---------------------------------------------------------------------------------------------
// Client: one connection shared by every thread. Callers write their request under a write
// turn, then wait for the reply with their id, which a reader thread files under pending_.
class Client {
 public:
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& host, int port,
                                                         absl::Duration timeout);
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

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& host, int port,
                                                        absl::Duration timeout) {
  const std::string address = HostPort(host, port);
  const absl::Time deadline = DeadlineAfter(timeout);
  absl::Duration backoff = absl::Milliseconds(10);
  std::string last_error;
  int attempts = 0;
  while (true) {
    ++attempts;
    absl::StatusOr<addrinfo*> addrs = Resolve(host, port, /*passive=*/false);
    if (!addrs.ok()) {
      last_error = std::string(addrs.status().message());
    } else {
      for (addrinfo* a = *addrs; a != nullptr; a = a->ai_next) {
        const int fd =
            socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
          last_error = std::strerror(errno);
          continue;
        }
        int err = 0;
        if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
          err = errno;
          if (err == EINPROGRESS) {
            pollfd p{fd, POLLOUT, 0};
            const int rc = poll(&p, 1, PollMs(deadline));
            socklen_t len = sizeof(err);
            if (rc == 1) {
              if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
            } else {
              err = rc == 0 ? ETIMEDOUT : errno;
            }
          }
        }
        if (err == 0) {
          freeaddrinfo(*addrs);
          SetNoDelay(fd);
          const int wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
          if (wake_fd < 0) {
            const int e = errno;
            close(fd);
            return absl::InternalError(absl::StrCat("TCPStore client eventfd: ", std::strerror(e)));
          }
          std::unique_ptr<Client> client(new Client(fd, wake_fd, address));
          client->reader_ = std::thread([c = client.get()] { c->ReadLoop(); });
          return client;
        }
        last_error = std::strerror(err);
        close(fd);
      }
      freeaddrinfo(*addrs);
    }
    // The server may not be up yet (other ranks start in any order): retry until the deadline.
    const absl::Time now = absl::Now();
    if (now >= deadline) break;
    absl::SleepFor(std::min(backoff, deadline - now));
    backoff = std::min(backoff * 2, absl::Seconds(1));
  }
  return absl::DeadlineExceededError(absl::StrCat("TCPStore: could not connect to ", address,
                                                  " within ", absl::FormatDuration(timeout),
                                                  " (", attempts, " attempts; last error: ",
                                                  last_error, ")"));
}

Client::~Client() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  reader_.join();
  close(fd_);
  close(wake_fd_);
}

void Client::Break(absl::Status status) {
  absl::MutexLock lock(&mu_);
  if (broken_.ok()) broken_ = std::move(status);
}

void Client::ReadLoop() {
  wire::Decoder decoder(wire::Decoder::Direction::kReplies);
  std::vector<Message> messages;
  char buf[64 << 10];
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) {
        if (broken_.ok()) broken_ = absl::CancelledError("TCPStore client is closing");
        return;
      }
    }
    pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    // The wake-up eventfd ends the wait at shutdown; the timeout is only a safety net.
    const int rc = poll(fds, 2, 1000);
    if (rc < 0) {
      if (errno == EINTR) continue;
      Break(absl::UnavailableError(
          absl::StrCat("TCPStore ", address_, ": poll failed: ", std::strerror(errno))));
      return;
    }
    if (rc == 0 || fds[0].revents == 0) continue;
    const ssize_t n = recv(fd_, buf, sizeof(buf), MSG_DONTWAIT);
    if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (n <= 0) {
      Break(absl::UnavailableError(absl::StrCat(
          "TCPStore ", address_, ": the server closed the connection",
          n < 0 ? absl::StrCat(" (", std::strerror(errno), ")") : std::string())));
      return;
    }
    messages.clear();
    const absl::Status s = decoder.Feed(absl::string_view(buf, n), &messages);
    {
      absl::MutexLock lock(&mu_);
      for (Message& m : messages) {
        auto it = pending_.find(m.request_id);
        if (it != pending_.end() && !it->second.has_value()) it->second = std::move(m);
      }
    }
    if (!s.ok()) {
      Break(absl::UnavailableError(
          absl::StrCat("TCPStore ", address_, ": bad reply from the server: ", s.message())));
      return;
    }
  }
}

absl::Status Client::WriteFrame(absl::string_view frame, absl::Time deadline) {
  size_t written = 0;
  while (written < frame.size()) {
    const ssize_t n = send(fd_, frame.data() + written, frame.size() - written,
                           MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) {
      written += static_cast<size_t>(n);
      continue;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      return absl::UnavailableError(absl::StrCat("TCPStore ", address_,
                                                 ": the server closed the connection (",
                                                 std::strerror(errno), ")"));
    }
    pollfd p{fd_, POLLOUT, 0};
    const int rc = poll(&p, 1, PollMs(deadline));
    if (rc < 0 && errno != EINTR) {
      return absl::UnavailableError(
          absl::StrCat("TCPStore ", address_, ": poll failed: ", std::strerror(errno)));
    }
    if (rc == 0 && absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("TCPStore ", address_, ": sent only ",
                                                      written, " of ", frame.size(),
                                                      " request bytes before the deadline"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Message> Client::Call(
    absl::FunctionRef<absl::Status(uint32_t, std::string*)> encode, absl::Time deadline,
    absl::string_view what) {
  uint32_t id;
  {
    absl::MutexLock lock(&mu_);
    if (!broken_.ok()) return broken_;
    id = next_id_++;
  }
  // Encoding copies the value (up to 64 MiB): not under mu_, which the reader needs.
  std::string frame;
  FS_RETURN_IF_ERROR(encode(id, &frame));
  {
    absl::MutexLock lock(&mu_);
    pending_[id] = std::nullopt;
    auto my_turn = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !writing_ || !broken_.ok();
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&my_turn), deadline)) {
      pending_.erase(id);
      return absl::DeadlineExceededError(absl::StrCat("TCPStore ", address_, ": ", what,
                                                      " could not be sent before the deadline"));
    }
    if (!broken_.ok()) {
      pending_.erase(id);
      return broken_;
    }
    writing_ = true;
  }
  const absl::Status written = WriteFrame(frame, deadline);
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!written.ok()) {
      pending_.erase(id);
      // A partly written frame leaves the stream unusable for everyone.
      if (broken_.ok()) {
        broken_ = absl::UnavailableError(absl::StrCat(
            "TCPStore ", address_, ": connection unusable after a failed write: ",
            written.message()));
      }
      return written;
    }
    auto arrived = [this, id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return pending_[id].has_value() || !broken_.ok();
    };
    mu_.AwaitWithDeadline(absl::Condition(&arrived), deadline);
    std::optional<Message> reply = std::move(pending_[id]);
    pending_.erase(id);
    if (reply.has_value()) return std::move(*reply);
    if (!broken_.ok()) return broken_;
  }
  return absl::DeadlineExceededError(absl::StrCat("TCPStore ", address_, ": ", what,
                                                  " got no reply within the deadline"));
}

}  // namespace tcp_store_internal

// ---------------------------------------------------------------------------------------------

using tcp_store_internal::Client;
using tcp_store_internal::DeadlineAfter;
using tcp_store_internal::Quote;
using tcp_store_internal::QuoteAll;
using tcp_store_internal::Server;
using wire::Message;
using wire::WireCommand;

namespace {

// Get/Wait allow at least one round trip, so that a zero or tiny timeout still returns a key
// that exists. The server enforces the timeout itself; this only bounds a hung server.
constexpr absl::Duration kMinRoundTrip = absl::Milliseconds(50);

absl::Time WaitDeadline(absl::Duration timeout) {
  return std::max(DeadlineAfter(timeout), absl::Now() + kMinRoundTrip);
}

// The reply as a Status: its error, or kInternal when it is not what `expected` says.
absl::Status CheckReply(const Message& reply, WireCommand expected, const std::string& address,
                        absl::string_view what) {
  if (reply.command == WireCommand::kError) {
    const absl::Status s = wire::ErrorStatus(reply);
    return absl::Status(s.code(), absl::StrCat("TCPStore ", address, ": ", what, ": ",
                                               s.message()));
  }
  if (reply.command != expected) {
    return absl::InternalError(absl::StrCat(
        "TCPStore ", address, ": ", what, ": unexpected ",
        wire::WireCommandName(static_cast<uint8_t>(reply.command)), " reply"));
  }
  return absl::OkStatus();
}

}  // namespace

TCPStore::TCPStore(TCPStoreOptions options) : options_(std::move(options)) {}

TCPStore::~TCPStore() = default;

absl::StatusOr<std::unique_ptr<TCPStore>> TCPStore::Create(TCPStoreOptions options) {
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("TCPStore: port ", options.port, " is outside [0, 65535]"));
  }
  if (!options.is_server && options.port == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("TCPStore client for ", options.host, " needs the server's port, got 0"));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("TCPStore: timeout must be positive, got ",
                                                   absl::FormatDuration(options.timeout)));
  }
  if (options.wait_for_workers && (!options.is_server || options.num_workers <= 0)) {
    return absl::InvalidArgumentError(
        "TCPStore: wait_for_workers needs is_server and num_workers > 0");
  }
  std::unique_ptr<TCPStore> store(new TCPStore(options));
  std::string connect_host = options.host;
  if (options.is_server) {
    FS_ASSIGN_OR_RETURN(store->server_, Server::Start(options.host, options.port));
    store->options_.port = store->server_->port();
    // A wildcard bind address is not a destination; its own client goes over loopback.
    if (connect_host.empty() || connect_host == "0.0.0.0") connect_host = "127.0.0.1";
    if (connect_host == "::") connect_host = "::1";
    FS_LOG(INFO) << "TCPStore server listening on "
                 << tcp_store_internal::HostPort(options.host, store->port());
  }
  FS_ASSIGN_OR_RETURN(store->client_,
                      Client::Connect(connect_host, store->options_.port, options.timeout));
  if (options.num_workers > 0) {
    FS_ASSIGN_OR_RETURN(int64_t joined, store->Add(kWorkersKey, 1));
    if (joined == options.num_workers) FS_RETURN_IF_ERROR(store->Set(kWorkersReadyKey, "1"));
    if (options.wait_for_workers) {
      const std::vector<std::string> ready = {std::string(kWorkersReadyKey)};
      absl::Status s = store->Wait(ready, options.timeout);
      if (absl::IsDeadlineExceeded(s)) {
        absl::StatusOr<int64_t> now = store->Add(kWorkersKey, 0);
        return absl::DeadlineExceededError(absl::StrCat(
            "TCPStore server ", store->client_->address(), ": only ", now.ok() ? *now : joined,
            " of ", options.num_workers, " workers joined within ",
            absl::FormatDuration(options.timeout)));
      }
      FS_RETURN_IF_ERROR(s);
    }
  }
  return store;
}

absl::Status TCPStore::Set(absl::string_view key, absl::string_view value) {
  FS_RETURN_IF_ERROR(store_internal::CheckKey(key));
  FS_RETURN_IF_ERROR(store_internal::CheckValue(value));
  const std::string what = absl::StrCat("set ", Quote(key));
  FS_ASSIGN_OR_RETURN(
      Message reply,
      client_->Call(
          [&](uint32_t id, std::string* out) { return wire::EncodeSet(id, key, value, out); },
          DeadlineAfter(options_.timeout), what));
  return CheckReply(reply, WireCommand::kOk, client_->address(), what);
}

absl::StatusOr<std::string> TCPStore::Get(absl::string_view key, absl::Duration timeout) {
  FS_RETURN_IF_ERROR(store_internal::CheckKey(key));
  const std::string what = absl::StrCat("get ", Quote(key));
  absl::StatusOr<Message> reply = client_->Call(
      [&](uint32_t id, std::string* out) { return wire::EncodeGet(id, key, timeout, out); },
      WaitDeadline(timeout), what);
  if (absl::IsDeadlineExceeded(reply.status()) ||
      (reply.ok() && reply->command == WireCommand::kError &&
       reply->number == static_cast<int>(absl::StatusCode::kDeadlineExceeded))) {
    return absl::DeadlineExceededError(absl::StrCat("TCPStore ", client_->address(), ": key ",
                                                    Quote(key), " not set within ",
                                                    absl::FormatDuration(timeout)));
  }
  FS_RETURN_IF_ERROR(reply.status());
  FS_RETURN_IF_ERROR(CheckReply(*reply, WireCommand::kValue, client_->address(), what));
  return std::move(reply->value);
}

absl::StatusOr<int64_t> TCPStore::Add(absl::string_view key, int64_t delta) {
  FS_RETURN_IF_ERROR(store_internal::CheckKey(key));
  const std::string what = absl::StrCat("add ", Quote(key));
  FS_ASSIGN_OR_RETURN(
      Message reply,
      client_->Call(
          [&](uint32_t id, std::string* out) { return wire::EncodeAdd(id, key, delta, out); },
          DeadlineAfter(options_.timeout), what));
  FS_RETURN_IF_ERROR(CheckReply(reply, WireCommand::kInt, client_->address(), what));
  return reply.number;
}

absl::StatusOr<std::string> TCPStore::CompareSet(absl::string_view key, absl::string_view expected,
                                                 absl::string_view desired) {
  FS_RETURN_IF_ERROR(store_internal::CheckKey(key));
  FS_RETURN_IF_ERROR(store_internal::CheckValue(desired));
  const std::string what = absl::StrCat("compare_set ", Quote(key));
  FS_ASSIGN_OR_RETURN(Message reply,
                      client_->Call(
                          [&](uint32_t id, std::string* out) {
                            return wire::EncodeCompareSet(id, key, expected, desired, out);
                          },
                          DeadlineAfter(options_.timeout), what));
  FS_RETURN_IF_ERROR(CheckReply(reply, WireCommand::kValue, client_->address(), what));
  return std::move(reply.value);
}

absl::StatusOr<bool> TCPStore::Delete(absl::string_view key) {
  FS_RETURN_IF_ERROR(store_internal::CheckKey(key));
  const std::string what = absl::StrCat("delete ", Quote(key));
  FS_ASSIGN_OR_RETURN(
      Message reply,
      client_->Call([&](uint32_t id, std::string* out) { return wire::EncodeDelete(id, key, out); },
                    DeadlineAfter(options_.timeout), what));
  FS_RETURN_IF_ERROR(CheckReply(reply, WireCommand::kBool, client_->address(), what));
  return reply.number == 1;
}

absl::Status TCPStore::Wait(absl::Span<const std::string> keys, absl::Duration timeout) {
  for (const std::string& k : keys) FS_RETURN_IF_ERROR(store_internal::CheckKey(k));
  if (keys.empty()) return absl::OkStatus();
  const std::vector<std::string> list(keys.begin(), keys.end());
  const std::string what = absl::StrCat("wait ", QuoteAll(keys));
  absl::StatusOr<Message> reply = client_->Call(
      [&](uint32_t id, std::string* out) { return wire::EncodeWait(id, list, timeout, out); },
      WaitDeadline(timeout), what);
  if (reply.ok() && reply->command == WireCommand::kError &&
      reply->number == static_cast<int>(absl::StatusCode::kDeadlineExceeded)) {
    // The server names the keys still missing.
    return absl::DeadlineExceededError(absl::StrCat("TCPStore ", client_->address(), ": ",
                                                    reply->value, " within ",
                                                    absl::FormatDuration(timeout)));
  }
  if (absl::IsDeadlineExceeded(reply.status())) {
    return absl::DeadlineExceededError(absl::StrCat("TCPStore ", client_->address(), ": keys ",
                                                    QuoteAll(keys), " not all set within ",
                                                    absl::FormatDuration(timeout)));
  }
  FS_RETURN_IF_ERROR(reply.status());
  return CheckReply(*reply, WireCommand::kOk, client_->address(), what);
}

absl::StatusOr<bool> TCPStore::Check(absl::string_view key) {
  FS_RETURN_IF_ERROR(store_internal::CheckKey(key));
  const std::string what = absl::StrCat("check ", Quote(key));
  FS_ASSIGN_OR_RETURN(
      Message reply,
      client_->Call([&](uint32_t id, std::string* out) { return wire::EncodeCheck(id, key, out); },
                    DeadlineAfter(options_.timeout), what));
  FS_RETURN_IF_ERROR(CheckReply(reply, WireCommand::kBool, client_->address(), what));
  return reply.number == 1;
}

}  // namespace fairscale::comm
