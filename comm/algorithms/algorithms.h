// Collective algorithms over a point-to-point Transport (//comm/algorithms:algorithms).
//
// TransportCommunicator runs each operation by calling one of these functions on its worker
// thread; tcp, ucx and inproc therefore share every algorithm:
//   all_reduce      direct exchange when small, else ring reduce-scatter + ring all-gather
//   reduce_scatter  direct exchange when small, else ring
//   all_gather      direct exchange when small, else ring (received straight into the output)
//   broadcast       binomial tree, segmented and pipelined
//   reduce          binomial tree, segmented and pipelined
//   all_to_all      pairwise exchange
//   barrier         dissemination
//   send / recv     direct, segmented
// Every function blocks until the operation is done on this rank, an error occurs, or
// ctx.deadline passes; errors are the Transport's (the caller adds the op label). All messages
// of one operation carry ctx.tag. Results of all_reduce are bit-identical on every rank (each
// element is reduced once, in one order, and then copied); kAvg divides the final sums. Arguments
// are assumed valid (the Communicator base class checks them). Memory beyond the caller's buffers
// is bounded by a few algo.chunk_bytes (ring, tree) or n * algo.small_bytes (direct exchange),
// taken from a Scratch the caller keeps between operations.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "comm/algorithms/transport.h"
#include "comm/communicator.h"
#include "comm/types.h"

namespace fairscale::comm::algo {

// The "algo.*" knobs of CommConfig::options (see transport_communicator.h).
struct Options {
  size_t chunk_bytes = 512 << 10;
  size_t small_bytes = 16 << 10;
  // Liveness (TransportCommunicator's HeartbeatMonitor, heartbeat.h): every rank beats through
  // the store every heartbeat_ms (0: off), and an operation that has waited stall_timeout_ms
  // on a rank that stopped beating fails naming it. stall_timeout_ms >= 4 * heartbeat_ms.
  // Left unset, the stall timeout is EffectiveStallTimeout's: 10 s, or half the communicator's
  // operation timeout when that is shorter, so that a frozen rank is named by the heartbeats
  // before the operation timeout blames whichever peer it waited for.
  size_t heartbeat_ms = 1000;
  size_t stall_timeout_ms = 10000;
  bool stall_timeout_given = false;  // algo.stall_timeout_ms was set
};

// The stall timeout the heartbeat monitor uses: stall_timeout_ms when given; otherwise
// min(stall_timeout_ms, op_timeout / 2), but not under 4 beats (4 * heartbeat_ms).
absl::Duration EffectiveStallTimeout(const Options& options, absl::Duration op_timeout);

// Parses the "algo.*" keys of `options`, ignoring the others. kInvalidArgument names the key for
// an unknown "algo." key or a value that is not a decimal byte count in range.
absl::StatusOr<Options> ParseOptions(const absl::flat_hash_map<std::string, std::string>& options);

// Reusable scratch memory. Get() invalidates what an earlier Get() returned.
class Scratch {
 public:
  char* Get(size_t bytes);
  size_t capacity() const { return size_; }

 private:
  std::unique_ptr<char[]> data_;
  size_t size_ = 0;
};

struct Context {
  Transport* transport = nullptr;
  uint64_t tag = 0;  // every message of the operation carries it
  absl::Time deadline = absl::InfiniteFuture();
  Options options;
  Scratch* scratch = nullptr;
};

absl::Status AllReduce(const Context& ctx, ConstBuffer send, Buffer recv, ReduceOp op);
absl::Status ReduceScatter(const Context& ctx, ConstBuffer send, Buffer recv, ReduceOp op);
absl::Status AllGather(const Context& ctx, ConstBuffer send, Buffer recv);
absl::Status Broadcast(const Context& ctx, Buffer buffer, int root);
// `recv` is used on the root only.
absl::Status Reduce(const Context& ctx, ConstBuffer send, Buffer recv, ReduceOp op, int root);
absl::Status AllToAll(const Context& ctx, ConstBuffer send, Buffer recv);
// Send returns once its messages have left; on a rendezvous transport (inproc) that is when the
// peer has posted the matching Recv. As with MPI_Ssend, two ranks that each Send to the other
// before their Recv wait for each other until the timeout; order the pair (lower rank sends
// first) instead.
absl::Status Send(const Context& ctx, ConstBuffer buffer, int peer);
absl::Status Recv(const Context& ctx, Buffer buffer, int peer);
absl::Status Barrier(const Context& ctx);
// Every send and receive of `items` at once (each item's messages carry
// MakeTag(OpType::kSend, item.seq)); done when all are.
absl::Status BatchP2P(const Context& ctx, const std::vector<P2PItem>& items);

}  // namespace fairscale::comm::algo
