#include "fsdp/internal/collectives.h"

#include <ATen/ops/cat.h>
#include <c10/core/GradMode.h>

#include <algorithm>

#include "fsdp/internal/unit.h"

namespace fairscale::fsdp::internal {
namespace {

size_t MaxInFlight(const Unit& unit) {
  return static_cast<size_t>(std::max(1, unit.options().reductions_in_flight()));
}

}  // namespace

void ReductionQueue::Submit(Unit& unit, size_t flat, at::Tensor send, bool in_place) {
  if (!send.defined()) return;
  c10::NoGradGuard no_grad;
  const UnitGroups& g = unit.groups();
  const FlatParam& fp = unit.flats()[flat];
  const std::string context = unit.label() + ": gradient reduction";
  PendingReduce p{{{&unit, flat, 0}}, comm::Work(), send, at::Tensor()};
  if (in_place) {
    p.recv = send;
    p.in_place_grad = true;
    comm::Buffer b = Buf(send, context);
    p.work = g.world->AllReduce(b, b, comm::ReduceOp::kSum);
  } else {
    const int64_t bytes = send.numel() * static_cast<int64_t>(send.element_size());
    const double cap = unit.options().bucket_cap_mb() * 1024 * 1024;
    if (unit.sharded() && cap > 0 && bytes <= cap) {
      if (!bucket_.sends.empty()) {
        const UnitGroups& owner = bucket_.parts.front().unit->groups();
        if (bucket_.sends.front().scalar_type() != send.scalar_type() ||
            bucket_.bytes + bytes > cap || owner.shard != g.shard ||
            owner.replicate != g.replicate) {
          Flush(MaxInFlight(unit));
        }
      }
      bucket_.parts.push_back({&unit, flat, bucket_.numel});
      bucket_.sends.push_back(send);
      bucket_.bytes += bytes;
      bucket_.numel += fp.shard_numel;
      return;
    }
    if (g.world_size == 1) {  // mixed precision at world size 1: nothing to reduce
      p.recv = send;
      Complete(p);
      return;
    }
    if (unit.sharded()) {
      // In place: this rank's block of the send buffer, no separate receive buffer.
      p.recv = send.narrow(0, fp.shard_offset, fp.shard_numel);
      p.work = g.shard->ReduceScatter(Buf(send, context), Buf(p.recv, context),
                                      comm::ReduceOp::kSum);
      p.replicate = g.replicate;
    } else {
      p.recv = send;
      comm::Buffer b = Buf(send, context);
      p.work = g.world->AllReduce(b, b, comm::ReduceOp::kSum);
    }
  }
  pending_.push_back(std::move(p));
  Drain(MaxInFlight(unit));
}

void ReductionQueue::Flush(size_t max_in_flight) {
  if (bucket_.sends.empty()) return;
  // The groups of the bucket's units (the caller may be the root, at the end of backward).
  const Unit* owner = bucket_.parts.front().unit;
  const UnitGroups& g = owner->groups();
  // Reduce-scatter gives rank r the r-th contiguous chunk of the input, so the bucket is laid out
  // rank-major: [rank 0: shard of part 0, shard of part 1, ...][rank 1: ...]...
  std::vector<at::Tensor> rows;
  for (const at::Tensor& send : bucket_.sends) rows.push_back(send.view({g.shard_size, -1}));
  c10::NoGradGuard no_grad;
  PendingReduce p{std::move(bucket_.parts), comm::Work(), at::cat(rows, 1).reshape({-1}),
                  at::Tensor()};
  p.recv = p.send.narrow(0, g.shard_rank * bucket_.numel, bucket_.numel);  // in place
  const std::string context = owner->label() + ": bucketed gradient reduction";
  p.work = g.shard->ReduceScatter(Buf(p.send, context), Buf(p.recv, context),
                                  comm::ReduceOp::kSum);
  p.replicate = g.replicate;
  pending_.push_back(std::move(p));
  bucket_ = GradBucket();
  Drain(max_in_flight);
}

void ReductionQueue::Drain(size_t keep) {
  while (pending_.size() > keep) {
    if (!Wait(pending_.front()).ok()) return;
    Complete(pending_.front());
    pending_.erase(pending_.begin());
  }
}

void ReductionQueue::WaitAll() {
  c10::NoGradGuard no_grad;
  for (PendingReduce& p : pending_) {
    base::ThrowIfError(Wait(p), p.parts.front().unit->label() + ": gradient reduction");
    Complete(p);
  }
  pending_.clear();
}

void ReductionQueue::WaitIgnoringErrors() {
  for (PendingReduce& p : pending_) p.work.Wait().IgnoreError();
}

void ReductionQueue::Clear() {
  pending_.clear();
  bucket_ = GradBucket();
}

absl::Status ReductionQueue::Wait(PendingReduce& p) {
  absl::Status status = p.work.Wait();
  if (!status.ok() || p.replicate == nullptr) return status;
  // HYBRID_SHARD: the shard group's sum, summed over the groups. Issued here, once the
  // reduce-scatter is known done, in the same order on every rank (the order of the waits).
  const std::shared_ptr<comm::Communicator> replicate = std::move(p.replicate);
  p.replicate = nullptr;
  const std::string context = p.parts.front().unit->label() + ": all_reduce across shard groups";
  comm::Buffer b = Buf(p.recv, context);
  p.work = replicate->AllReduce(b, b, comm::ReduceOp::kSum);
  return p.work.Wait();
}

void ReductionQueue::Complete(const PendingReduce& p) {
  // A slice of a bucket would keep the whole bucket alive (and optimizers' zero_grad cannot
  // detach a view in place): parts of a bucket are narrowed here and copied by AddReduced.
  const bool whole = p.parts.size() == 1;
  for (const ReducePart& part : p.parts) {
    const int64_t numel = part.unit->flats()[part.flat].shard_numel;
    part.unit->AddReduced(part.flat, whole ? p.recv : p.recv.narrow(0, part.offset, numel),
                          p.in_place_grad);
  }
}

}  // namespace fairscale::fsdp::internal
