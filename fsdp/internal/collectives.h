// The gradient reductions of FSDP (//fsdp, internal): the divide factors, and the queue of
// reductions one root has issued and not yet completed.
//
// A unit hands the queue its pre-divided full gradient (Unit::TakeGradient); the queue
// reduce-scatters it over the unit's shard group (sharded strategies; HYBRID_SHARD then
// all-reduces the reduced shard over the replicate group), or all-reduces it over the world
// (unsharded; in place on the gradient views when FlatParam::grad_views), optionally bucketing
// gradients of units with the same groups into one reduce-scatter (bucket_cap_mb). At most
// reductions_in_flight reductions stay pending: each completed one is handed back to its unit
// (Unit::AddReduced), which divides by the post factor (pre * post = the world size: the mean
// over every rank) and adds it into the optimizer's gradients.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "comm/communicator.h"
#include "comm/torch/tensor_buffer.h"
#include "comm/work.h"
#include "fsdp/fsdp_options.h"
#include "base/torch_error.h"

namespace fairscale::fsdp::internal {

class Unit;

// The (pre, post) divide factors of a unit's gradients; see FsdpOptions.
inline std::pair<double, double> DivideFactors(const FsdpOptions& options, int world) {
  double pre = options.gradient_predivide_factor();
  double post = options.gradient_postdivide_factor();
  if (pre <= 0) pre = post > 0 ? 1.0 : default_gradient_predivide_factor(world);
  if (post <= 0) post = world / pre;
  return {pre, post};
}

// The communication buffer over `t`; raises naming `context` if it cannot be one.
inline comm::Buffer Buf(const at::Tensor& t, const std::string& context) {
  return base::ValueOrThrow(comm::ToBuffer(t), context);
}

// Where one flat parameter's reduced gradient lands in a reduction's `recv`.
struct ReducePart {
  Unit* unit;
  size_t flat;
  int64_t offset = 0;  // in recv
};

// A gradient reduction that is issued and not yet waited for: one flat parameter, or a bucket
// of several (bucket_cap_mb).
struct PendingReduce {
  std::vector<ReducePart> parts;
  comm::Work work;
  at::Tensor send;  // kept alive until the Work completes
  at::Tensor recv;  // reduce-scatter: this rank's block of `send` (in place)
  // All-reduce in place on the shard's .grad (FlatParam::grad_views): nothing to add.
  bool in_place_grad = false;
  // HYBRID_SHARD: once the reduce-scatter inside the shard group is done, `recv` is
  // all-reduced in place over this replicate group (null: nothing more to do).
  std::shared_ptr<comm::Communicator> replicate;
};

// Padded full gradients waiting to be reduce-scattered together in one operation (all of units
// with the same shard group).
struct GradBucket {
  std::vector<ReducePart> parts;
  std::vector<at::Tensor> sends;  // each [shard group size * shard_numel]
  int64_t bytes = 0;
  int64_t numel = 0;  // per rank: the sum of the parts' shard_numel
};

class ReductionQueue {
 public:
  // Reduces `send` (flat parameter `flat` of `unit`, from Unit::TakeGradient; undefined:
  // nothing to do), then completes the oldest reductions until at most `unit`'s
  // reductions_in_flight (at least 1) are pending. `in_place`: `send` is the shard's .grad,
  // all-reduced where it is.
  void Submit(Unit& unit, size_t flat, at::Tensor send, bool in_place);
  // Reduce-scatters the bucket, if it holds anything; then keeps at most `max_in_flight`.
  void Flush(size_t max_in_flight);
  // Completes the oldest pending reductions until at most `keep` are left, so that each full
  // gradient is freed soon after its reduction instead of at the end of backward. Stops at a
  // failed one (WaitAll reports it).
  void Drain(size_t keep);
  // Completes every pending reduction; raises c10::Error naming the unit of a failed one.
  void WaitAll();
  // Waits for every pending reduction, ignoring failures (teardown).
  void WaitIgnoringErrors();
  void Clear();

 private:
  // Waits for `p`; under HYBRID_SHARD then all-reduces its result across the shard groups (and
  // waits for that too).
  static absl::Status Wait(PendingReduce& p);
  static void Complete(const PendingReduce& p);

  std::vector<PendingReduce> pending_;
  GradBucket bucket_;
};

}  // namespace fairscale::fsdp::internal
