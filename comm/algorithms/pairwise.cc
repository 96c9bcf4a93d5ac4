#include "comm/algorithms/pairwise.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "base/status_macros.h"
#include "comm/algorithms/reduce.h"
#include "comm/algorithms/schedule.h"

namespace fairscale::comm::algo {
namespace {

void Copy(void* dst, const void* src, size_t bytes) {
  if (bytes > 0 && dst != src) std::memcpy(dst, src, bytes);
}

// One step per peer distance i = 1..n-1: send `send_at(to)` to r+i, receive into
// `recv_at(from)` from r-i. Spreading the peers this way keeps every link equally loaded.
template <typename SendAt, typename RecvAt>
Schedule ExchangeWithAll(int rank, int size, size_t bytes, SendAt send_at, RecvAt recv_at) {
  Schedule s;
  for (int i = 1; i < size; ++i) {
    const int to = Mod(rank + i, size);
    const int from = Mod(rank - i, size);
    Step step;
    step.send_peer = to;
    step.send_bytes = bytes;
    step.send_src = Loc::At(send_at(to));
    step.recv_peer = from;
    step.recv_bytes = bytes;
    step.recv_dst = Loc::At(recv_at(from));
    s.Add(step);
  }
  return s;
}

// out = parts[0] (op) parts[1] (op) ... in rank order: the same arithmetic on every rank.
void ReduceInRankOrder(ReduceOp op, DataType dtype, void* out,
                       const std::vector<const char*>& parts, size_t count) {
  ReduceTo(op, dtype, out, parts[0], parts[1], count);
  for (size_t k = 2; k < parts.size(); ++k) ReduceTo(op, dtype, out, out, parts[k], count);
}

// Sends the blocks `parts(p)` (block p goes to rank p), collects every rank's block `rank` and
// reduces them in rank order into `out`. `own` is this rank's contribution, which may alias out.
template <typename PartOf>
absl::Status ExchangeAndReduce(const Context& ctx, PartOf part_for, const void* own, void* out,
                               size_t count, DataType dtype, ReduceOp op) {
  const int n = ctx.transport->size();
  const int r = ctx.transport->rank();
  const size_t bytes = count * SizeOf(dtype);
  char* scratch = ctx.scratch->Get(static_cast<size_t>(n) * bytes);
  std::vector<const char*> parts(n);
  for (int p = 0; p < n; ++p) parts[p] = scratch + p * bytes;
  if (own == out) {
    Copy(scratch + r * bytes, own, bytes);  // out is overwritten before rank r's turn
  } else {
    parts[r] = static_cast<const char*>(own);
  }
  Schedule s = ExchangeWithAll(r, n, bytes, part_for,
                               [&](int from) { return const_cast<char*>(parts[from]); });
  FS_RETURN_IF_ERROR(RunSchedule(s, ctx));
  ReduceInRankOrder(op, dtype, out, parts, count);
  return absl::OkStatus();
}

// A segmented stream of one buffer to (or from) one peer.
Schedule Stream(const Context& ctx, const void* data, size_t count, DataType dtype, int peer,
                bool send) {
  const size_t es = SizeOf(dtype);
  const size_t seg = SegmentElems(ctx, dtype);
  Schedule s;
  for (size_t j = 0; j < NumSegments(count, seg); ++j) {
    const size_t first = std::min(count, j * seg);
    const size_t len = std::min(count, first + seg) - first;
    const Loc at = Loc::At(static_cast<const char*>(data) + first * es);
    Step step;
    if (send) {
      step.send_peer = peer;
      step.send_bytes = len * es;
      step.send_src = at;
    } else {
      step.recv_peer = peer;
      step.recv_bytes = len * es;
      step.recv_dst = at;
    }
    s.Add(step);
  }
  return s;
}

}  // namespace

absl::Status DirectAllReduce(const Context& ctx, const void* in, void* out, size_t count,
                             DataType dtype, ReduceOp op) {
  return ExchangeAndReduce(
      ctx, [in](int) { return in; }, in, out, count, dtype, op);
}

absl::Status DirectReduceScatter(const Context& ctx, const void* in, void* out, size_t block_count,
                                 DataType dtype, ReduceOp op) {
  const size_t bytes = block_count * SizeOf(dtype);
  const char* blocks = static_cast<const char*>(in);
  const void* own = blocks + ctx.transport->rank() * bytes;
  return ExchangeAndReduce(
      ctx, [blocks, bytes](int to) { return blocks + to * bytes; }, own, out, block_count, dtype,
      op);
}

absl::Status DirectAllGather(const Context& ctx, const void* in, void* out, size_t block_count,
                             DataType dtype) {
  const int r = ctx.transport->rank();
  const size_t bytes = block_count * SizeOf(dtype);
  char* blocks = static_cast<char*>(out);
  Copy(blocks + r * bytes, in, bytes);
  Schedule s = ExchangeWithAll(
      r, ctx.transport->size(), bytes, [in](int) { return in; },
      [blocks, bytes](int from) { return blocks + from * bytes; });
  return RunSchedule(s, ctx);
}

absl::Status PairwiseAllToAll(const Context& ctx, const void* in, void* out, size_t block_count,
                              DataType dtype) {
  const int n = ctx.transport->size();
  const int r = ctx.transport->rank();
  const size_t es = SizeOf(dtype);
  const size_t bytes = block_count * es;
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  Copy(dst + r * bytes, src + r * bytes, bytes);
  const size_t seg = SegmentElems(ctx, dtype);
  Schedule s;
  for (int i = 1; i < n; ++i) {
    const int to = Mod(r + i, n);
    const int from = Mod(r - i, n);
    for (size_t j = 0; j < NumSegments(block_count, seg); ++j) {
      const size_t first = std::min(block_count, j * seg);
      const size_t len = std::min(block_count, first + seg) - first;
      Step step;
      step.send_peer = to;
      step.send_bytes = len * es;
      step.send_src = Loc::At(src + to * bytes + first * es);
      step.recv_peer = from;
      step.recv_bytes = len * es;
      step.recv_dst = Loc::At(dst + from * bytes + first * es);
      s.Add(step);
    }
  }
  return RunSchedule(s, ctx);
}

absl::Status SendTo(const Context& ctx, const void* data, size_t count, DataType dtype, int peer) {
  return RunSchedule(Stream(ctx, data, count, dtype, peer, /*send=*/true), ctx);
}

absl::Status RecvFrom(const Context& ctx, void* data, size_t count, DataType dtype, int peer) {
  return RunSchedule(Stream(ctx, data, count, dtype, peer, /*send=*/false), ctx);
}

absl::Status BatchedSendRecv(const Context& ctx, const std::vector<P2PItem>& items) {
  // Segment every item exactly as a plain Send/Recv would (so a batch on one side matches plain
  // calls on the other), then pair the k-th send segment with the k-th receive segment in one
  // step: every send is posted at once and receives stay posted ahead, so no two ranks can wait
  // on each other's sends.
  struct Segment {
    int peer;
    uint64_t tag;
    char* ptr;
    size_t bytes;
  };
  std::vector<Segment> sends, recvs;
  for (const P2PItem& item : items) {
    const Buffer& b = item.op.buffer;
    const size_t es = SizeOf(b.dtype);
    const size_t seg = SegmentElems(ctx, b.dtype);
    const uint64_t tag = MakeTag(OpType::kSend, item.seq, MakeSignature(&b.dtype));
    for (size_t j = 0; j < NumSegments(b.count, seg); ++j) {
      const size_t first = std::min(b.count, j * seg);
      const size_t len = std::min(b.count, first + seg) - first;
      (item.op.is_send ? sends : recvs)
          .push_back({item.op.peer, tag, static_cast<char*>(b.data) + first * es, len * es});
    }
  }
  Schedule s;
  for (size_t k = 0; k < std::max(sends.size(), recvs.size()); ++k) {
    Step step;
    if (k < sends.size()) {
      step.send_peer = sends[k].peer;
      step.send_bytes = sends[k].bytes;
      step.send_src = Loc::At(sends[k].ptr);
    }
    if (k < recvs.size()) {
      step.recv_peer = recvs[k].peer;
      step.recv_bytes = recvs[k].bytes;
      step.recv_dst = Loc::At(recvs[k].ptr);
    }
    // One tag per step: split the pair when the send and the receive carry different tags.
    if (k < sends.size() && k < recvs.size() && sends[k].tag != recvs[k].tag) {
      Step recv_only = step;
      recv_only.send_peer = -1;
      recv_only.tag = recvs[k].tag;
      step.recv_peer = -1;
      step.tag = sends[k].tag;
      s.Add(step);
      s.Add(recv_only);
      continue;
    }
    step.tag = k < sends.size() ? sends[k].tag : recvs[k].tag;
    s.Add(step);
  }
  return RunSchedule(s, ctx);
}

absl::Status DisseminationBarrier(const Context& ctx) {
  const int n = ctx.transport->size();
  const int r = ctx.transport->rank();
  Schedule s;
  int previous = -1;
  for (int dist = 1; dist < n; dist <<= 1) {
    Step step;
    step.send_peer = Mod(r + dist, n);
    step.send_after = previous;  // what makes it a barrier: forward only what we have heard
    step.recv_peer = Mod(r - dist, n);
    previous = s.Add(step);
  }
  return RunSchedule(s, ctx);
}

}  // namespace fairscale::comm::algo
