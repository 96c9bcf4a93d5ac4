// TCPStore's client connection (see internal/tcp_store_parts.h).
#include "comm/store/internal/tcp_store_parts.h"

namespace fairscale::comm::tcp_store_internal {

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& host, int port,
                                                        absl::Duration timeout,
                                                        absl::string_view token) {
  const std::string address = HostPort(host, port);
  const absl::Time deadline = DeadlineAfter(timeout);
  absl::Duration backoff = absl::Milliseconds(10);
  std::string last_error;
  int attempts = 0;
  const absl::Time start = absl::Now();
  absl::Time next_report = start + absl::Seconds(5);
  while (true) {
    ++attempts;
    absl::StatusOr<addrinfo*> addrs = Resolve(host, port, /*passive=*/false);
    if (!addrs.ok()) {
      last_error = std::string(addrs.status().message());
    } else {
      bool freed = false;
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
          freed = true;
          SetNoDelay(fd);
          const int wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
          if (wake_fd < 0) {
            const int e = errno;
            close(fd);
            return absl::InternalError(absl::StrCat("TCPStore client eventfd: ", std::strerror(e)));
          }
          std::unique_ptr<Client> client(new Client(fd, wake_fd, address));
          client->reader_ = std::thread([c = client.get()] { c->ReadLoop(); });
          const absl::Status hello = client->Hello(token, deadline);
          if (hello.ok()) return client;
          // A rejected token will not become right: not retried. A connection closed before
          // its hello was answered is: a busy server sheds connections that have not yet
          // presented the token (TCPStoreServerLimits::max_unauthenticated_connections).
          if (!absl::IsUnavailable(hello)) return hello;
          last_error = std::string(hello.message());
          break;
        }
        last_error = std::strerror(err);
        close(fd);
      }
      if (!freed) freeaddrinfo(*addrs);
    }
    // The server may not be up yet (other ranks start in any order): retry until the deadline,
    // saying so after 5 s and every 30 s (a rank started without the one hosting the store
    // would otherwise wait out the whole timeout in silence).
    const absl::Time now = absl::Now();
    if (now >= deadline) break;
    if (now >= next_report) {
      FS_LOG(INFO) << "TCPStore: no server at " << address << " yet (" << last_error
                   << "); it is hosted by the launcher or rank 0: is it running, at this "
                   << "MASTER_ADDR / MASTER_PORT? (waited "
                   << absl::FormatDuration(absl::Trunc(now - start, absl::Seconds(1)))
                   << ", giving up after " << absl::FormatDuration(timeout) << ")";
      next_report = now + absl::Seconds(30);
    }
    absl::SleepFor(std::min(backoff, deadline - now));
    backoff = std::min(backoff * 2, absl::Seconds(1));
  }
  return absl::DeadlineExceededError(absl::StrCat("TCPStore: could not connect to ", address,
                                                  " within ", absl::FormatDuration(timeout),
                                                  " (", attempts, " attempts; last error: ",
                                                  last_error, ")"));
}

absl::Status Client::Hello(absl::string_view token, absl::Time deadline) {
  const std::string rejected = absl::StrCat("TCPStore ", address_,
                                            " rejected this client: wrong or missing job token "
                                            "(FS_STORE_TOKEN)");
  absl::StatusOr<Message> reply = Call(
      [&](uint32_t id, std::string* out) { return wire::EncodeHello(id, token, out); }, deadline,
      "hello");
  FS_RETURN_IF_ERROR(reply.status());
  if (reply->command == WireCommand::kOk) return absl::OkStatus();
  const absl::Status s = wire::ErrorStatus(*reply);
  if (absl::IsUnauthenticated(s)) return absl::UnauthenticatedError(rejected);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("TCPStore ", address_, ": hello: ", s.message()));
  }
  return absl::InternalError(absl::StrCat(
      "TCPStore ", address_, ": hello: unexpected ",
      wire::WireCommandName(static_cast<uint8_t>(reply->command)), " reply"));
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
      // A server that refuses a request (one over its size limits) answers it and hangs up
      // while the rest is still being sent: its answer says more than the broken pipe. The
      // reader files it, then sees the connection end, within moments.
      auto answered = [this, id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return pending_[id].has_value() || !broken_.ok();
      };
      mu_.AwaitWithDeadline(absl::Condition(&answered),
                            std::min(deadline, absl::Now() + absl::Seconds(1)));
      std::optional<Message> reply = std::move(pending_[id]);
      pending_.erase(id);
      // A partly written frame leaves the stream unusable for everyone.
      if (broken_.ok()) {
        broken_ = absl::UnavailableError(absl::StrCat(
            "TCPStore ", address_, ": connection unusable after a failed write: ",
            written.message()));
      }
      if (reply.has_value()) return std::move(*reply);
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


}  // namespace fairscale::comm::tcp_store_internal
