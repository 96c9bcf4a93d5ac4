// Test-only construction of a TcpTransport over sockets the caller has already connected: no
// store, no Hello, no same-host negotiation. The fuzz target (//comm/tcp/fuzz) uses it to drive a
// real transport's receive path with peer bytes it writes itself into the other end of a
// socketpair. Target //comm/tcp:transport_for_testing (testonly, visible to //comm/tcp/...); not
// part of the backend's API.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/tcp/internal/mesh.h"
#include "comm/tcp/internal/same_host.h"
#include "comm/tcp/tcp_transport.h"

namespace fairscale::comm::tcp_internal {

class TcpTransportForTesting {
 public:
  // `mesh` has one entry per rank: an invalid fd at `rank`, a connected stream socket (AF_UNIX
  // or TCP; made non-blocking here) everywhere else. `same_host[p]` is what the negotiation would
  // have agreed with peer p. Same-host reads may only target this process: a `pull_from` entry
  // whose pid is not getpid() is kInvalidArgument, so a test can never read another process.
  static absl::StatusOr<std::unique_ptr<TcpTransport>> Create(
      int rank, std::vector<MeshPeer> mesh, const std::vector<SameHostPeer>& same_host);
};

}  // namespace fairscale::comm::tcp_internal
