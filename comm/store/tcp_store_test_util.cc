#include "comm/store/tcp_store_test_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "absl/time/clock.h"

namespace fairscale::comm::testing {

absl::StatusOr<std::unique_ptr<TCPStore>> StartTestServer(TCPStoreOptions options) {
  options.is_server = true;
  if (options.timeout == TCPStoreOptions().timeout) options.timeout = kStoreTestTimeout;
  return TCPStore::Create(options);
}

absl::StatusOr<std::unique_ptr<TCPStore>> ConnectTestClient(int port, TCPStoreOptions options) {
  options.port = port;
  if (options.timeout == TCPStoreOptions().timeout) options.timeout = kStoreTestTimeout;
  return TCPStore::Create(options);
}

int RawConnect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

bool ClosedByPeer(int fd, absl::Duration timeout, std::vector<wire::Message>* replies) {
  wire::Decoder decoder(wire::Decoder::Direction::kReplies);
  std::vector<wire::Message> ignored;
  const absl::Time deadline = absl::Now() + timeout;
  char buf[4096];
  while (absl::Now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 20) <= 0) continue;
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
    if (n > 0) (void)decoder.Feed(absl::string_view(buf, n), replies ? replies : &ignored);
  }
  return false;
}

void SendAll(int fd, absl::string_view bytes) {
  while (!bytes.empty()) {
    const ssize_t n = send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (n <= 0) return;
    bytes.remove_prefix(static_cast<size_t>(n));
  }
}

}  // namespace fairscale::comm::testing
