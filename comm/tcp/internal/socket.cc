#include "comm/tcp/internal/socket.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace fairscale::comm::tcp_internal {

void UniqueFd::Reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

std::string ErrnoString(int err) {
  char buf[128];
  // GNU strerror_r may return a static string instead of filling `buf`.
  const char* text = strerror_r(err, buf, sizeof(buf));
  return absl::StrCat(text, " (errno ", err, ")");
}

int PollTimeoutMs(absl::Duration timeout) {
  if (timeout == absl::InfiniteDuration()) return -1;
  const int64_t ms = absl::ToInt64Milliseconds(absl::Ceil(timeout, absl::Milliseconds(1)));
  return static_cast<int>(std::clamp<int64_t>(ms, 0, INT_MAX));
}

std::string FormatHostPort(absl::string_view host, int port) {
  if (host.find(':') != absl::string_view::npos) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

std::string FormatAddress(const SocketAddress& address) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (address.family() == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&address.storage);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
  } else if (address.family() == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&address.storage);
    inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    port = ntohs(in6->sin6_port);
  }
  return FormatHostPort(host, port);
}

namespace {

absl::Status SplitHostPort(absl::string_view host_port, std::string* host, std::string* port) {
  absl::string_view h, p;
  if (!host_port.empty() && host_port.front() == '[') {
    const size_t close = host_port.find("]:");
    if (close == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("malformed address '", host_port, "'"));
    }
    h = host_port.substr(1, close - 1);
    p = host_port.substr(close + 2);
  } else {
    const size_t colon = host_port.rfind(':');
    if (colon == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("malformed address '", host_port, "' (expected host:port)"));
    }
    h = host_port.substr(0, colon);
    p = host_port.substr(colon + 1);
  }
  int port_number = 0;
  if (h.empty() || !absl::SimpleAtoi(p, &port_number) || port_number <= 0 ||
      port_number > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("malformed address '", host_port, "'"));
  }
  *host = std::string(h);
  *port = std::string(p);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<SocketAddress>> Resolve(const std::string& host, const char* port,
                                                   bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | (passive ? AI_PASSIVE : 0);
  addrinfo* result = nullptr;
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port, &hints, &result);
  if (rc == EAI_NONAME) {
    // Not a numeric address: a hostname, resolved through the system resolver.
    hints.ai_flags &= ~AI_NUMERICHOST;
    rc = getaddrinfo(host.c_str(), port, &hints, &result);
  }
  if (rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve '", host, "': ", gai_strerror(rc)));
  }
  std::vector<SocketAddress> out;
  for (addrinfo* ai = result; ai != nullptr; ai = ai->ai_next) {
    if (ai->ai_addrlen > sizeof(sockaddr_storage)) continue;
    SocketAddress a;
    std::memcpy(&a.storage, ai->ai_addr, ai->ai_addrlen);
    a.length = ai->ai_addrlen;
    out.push_back(a);
  }
  freeaddrinfo(result);
  if (out.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("'", host, "' has no TCP address"));
  }
  return out;
}

bool IsWildcard(absl::string_view host) {
  return host.empty() || host == "0.0.0.0" || host == "::" || host == "*";
}

}  // namespace

absl::StatusOr<std::vector<SocketAddress>> ResolveHostPort(absl::string_view host_port) {
  std::string host, port;
  if (absl::Status s = SplitHostPort(host_port, &host, &port); !s.ok()) return s;
  return Resolve(host, port.c_str(), /*passive=*/false);
}

absl::StatusOr<Listener> Listen(absl::string_view bind_address, int backlog) {
  std::string host(bind_address);
  if (host == "*") host.clear();
  auto addresses = Resolve(host, "0", /*passive=*/true);
  if (!addresses.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("bind_address '", bind_address,
                                                   "': ", addresses.status().message()));
  }
  std::string last_error;
  for (const SocketAddress& a : *addresses) {
    UniqueFd fd(::socket(a.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd.valid()) {
      last_error = absl::StrCat("socket: ", ErrnoString(errno));
      continue;
    }
    if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&a.storage), a.length) != 0) {
      last_error = absl::StrCat("bind to ", FormatAddress(a), ": ", ErrnoString(errno));
      continue;
    }
    if (::listen(fd.get(), backlog) != 0) {
      last_error = absl::StrCat("listen on ", FormatAddress(a), ": ", ErrnoString(errno));
      continue;
    }
    SocketAddress bound;
    bound.length = sizeof(bound.storage);
    if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound.storage), &bound.length) !=
        0) {
      last_error = absl::StrCat("getsockname: ", ErrnoString(errno));
      continue;
    }
    Listener listener;
    if (IsWildcard(bind_address)) {
      // Peers cannot connect to a wildcard: publish the name of this host instead.
      char name[256] = {};
      if (::gethostname(name, sizeof(name) - 1) != 0) {
        return absl::InternalError(absl::StrCat("gethostname: ", ErrnoString(errno)));
      }
      const int port = ntohs(bound.family() == AF_INET
                                 ? reinterpret_cast<sockaddr_in*>(&bound.storage)->sin_port
                                 : reinterpret_cast<sockaddr_in6*>(&bound.storage)->sin6_port);
      listener.address = FormatHostPort(name, port);
    } else {
      listener.address = FormatAddress(bound);
    }
    listener.fd = std::move(fd);
    return listener;
  }
  return absl::UnavailableError(
      absl::StrCat("cannot listen on '", bind_address, "': ", last_error));
}

absl::Status ConfigureStreamSocket(int fd, int send_buffer_bytes, int recv_buffer_bytes) {
  const int one = 1;
  if (::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0) {
    return absl::InternalError(absl::StrCat("setsockopt(TCP_NODELAY): ", ErrnoString(errno)));
  }
  if (send_buffer_bytes > 0 && ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &send_buffer_bytes,
                                            sizeof(send_buffer_bytes)) != 0) {
    return absl::InternalError(absl::StrCat("setsockopt(SO_SNDBUF): ", ErrnoString(errno)));
  }
  if (recv_buffer_bytes > 0 && ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &recv_buffer_bytes,
                                            sizeof(recv_buffer_bytes)) != 0) {
    return absl::InternalError(absl::StrCat("setsockopt(SO_RCVBUF): ", ErrnoString(errno)));
  }
  return absl::OkStatus();
}

std::string PeerAddressOf(int fd) {
  SocketAddress a;
  a.length = sizeof(a.storage);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&a.storage), &a.length) != 0) return "?";
  return FormatAddress(a);
}

}  // namespace fairscale::comm::tcp_internal
