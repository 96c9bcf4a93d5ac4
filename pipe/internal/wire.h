// How activations and gradients cross a stage boundary (//pipe, internal): tensors of any dtype
// the comm layer carries (bool travels as u8), single or as a list, moved with the
// communicator's Send/Recv.
//
// Activations (stage s -> s + 1, one message per micro-batch; boundary_layout.h encodes and
// checks the header and the layout):
//   header  int64[3] {kMagic, id, meta_len}            always (id: which message, e.g. Pipe's
//                                                       virtual stage * chunks + micro-batch)
//   meta    int64[meta_len]                            only when the layout changed (meta_len > 0)
//   payload one Send per tensor, in order
// The layout (list or single tensor, the count of trailing skip tensors, and per tensor: dtype,
// requires_grad, sizes) is sent once
// and again only when it changes (e.g. a smaller last micro-batch), so the receiving stage need
// not know shapes in advance and the common case costs one 24-byte header per micro-batch.
// Gradients (s + 1 -> s) have the layout of the activations the receiver sent, so they travel
// without a header.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "pipe/internal/boundary_layout.h"

namespace fairscale::pipe::internal {

// What one stage hands to the next: the value of a layer whose forward returned an at::Tensor
// (is_list false, one tensor) or a std::vector<at::Tensor> (is_list true), followed by `skips`
// skip tensors in transit (skip.h; the stages agree on their order).
struct Boundary {
  std::vector<at::Tensor> tensors;
  bool is_list = false;
  int64_t skips = 0;
};

BoundaryLayout LayoutOf(const Boundary& boundary);
// EncodeLayout, DecodeLayout, DescribeLayout and the header: boundary_layout.h.

// Buffers of operations that failed or timed out and may still be in the backend's hands: they
// are kept here, owned by something that outlives the communicator (Pipe declares it before its
// communicators), instead of being freed under a running operation.
using Orphans = std::vector<at::Tensor>;

// Sends issued but not yet known to be complete, with the tensors they read (kept alive until
// then; if destroyed before WaitAll succeeded, they move to `orphans`).
class PendingSends {
 public:
  explicit PendingSends(Orphans* orphans) : orphans_(orphans) {}
  ~PendingSends();
  PendingSends(const PendingSends&) = delete;
  PendingSends& operator=(const PendingSends&) = delete;
  void Add(comm::Work work, at::Tensor keep_alive);
  // Waits for every send; the first error wins. Clears the list.
  absl::Status WaitAll(absl::Duration timeout);
  size_t size() const { return works_.size(); }

 private:
  Orphans* orphans_;
  std::vector<comm::Work> works_;
  std::vector<at::Tensor> keep_alive_;
};

// One end of a pipeline link for activations. Tracks the layout last sent / received on the
// link so that it is sent only when it changes. Not thread-safe (one per stage and direction).
class ActivationLink {
 public:
  ActivationLink(comm::Communicator* comm, int peer, absl::Duration timeout, Orphans* orphans)
      : comm_(comm), peer_(peer), timeout_(timeout), orphans_(orphans) {}

  // Issues header, layout (if changed) and payload sends. Tensors are sent detached.
  // kInvalidArgument if the layout cannot travel (CheckLayout).
  absl::Status Send(int64_t id, const Boundary& boundary, PendingSends* pending);
  // Receives the activations of message `id` (kInternal if the peer sent another one; kDataLoss
  // on a malformed header or layout; kResourceExhausted if the tensors it announces cannot be
  // allocated). Floating
  // point tensors whose sender required grad come back as leaves that require grad.
  absl::StatusOr<Boundary> Recv(int64_t id);

 private:
  comm::Communicator* comm_;
  int peer_;
  absl::Duration timeout_;
  Orphans* orphans_;
  std::optional<BoundaryLayout> last_layout_;
};

// Gradients: `grads` must match `layouts` (the receiver's view of what it sent). Undefined
// gradients are sent as zeros.
absl::Status SendGradients(comm::Communicator* comm, int peer,
                           const std::vector<TensorLayout>& layouts,
                           const std::vector<at::Tensor>& grads, PendingSends* pending);
absl::StatusOr<std::vector<at::Tensor>> RecvGradients(comm::Communicator* comm, int peer,
                                                      const std::vector<TensorLayout>& layouts,
                                                      absl::Duration timeout, Orphans* orphans);

}  // namespace fairscale::pipe::internal
