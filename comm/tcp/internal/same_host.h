// Same-host copies for the tcp backend (internal to //comm/tcp): deciding, per connection,
// whether the receiver may read large messages straight from the sender's memory
// (process_vm_readv, "cross-memory attach", as UCX's cma transport and Open MPI's vader do)
// instead of both sides copying them through the socket.
//
// Measured on a 2-core VM (//comm/bench:same_host_copy_cost, 1.6 MB messages): loopback TCP
// costs 0.42-0.47 CPU-ms per MB moved (both sides' copies plus the TCP stack), process_vm_readv
// 0.09-0.11 (the receiver's one copy). The negotiation is in wire.h (SameHostOffer); TcpTransport
// sends PULL frames where it succeeded.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "comm/tcp/internal/mesh.h"

namespace fairscale::comm::tcp_internal {

inline constexpr uint64_t kNeverPull = std::numeric_limits<uint64_t>::max();

struct SameHostPeer {
  pid_t pid = 0;        // the peer's process (valid when pull_from)
  bool pull_to = false;    // the peer reads our messages of >= min_bytes from our memory
  bool pull_from = false;  // we read the peer's messages of >= min_bytes from its memory
  uint64_t min_bytes = kNeverPull;
};

// True when both ends of the connected socket `fd` have the same IP address (so the peer is
// on this host, or in this network namespace).
bool SameHostConnection(int fd);

// Runs the offer/answer exchange on every connection of `mesh` (index `rank` is ours and
// skipped), concurrently, bounded by `deadline`. `min_bytes` 0 declines (the peer is told, and
// both directions stay on the socket). Errors (a peer that closes or speaks garbage) are
// prefixed with "tcp rendezvous rank r/n".
absl::StatusOr<std::vector<SameHostPeer>> NegotiateSameHost(const std::vector<MeshPeer>& mesh,
                                                            int rank, uint64_t min_bytes,
                                                            absl::Time deadline);

// Reads `bytes` bytes at `remote` in process `pid` into `local` (looping over short reads).
// Returns 0 or the errno of the failing process_vm_readv.
int ReadProcessMemory(pid_t pid, uint64_t remote, void* local, size_t bytes);

}  // namespace fairscale::comm::tcp_internal
