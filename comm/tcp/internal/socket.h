// Thin POSIX socket helpers for the tcp backend (internal to //comm/tcp): an owning fd, address
// parsing and formatting, and the listener/connection sockets the mesh setup creates. Every
// socket they create is non-blocking and close-on-exec.
#pragma once

#include <sys/socket.h>

#include <cerrno>

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace fairscale::comm::tcp_internal {

// Owns a file descriptor; closes it on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) Reset(std::exchange(other.fd_, -1));
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { Reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int Release() { return std::exchange(fd_, -1); }
  void Reset(int fd = -1);

 private:
  int fd_ = -1;
};

// "Connection refused (errno 111)".
std::string ErrnoString(int err);

inline bool WouldBlock(int err) { return err == EAGAIN || err == EWOULDBLOCK; }

// poll()'s timeout argument for `timeout`: rounded up to whole ms, -1 for infinite.
int PollTimeoutMs(absl::Duration timeout);

// A resolved socket address.
struct SocketAddress {
  sockaddr_storage storage{};
  socklen_t length = 0;
  int family() const { return storage.ss_family; }
};

// "127.0.0.1:4242", "[::1]:4242".
std::string FormatAddress(const SocketAddress& address);
std::string FormatHostPort(absl::string_view host, int port);

// Splits "host:port" / "[v6]:port" and resolves it (numeric hosts never touch DNS).
absl::StatusOr<std::vector<SocketAddress>> ResolveHostPort(absl::string_view host_port);

// A listening socket on `bind_address` with an OS-assigned port, and the "host:port" that peers
// should connect to (the hostname when bound to a wildcard address).
struct Listener {
  UniqueFd fd;
  std::string address;
};
absl::StatusOr<Listener> Listen(absl::string_view bind_address, int backlog);

// TCP_NODELAY, and SO_SNDBUF / SO_RCVBUF when the byte counts are > 0 (0 keeps the kernel's
// autotuning). O_NONBLOCK is set at creation.
absl::Status ConfigureStreamSocket(int fd, int send_buffer_bytes, int recv_buffer_bytes);

// The peer address of a connected socket ("?" when unknown).
std::string PeerAddressOf(int fd);

}  // namespace fairscale::comm::tcp_internal
