// Transport: point-to-point messages between the ranks of one communicator
// (//comm/algorithms:transport). The collective algorithms of this package are written once over
// it; the tcp, ucx and inproc backends implement it, and TransportCommunicator turns any
// Transport into a full Communicator.
//
// Contract:
// * Single-threaded: every method except Cancel() is called from one thread at a time (the
//   communicator's worker thread). Cancel() is thread-safe.
// * A message is what one Isend posts: `bytes` bytes with a 64-bit tag. Between an ordered pair
//   of ranks messages arrive in the order they were posted, and the receiver posts its Irecvs in
//   the same order: the k-th Irecv from peer p matches the k-th message p sent here. A message
//   whose tag or size differs from the matching Irecv fails that request (and the transport) with
//   kInvalidArgument naming the peer and both tags and sizes; nothing is written past the
//   receiver's buffer.
// * Zero-byte messages are real messages (barriers use them).
// * Buffers stay owned by the caller and must remain valid until the request completes.
// * Progress happens inside Wait() and Poll(), on all posted requests (so posting several
//   requests and then waiting on one of them overlaps them all).
// * Errors are final: after any error the transport is broken and later calls fail with the
//   first error. Codes: kUnavailable (a peer closed or reset its connection, or reported an
//   error, e.g. "peer 3 closed the connection after 4096/8192 bytes of a message"),
//   kInvalidArgument (mismatched message), kDeadlineExceeded (deadline passed; the message says
//   which peers still owed or were owed bytes), kAborted or the Cancel() reason.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "comm/communicator.h"

namespace fairscale::comm {

// Message tags used by TransportCommunicator: (seq << 32) | (signature << 8) | op type, where
// the 24-bit signature (OpContext::signature) encodes dtype, reduce op and root, so ranks that
// disagree about any of them fail with a mismatch instead of computing garbage. Send and Recv
// both use OpType::kSend with the per-peer sequence number, so the two sides' tags agree.
inline uint64_t MakeTag(OpType type, uint64_t seq, uint32_t signature = 0) {
  return (seq << 32) | (static_cast<uint64_t>(signature & 0xffffff) << 8) |
         static_cast<uint64_t>(type);
}
// "all_reduce #12 (f32 sum)" (for error messages).
std::string DescribeTag(uint64_t tag);

class Transport {
 public:
  // Identifies a posted request until it completes; never 0.
  using Request = uint64_t;

  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Post one message to `peer` (!= rank()).
  virtual Request Isend(int peer, uint64_t tag, const void* data, size_t bytes) = 0;
  // Post the receive of the next message from `peer` (!= rank()); it must carry `tag` and exactly
  // `bytes` bytes.
  virtual Request Irecv(int peer, uint64_t tag, void* data, size_t bytes) = 0;

  // Drives progress until every request in `requests` has completed, an error occurs, or
  // `deadline` passes. Completed requests are released (their ids are invalid afterwards).
  virtual absl::Status Wait(absl::Span<const Request> requests, absl::Time deadline) = 0;

  // Non-blocking progress and health check, called while the communicator is idle: detects peers
  // that failed (reported an error or died). Returns the transport's error, if any. A peer that
  // shut down cleanly (Shutdown(OK)) is not an error until this rank needs it: messages it sent
  // before leaving are still delivered.
  virtual absl::Status Poll() = 0;

  // Thread-safe. Makes a Wait() in progress (or the next one) return `reason` within ~100 ms.
  virtual void Cancel(const absl::Status& reason) = 0;

  // Thread-safe. Where peer `peer` is, for error messages: the address it published
  // ("10.0.0.2:41234"), or empty when the transport has none.
  virtual std::string PeerAddress(int peer) const {
    (void)peer;
    return std::string();
  }

  // Tells every peer that this rank failed with `reason` (so they fail fast, with this reason in
  // their message, instead of timing out), then closes all connections. Pending requests fail.
  // Called once, from the worker thread, when the communicator breaks or is destroyed (with OK).
  virtual void Shutdown(const absl::Status& reason) = 0;
};

}  // namespace fairscale::comm
