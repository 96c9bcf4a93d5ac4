// FullyShardedDataParallelImpl's gradient reduction: a unit's flat gradients reduce-scattered
// over the shard group (sharded strategies; HYBRID_SHARD then all-reduces the reduced shard
// over the replicate group) or all-reduced over the world (NO_SHARD, in place on the gradient
// views), bucketed, with at most options.reductions_in_flight() reductions pending; completion
// divides by the post factor (pre * post = the world size: the mean over every rank) and
// accumulates into the shard's .grad. Forward/backward and the gathers are in
// fully_sharded_data_parallel.cc.
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/internal/errors.h"
#include "fsdp/internal/root_state.h"
#include "fsdp/internal/unit_util.h"

namespace fairscale::fsdp {

using internal::FlatParam;
using internal::ThrowIfError;

void FullyShardedDataParallelImpl::issue_reduce(size_t flat) {
  FlatParam& fp = flats_[flat];
  fp.reduced = true;
  const std::string context = label() + ": gradient reduction";
  const int max_in_flight = std::max(1, options_.reductions_in_flight());
  if (fp.grad_views) {
    attach_grad_views(fp);
    if (world_ == 1) return;  // the mean over one rank; the factors multiply to 1
    c10::NoGradGuard no_grad;
    at::Tensor g = fp.shard.grad();
    const double pre = internal::DivideFactors(options_, world_).first;
    if (pre != 1.0) g.div_(pre);
    internal::PendingReduce p{{{this, flat, 0}}, comm::Work(), g, g, /*in_place_grad=*/true};
    comm::Buffer b = internal::Buf(g, context);
    p.work = comm_->AllReduce(b, b, comm::ReduceOp::kSum);
    state_->pending.push_back(std::move(p));
    drain_reduces(static_cast<size_t>(max_in_flight));
    return;
  }
  at::Tensor send = fp.full_grad;
  fp.full_grad = at::Tensor();
  c10::NoGradGuard no_grad;
  if (!send.defined())
    send = at::zeros({fp.padded_numel}, fp.full.options().dtype(fp.reduce_dtype));
  const double pre = internal::DivideFactors(options_, world_).first;
  if (pre != 1.0) send.div_(pre);
  const int64_t bytes = send.numel() * static_cast<int64_t>(send.element_size());
  const double cap = options_.bucket_cap_mb() * 1024 * 1024;
  if (sharded() && cap > 0 && bytes <= cap) {
    internal::GradBucket& bucket = state_->bucket;
    if (!bucket.sends.empty() &&
        (bucket.sends.front().scalar_type() != send.scalar_type() || bucket.bytes + bytes > cap ||
         bucket.parts.front().unit->shard_comm_ != shard_comm_ ||
         bucket.parts.front().unit->replicate_comm_ != replicate_comm_)) {
      flush_bucket();
    }
    bucket.parts.push_back({this, flat, bucket.numel});
    bucket.sends.push_back(send);
    bucket.bytes += bytes;
    bucket.numel += fp.shard_numel;
    return;
  }
  internal::PendingReduce p{{{this, flat, 0}}, comm::Work(), send, at::Tensor()};
  if (world_ == 1) {  // mixed precision at world size 1: nothing to reduce
    p.recv = send;
    complete_reduce(p);
    return;
  }
  if (sharded()) {
    // In place: this rank's block of the send buffer, no separate receive buffer.
    p.recv = send.narrow(0, fp.shard_offset, fp.shard_numel);
    p.work = shard_comm_->ReduceScatter(internal::Buf(send, context),
                                        internal::Buf(p.recv, context), comm::ReduceOp::kSum);
    p.replicate = replicate_comm_;
  } else {
    p.recv = send;
    comm::Buffer b = internal::Buf(send, context);
    p.work = comm_->AllReduce(b, b, comm::ReduceOp::kSum);
  }
  state_->pending.push_back(std::move(p));
  drain_reduces(static_cast<size_t>(max_in_flight));
}

void FullyShardedDataParallelImpl::flush_bucket() {
  internal::GradBucket& bucket = state_->bucket;
  if (bucket.sends.empty()) return;
  // The groups of the bucket's units (the caller may be the root, at the end of backward).
  const FullyShardedDataParallelImpl* owner = bucket.parts.front().unit;
  // Reduce-scatter gives rank r the r-th contiguous chunk of the input, so the bucket is laid out
  // rank-major: [rank 0: shard of part 0, shard of part 1, ...][rank 1: ...]...
  std::vector<at::Tensor> rows;
  for (size_t i = 0; i < bucket.sends.size(); ++i) {
    rows.push_back(bucket.sends[i].view({owner->shard_world_, -1}));
  }
  c10::NoGradGuard no_grad;
  internal::PendingReduce p{std::move(bucket.parts), comm::Work(), at::cat(rows, 1).reshape({-1}),
                            at::Tensor()};
  p.recv = p.send.narrow(0, owner->shard_rank_ * bucket.numel, bucket.numel);  // in place
  const std::string context = owner->label() + ": bucketed gradient reduction";
  p.work = owner->shard_comm_->ReduceScatter(internal::Buf(p.send, context),
                                             internal::Buf(p.recv, context), comm::ReduceOp::kSum);
  p.replicate = owner->replicate_comm_;
  state_->pending.push_back(std::move(p));
  bucket = internal::GradBucket();
  drain_reduces(static_cast<size_t>(std::max(1, options_.reductions_in_flight())));
}

void FullyShardedDataParallelImpl::drain_reduces(size_t keep) {
  std::vector<internal::PendingReduce>& pending = state_->pending;
  while (pending.size() > keep) {
    if (!wait_reduce(pending.front()).ok()) return;
    complete_reduce(pending.front());
    pending.erase(pending.begin());
  }
}

absl::Status FullyShardedDataParallelImpl::wait_reduce(internal::PendingReduce& p) {
  absl::Status status = p.work.Wait();
  if (!status.ok() || p.replicate == nullptr) return status;
  // HYBRID_SHARD: the shard group's sum, summed over the groups. Issued here, once the
  // reduce-scatter is known done, in the same order on every rank (the order of the waits).
  const std::shared_ptr<comm::Communicator> replicate = std::move(p.replicate);
  p.replicate = nullptr;
  const std::string context = p.parts.front().unit->label() + ": all_reduce across shard groups";
  comm::Buffer b = internal::Buf(p.recv, context);
  p.work = replicate->AllReduce(b, b, comm::ReduceOp::kSum);
  return p.work.Wait();
}

void FullyShardedDataParallelImpl::complete_reduce(const internal::PendingReduce& p) {
  c10::NoGradGuard no_grad;
  for (const internal::ReducePart& part : p.parts) {
    FullyShardedDataParallelImpl* u = part.unit;
    FlatParam& fp = u->flats_[part.flat];
    const double post = internal::DivideFactors(u->options_, u->world_).second;
    if (p.in_place_grad) {  // recv is the shard's .grad itself
      if (post != 1.0) p.recv.div_(post);
      continue;
    }
    // A slice of a bucket would keep the whole bucket alive (and optimizers' zero_grad
    // cannot detach a view in place): parts of a bucket are copied out.
    const bool whole = p.parts.size() == 1;
    at::Tensor recv = whole ? p.recv : p.recv.narrow(0, part.offset, fp.shard_numel);
    if (post != 1.0) recv.div_(post);
    if (fp.per_param) {
      internal::AccumulateDim0Grads(fp, recv);
      continue;
    }
    // move_grads_to_cpu: the reduced shard goes to the CPU shard's .grad (a blocking copy).
    at::Tensor& grad = fp.shard.mutable_grad();
    if (grad.defined()) {
      grad.add_(recv.device() == grad.device() ? recv : recv.to(grad.device()));
    } else {
      // A copy: recv views the whole send buffer (the unit's full gradient, or a bucket), which
      // must not stay alive as the shard's gradient.
      grad = recv.to(fp.shard.device(), fp.shard.scalar_type(), /*non_blocking=*/false,
                     /*copy=*/true);
    }
  }
}

}  // namespace fairscale::fsdp
