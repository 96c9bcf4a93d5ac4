#include "comm/tcp/internal/transport_for_testing.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "comm/tcp/internal/socket.h"

namespace fairscale::comm::tcp_internal {

absl::StatusOr<std::unique_ptr<TcpTransport>> TcpTransportForTesting::Create(
    int rank, std::vector<MeshPeer> mesh, const std::vector<SameHostPeer>& same_host) {
  const int size = static_cast<int>(mesh.size());
  if (size < 1 || rank < 0 || rank >= size || same_host.size() != mesh.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TcpTransportForTesting: rank ", rank, " with ", size, " connections and ",
        same_host.size(), " same-host entries"));
  }
  for (int p = 0; p < size; ++p) {
    if (p == rank) {
      if (mesh[p].fd.valid()) {
        return absl::InvalidArgumentError(
            absl::StrCat("TcpTransportForTesting: rank ", rank, " has a connection to itself"));
      }
      continue;
    }
    const int fd = mesh[p].fd.get();
    const int flags = fd >= 0 ? ::fcntl(fd, F_GETFL) : -1;
    if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "TcpTransportForTesting: connection to peer ", p, " is not a usable fd: ",
          ErrnoString(errno)));
    }
    if (same_host[p].pull_from && same_host[p].pid != ::getpid()) {
      return absl::InvalidArgumentError(
          absl::StrCat("TcpTransportForTesting: peer ", p, " would read the memory of pid ",
                       same_host[p].pid, "; tests may only read their own (", ::getpid(), ")"));
    }
  }
  return TcpTransport::FromConnections(rank, std::move(mesh), same_host);
}

}  // namespace fairscale::comm::tcp_internal
