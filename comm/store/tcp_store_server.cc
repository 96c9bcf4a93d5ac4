// TCPStore's server thread and the socket helpers (see internal/tcp_store_parts.h).
#include "comm/store/internal/tcp_store_parts.h"

namespace fairscale::comm::tcp_store_internal {

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


absl::StatusOr<std::unique_ptr<Server>> Server::Start(const std::string& host, int port,
                                                      std::string token,
                                                      const TCPStoreServerLimits& limits) {
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
      fd, wake_fd, real_port, absl::StrCat("TCPStore server ", HostPort(host, real_port)),
      std::move(token), limits));
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
    const absl::Time now = absl::Now();
    fds.push_back({wake_fd_, POLLIN, 0});
    // After accept() ran out of descriptors the pending connection stays queued, so polling the
    // listener at once would report it again and again: it rests until the backoff ends.
    const bool accepting = now >= accept_paused_until_;
    fds.push_back({listen_fd_, static_cast<short>(accepting ? POLLIN : 0), 0});
    absl::Time next_deadline =
        waiter_deadlines_.empty() ? absl::InfiniteFuture() : waiter_deadlines_.begin()->first;
    if (!accepting) next_deadline = std::min(next_deadline, accept_paused_until_);
    for (auto& [id, conn] : conns_) {
      short events = 0;
      if (conn.pending_out() < kBackpressureBytes) {
        events |= POLLIN;
      } else {
        conn.last_read = now;  // Not read by choice: its stall is ours, not the client's.
      }
      if (conn.pending_out() > 0) events |= POLLOUT;
      fds.push_back({conn.fd, events, 0});
      ids.push_back(id);
      next_deadline = std::min(next_deadline, Deadline(conn));
    }
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
    ExpireConns(absl::Now());
    for (auto it = conns_.begin(); it != conns_.end();) {
      if (it->second.closing) {
        buffered_total_ -= it->second.reserved;
        unauthenticated_.erase(it->first);
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
  for (int accepted = 0; accepted < kMaxAcceptsPerRound; ++accepted) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    const absl::Time now = absl::Now();
    if (fd < 0) {
      const int err = errno;
      if (err == EINTR || err == ECONNABORTED) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      // EMFILE, ENFILE, ENOBUFS, ENOMEM: keep serving the existing clients and retry later,
      // backing off while it lasts.
      accept_paused_until_ = now + accept_backoff_;
      int64_t failures = 0;
      if (accept_failures_log_.Allow(now, &failures)) {
        FS_LOG(WARNING) << name_ << ": accept failed: " << std::strerror(err) << " ("
                        << failures << (failures == 1 ? " failure" : " failures")
                        << " since the last report; new connections wait, the "
                        << conns_.size() << " connected clients are served)";
      }
      accept_backoff_ = std::min(accept_backoff_ * 2, kMaxAcceptBackoff);
      return;
    }
    accept_backoff_ = kMinAcceptBackoff;
    SetNoDelay(fd);
    const uint64_t id = next_conn_id_++;
    Conn& conn = conns_.emplace(std::piecewise_construct, std::forward_as_tuple(id),
                                std::forward_as_tuple(id, fd, now))
                     .first->second;
    conn.peer = PeerName(fd);
    if (token_.empty()) {
      conn.authenticated = true;
      continue;
    }
    conn.decoder.RequireHello();
    // Over the cap, the oldest waiting connection makes room: a flood then has to outpace
    // every legitimate client's hello to keep it out, and the client retries if it does.
    while (!unauthenticated_.empty() &&
           unauthenticated_.size() >=
               static_cast<size_t>(limits_.max_unauthenticated_connections)) {
      auto oldest = conns_.find(*unauthenticated_.begin());
      unauthenticated_.erase(unauthenticated_.begin());
      if (oldest == conns_.end() || oldest->second.closing) continue;
      oldest->second.closing = true;  // Close's logging is replaced by the line below.
      int64_t evicted = 0;
      if (evictions_log_.Allow(now, &evicted)) {
        FS_LOG(WARNING) << name_ << ": " << limits_.max_unauthenticated_connections
                        << " connections are waiting to present the job token; closed the "
                           "oldest, from "
                        << oldest->second.peer << " (" << evicted
                        << " closed so since the last report)";
      }
    }
    unauthenticated_.insert(id);
    // A client sends its hello right after connecting: read it now, before the next batch of
    // accepts could evict this connection.
    ReadFrom(id, conn);
  }
}

absl::Time Server::Deadline(const Conn& conn) const {
  absl::Time deadline = absl::InfiniteFuture();
  if (!conn.authenticated) deadline = conn.accepted + limits_.handshake_timeout;
  if (conn.decoder.buffered() > 0) {
    deadline = std::min(deadline, conn.last_read + limits_.read_timeout);
  }
  return deadline;
}

void Server::ExpireConns(absl::Time now) {
  for (auto& [id, conn] : conns_) {
    if (conn.closing || Deadline(conn) > now) continue;
    if (!conn.authenticated) {
      CloseUnauthenticated(
          conn, absl::DeadlineExceededError(absl::StrCat(
                    "no job token presented within ",
                    absl::FormatDuration(now - conn.accepted < limits_.handshake_timeout
                                             ? limits_.read_timeout
                                             : limits_.handshake_timeout),
                    now - conn.accepted < limits_.handshake_timeout ? " of its last byte"
                                                                    : " of connecting")));
    } else {
      Close(conn, absl::DeadlineExceededError(absl::StrCat(
                      "stalled for ", absl::FormatDuration(limits_.read_timeout),
                      " in the middle of a request (", conn.decoder.buffered(), " of ",
                      conn.decoder.partial_frame_bytes() > 0
                          ? absl::StrCat(conn.decoder.partial_frame_bytes())
                          : std::string("?"),
                      " bytes received)")));
    }
  }
}

void Server::ReadFrom(uint64_t id, Conn& conn) {
  char buf[64 << 10];
  size_t budget = kReadBudgetBytes;
  std::vector<Message> messages;
  while (budget > 0 && !conn.closing && conn.pending_out() < kBackpressureBytes) {
    // Before the token, no more than a hello's worth at a time.
    const size_t want =
        std::min({sizeof(buf), budget, conn.authenticated ? sizeof(buf) : wire::kMaxHelloFrameBytes});
    const ssize_t n = recv(conn.fd, buf, want, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      const absl::Status error = absl::UnavailableError(std::strerror(errno));
      if (conn.authenticated) {
        Close(conn, error);
      } else {
        CloseUnauthenticated(conn, error);
      }
      return;
    }
    if (n == 0) {
      Close(conn, absl::OkStatus());  // An orderly goodbye.
      return;
    }
    conn.last_read = absl::Now();
    budget -= static_cast<size_t>(n);
    messages.clear();
    absl::Status s = conn.decoder.Feed(absl::string_view(buf, n), &messages);
    while (true) {
      const bool gated = conn.decoder.gated();
      // Answer what decoded cleanly before the bad frame, then hang up.
      for (Message& m : messages) {
        if (conn.closing) break;
        Handle(id, conn, m);
      }
      if (conn.closing) return;
      if (!s.ok()) {
        if (conn.authenticated) {
          Close(conn, s);
          return;
        }
        // Most likely a client without the token (or of another job): tell it why.
        const absl::Status rejected = absl::UnauthenticatedError(
            absl::StrCat("wrong or missing job token (FS_STORE_TOKEN): ", s.message()));
        Reply(conn, [&](std::string* out) {
          wire::EncodeError(conn.decoder.current_request_id(), rejected, out);
        });
        CloseUnauthenticated(conn, rejected);
        return;
      }
      // The hello just admitted this connection: decode what came behind it.
      if (!gated || conn.decoder.gated() || conn.decoder.buffered() == 0) break;
      messages.clear();
      s = conn.decoder.Feed(absl::string_view(), &messages);
    }
    if (!Reserve(conn)) return;
  }
}

bool Server::Reserve(Conn& conn) {
  const uint64_t want = conn.decoder.partial_frame_bytes();
  if (want == conn.reserved) return true;
  buffered_total_ -= conn.reserved;
  conn.reserved = 0;
  absl::Status refused;
  if (want > limits_.max_request_bytes) {
    refused = absl::ResourceExhaustedError(absl::StrCat(
        "a request of ", want, " bytes exceeds the server's limit of ",
        limits_.max_request_bytes, " (TCPStoreServerLimits::max_request_bytes)"));
  } else if (want > limits_.max_buffered_bytes - std::min(buffered_total_,
                                                           limits_.max_buffered_bytes)) {
    refused = absl::ResourceExhaustedError(absl::StrCat(
        "a request of ", want, " bytes does not fit: requests being received already hold ",
        buffered_total_, " of the server's ", limits_.max_buffered_bytes,
        " bytes (TCPStoreServerLimits::max_buffered_bytes); retry later"));
  }
  if (!refused.ok()) {
    const uint32_t request_id = conn.decoder.current_request_id();
    Reply(conn, [&](std::string* out) { wire::EncodeError(request_id, refused, out); });
    Close(conn, refused);
    return false;
  }
  conn.reserved = want;
  buffered_total_ += want;
  return true;
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
    // Do not keep the capacity of a large reply for the life of the connection.
    if (conn.out.capacity() > (1 << 20)) {
      std::string().swap(conn.out);
    } else {
      conn.out.clear();
    }
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

void Server::CloseUnauthenticated(Conn& conn, const absl::Status& why) {
  if (conn.closing) return;
  int64_t count = 0;
  if (unauthenticated_log_.Allow(absl::Now(), &count)) {
    FS_LOG(WARNING) << name_ << ": closing the connection from " << conn.peer
                    << " before it presented the job token: " << why << " (" << count
                    << " such since the last report)";
  }
  conn.closing = true;
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

namespace {

// Compares without an early exit, so the time taken does not reveal how much of a guess matched.
bool TokensEqual(absl::string_view a, absl::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

}  // namespace

bool Server::Authenticate(Conn& conn, const Message& m) {
  const bool hello = m.command == WireCommand::kHello;
  if (conn.authenticated && !hello) return true;
  if (token_.empty() || (hello && TokensEqual(m.value, token_))) {
    conn.authenticated = true;
    conn.decoder.Admit();
    unauthenticated_.erase(conn.id);
    return true;
  }
  const absl::Status rejected = absl::UnauthenticatedError(
      hello ? "wrong or missing job token (FS_STORE_TOKEN)"
            : absl::StrCat("wrong or missing job token (FS_STORE_TOKEN): the first request was ",
                           wire::WireCommandName(static_cast<uint8_t>(m.command)),
                           ", not hello"));
  // The client learns why before the connection closes; nothing else it sent is answered.
  Reply(conn, [&](std::string* out) { wire::EncodeError(m.request_id, rejected, out); });
  if (conn.authenticated) {
    Close(conn, rejected);
  } else {
    CloseUnauthenticated(conn, rejected);
  }
  return false;
}

void Server::Handle(uint64_t conn_id, Conn& conn, Message& m) {
  const uint32_t id = m.request_id;
  if (!Authenticate(conn, m)) return;
  switch (m.command) {
    case WireCommand::kHello:
      Reply(conn, [&](std::string* out) { wire::EncodeOk(id, out); });
      return;
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

}  // namespace fairscale::comm::tcp_store_internal
