// Communicator: a group of `size()` ranks that run collectives over raw buffers
// (//comm:interface, no LibTorch). Feature libraries (fsdp, oss, pipe, ...) take a
// std::shared_ptr<Communicator> and depend on nothing else of comm; binaries pick the backend
// (tcp, ucx, nccl, inproc) at link time, see registry.h.
//
// Contract, for every backend:
// * Asynchronous. Each operation is queued when the method returns and reports through the
//   returned Work. Operations run in the order they were issued; all ranks must issue the same
//   collectives in the same order with matching arguments (same count, dtype, op, root).
//   Send/Recv pairs match in issue order per peer pair, interleaved with collectives the same way
//   on both sides.
// * Thread-safety: every method may be called from any thread; the issue order is the order in
//   which the calls return. Issue from one thread when the order across ranks matters (it always
//   does).
// * Buffers: the caller owns them; they must stay valid and unmodified (recv: untouched) until
//   the Work completes. `data` may be null only when `count` is 0.
// * Argument errors (bad dtype, size rule broken, root/peer out of range, partial overlap,
//   unsupported device, kAvg on integers) return an already-failed Work with kInvalidArgument
//   and queue nothing.
// * Errors name the op, its sequence number, rank/size, backend and peer:
//     "all_reduce #12 rank 2/4 [tcp]: peer 3 closed the connection after 4096/8192 bytes"
//   kDeadlineExceeded: the op's timeout passed. kUnavailable: a peer died or closed its
//   connection. kInvalidArgument: also a mismatch between ranks (different count/op). kAborted:
//   Abort() was called. After any such error the communicator is broken: every pending and later
//   operation fails with that error (see status()), and peers are told so that no rank hangs.
//   On a peer, the operations pending when it hears of the failure fail (kUnavailable, with the
//   failing rank's message appended), including ones queued behind the failed op. An operation
//   whose messages had all arrived before the failure may still complete; the next one that
//   needs the failed rank fails fast. A mismatch is reported as kInvalidArgument by the rank(s)
//   that received the mismatching message (which ones depends on the algorithm); the others get
//   kUnavailable naming the rank that detected it.
// * Every operation finishes within its timeout (OpOptions::timeout, else CommConfig::timeout),
//   counted from the moment it starts running.
//
// Size and in-place rules (n = size(), r = rank(); "in-place" = the exact aliasing shown, any
// other overlap between send and recv is kInvalidArgument):
//   AllReduce(send, recv, op)      send.count == recv.count.      In-place: send.data == recv.data.
//   ReduceScatter(send, recv, op)  send.count == n * recv.count.  Rank r gets block r.
//                                  In-place: recv.data == send.data + r * recv.bytes().
//   AllGather(send, recv)          recv.count == n * send.count.  Block i of recv is rank i's send.
//                                  In-place: send.data == recv.data + r * send.bytes().
//   Broadcast(buffer, root)        root's buffer is copied to every rank's buffer.
//   Reduce(send, recv, op, root)   on root recv.count == send.count (in-place allowed); recv is
//                                  ignored on other ranks (pass {}).
//   AllToAll(send, recv)           send.count == recv.count, divisible by n; block j of send goes
//                                  to rank j, block i of recv comes from rank i. No in-place.
//   Send(buffer, peer) / Recv(buffer, peer)  counts and dtypes must match; peer != rank.
//                                  A Send may complete only once the peer receives (it does on
//                                  rendezvous transports), and operations run one after another,
//                                  so two ranks that each Send to the other before their Recv can
//                                  wait for each other until the timeout. Use BatchP2P for
//                                  exchanges: it runs all its sends and receives at once.
//   BatchP2P(ops)                  a group of Sends and Recvs (to any peers) run concurrently as
//                                  one operation, like NCCL's group calls or PyTorch's
//                                  batch_isend_irecv. Each item matches a Send/Recv (or a
//                                  BatchP2P item) of the peer in per-peer issue order.
//   Barrier()                      completes once every rank has entered it.
//   Split(color, key)              collective and blocking; ranks with the same color form a new
//                                  communicator ordered by (key, old rank); color < 0 (kNoColor)
//                                  returns nullptr. The child is independent of the parent.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "comm/types.h"
#include "comm/work.h"

namespace fairscale::comm {

enum class OpType : uint8_t {
  kAllReduce = 1,
  kReduceScatter,
  kAllGather,
  kBroadcast,
  kReduce,
  kAllToAll,
  kSend,
  kRecv,
  kBarrier,
  kSplit,
  kBatchP2P,
};
absl::string_view OpTypeName(OpType type);  // "all_reduce", "reduce_scatter", ...

struct OpOptions {
  // Zero means the communicator's default (CommConfig::timeout).
  absl::Duration timeout = absl::ZeroDuration();
};

// One validated operation, as the base class hands it to a backend.
struct OpContext {
  OpType type = OpType::kBarrier;
  // Collectives: the n-th collective on this communicator (same on every rank, from 1).
  // Send/Recv: the n-th send to / recv from that peer (so both sides agree).
  uint64_t seq = 0;
  absl::Duration timeout = absl::ZeroDuration();
  int rank = 0;
  int size = 1;
  absl::string_view backend;
  // What all ranks must agree on besides the op and the size: dtype, reduce op and root (see
  // MakeSignature). Backends put it on the wire so a disagreement is an error, not garbage.
  uint32_t signature = 0;

  // "all_reduce #12 rank 2/4 [tcp]"
  std::string Label() const;
  // The status `code` with message "<Label()>: <message>".
  absl::Status Error(absl::StatusCode code, absl::string_view message) const;
};

// 24 bits: dtype + 1 (bits 0-3), reduce op + 1 (bits 4-7), root + 1 (bits 8-23); 0 = absent.
uint32_t MakeSignature(const DataType* dtype, const ReduceOp* op = nullptr, int root = -1);
// "f32 sum root 2".
std::string DescribeSignature(uint32_t signature);

inline constexpr int kNoColor = -1;

// One item of BatchP2P.
struct P2POp {
  bool is_send = false;
  Buffer buffer;  // never written when is_send
  int peer = -1;

  static P2POp Send(ConstBuffer b, int peer) {
    return {true, Buffer{const_cast<void*>(b.data), b.count, b.dtype, b.device}, peer};
  }
  static P2POp Recv(Buffer b, int peer) { return {false, b, peer}; }
};

// A validated BatchP2P item with its per-peer sequence number.
struct P2PItem {
  P2POp op;
  uint64_t seq = 0;
};

class Communicator {
 public:
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  absl::string_view backend() const { return backend_; }
  absl::Duration default_timeout() const { return default_timeout_; }

  Work AllReduce(ConstBuffer send, Buffer recv, ReduceOp op, const OpOptions& opts = {});
  Work ReduceScatter(ConstBuffer send, Buffer recv, ReduceOp op, const OpOptions& opts = {});
  Work AllGather(ConstBuffer send, Buffer recv, const OpOptions& opts = {});
  Work Broadcast(Buffer buffer, int root, const OpOptions& opts = {});
  Work Reduce(ConstBuffer send, Buffer recv, ReduceOp op, int root, const OpOptions& opts = {});
  Work AllToAll(ConstBuffer send, Buffer recv, const OpOptions& opts = {});
  Work Send(ConstBuffer buffer, int peer, const OpOptions& opts = {});
  Work Recv(Buffer buffer, int peer, const OpOptions& opts = {});
  Work Barrier(const OpOptions& opts = {});
  // Runs every send and receive of `ops` concurrently; done when all are. An empty batch is done
  // at once.
  Work BatchP2P(const std::vector<P2POp>& ops, const OpOptions& opts = {});

  // Collective and blocking (bounded by the timeout). nullptr for color < 0.
  absl::StatusOr<std::shared_ptr<Communicator>> Split(int color, int key,
                                                       const OpOptions& opts = {});

  // Fails every pending and later operation with `reason` (kAborted if `reason` is OK) and
  // tells the peers, whose operations then fail with kUnavailable. Non-blocking, idempotent,
  // callable from any thread (e.g. a watchdog).
  virtual void Abort(absl::Status reason) = 0;

  // OK while healthy; else the error that broke the communicator (NCCL's async error query).
  virtual absl::Status status() const = 0;

  // Whether buffers on `device` are accepted (default: CPU only).
  virtual bool SupportsDevice(Device device) const { return device.type == DeviceType::kCpu; }

 protected:
  Communicator(int rank, int size, std::string backend, absl::Duration default_timeout);

  // Called with validated arguments; `ctx` carries the sequence number and the timeout.
  virtual Work DoAllReduce(const OpContext& ctx, ConstBuffer send, Buffer recv, ReduceOp op) = 0;
  virtual Work DoReduceScatter(const OpContext& ctx, ConstBuffer send, Buffer recv,
                               ReduceOp op) = 0;
  virtual Work DoAllGather(const OpContext& ctx, ConstBuffer send, Buffer recv) = 0;
  virtual Work DoBroadcast(const OpContext& ctx, Buffer buffer, int root) = 0;
  virtual Work DoReduce(const OpContext& ctx, ConstBuffer send, Buffer recv, ReduceOp op,
                        int root) = 0;
  virtual Work DoAllToAll(const OpContext& ctx, ConstBuffer send, Buffer recv) = 0;
  virtual Work DoSend(const OpContext& ctx, ConstBuffer buffer, int peer) = 0;
  virtual Work DoRecv(const OpContext& ctx, Buffer buffer, int peer) = 0;
  virtual Work DoBarrier(const OpContext& ctx) = 0;
  // ctx.type is kBatchP2P and ctx.seq 0; every item carries its own per-peer seq (messages are
  // tagged as Send/Recv with that seq, so they match plain Send/Recv on the peer).
  virtual Work DoBatchP2P(const OpContext& ctx, std::vector<P2PItem> items) = 0;
  // Every rank calls this, including those with color == kNoColor, which take part in the
  // exchange and return nullptr. Returns this rank's child communicator.
  virtual absl::StatusOr<std::shared_ptr<Communicator>> DoSplit(const OpContext& ctx, int color,
                                                                int key) = 0;

 private:
  OpContext NextCollective(OpType type, const OpOptions& opts) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  OpContext MakeContext(OpType type, uint64_t seq, const OpOptions& opts) const;
  // Send (buffer never written) and Recv share validation and per-peer sequencing.
  Work PointToPoint(OpType type, Buffer buffer, int peer, const OpOptions& opts);
  absl::Status CheckBuffer(const OpContext& ctx, absl::string_view what, const void* data,
                           size_t count, DataType dtype, Device device) const;

  const int rank_;
  const int size_;
  const std::string backend_;
  const absl::Duration default_timeout_;

  // Held while an operation gets its sequence number and is queued, so the issue order is the
  // sequence order.
  absl::Mutex mu_;
  uint64_t collective_seq_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<uint64_t> send_seq_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> recv_seq_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fairscale::comm
