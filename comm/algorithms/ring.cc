// Ring reduce-scatter, column by column.
//
// Step s (0 <= s < n-1) of the classic ring: rank r sends block r-s-1 to r+1 and receives block
// r-s-2 from r-1, adds its own contribution, and forwards the sum at step s+1; after n-1 steps
// block r is complete on rank r. A block is cut into segments of algo.chunk_bytes; "column" j is
// segment j of every block. A column's partial sums travel through scratch slots: a slot holds
// one received segment until it has been reduced and forwarded, so scratch stays at a few
// segments however large the message is (a block-by-block ring would need a block of scratch
// when the output is smaller than the input, as in reduce_scatter).
//
// Two columns advance together, alternating: while one column's segment is being reduced the
// other one's is on the wire, so reduction overlaps communication. Each step keeps at most two
// reduced partials waiting for their forwarding send, plus the receives in flight: four slots.
//
// The all-gather is the usual block ring (step t: send block r-t, receive block r-t-1, straight
// into the output), segmented so a segment is forwarded as soon as it arrives.
#include "comm/algorithms/ring.h"

#include <algorithm>
#include <vector>

namespace fairscale::comm::algo {
namespace {

constexpr int kColumnsInFlight = 2;
constexpr int kRingSlots = 2 * kColumnsInFlight;

// Segment j of a block of `len` elements: [first, first + count), empty past the end.
struct Segment {
  size_t first = 0;
  size_t count = 0;
};
Segment SegmentOf(size_t len, size_t j, size_t seg) {
  const size_t first = std::min(len, j * seg);
  return {first, std::min(len, first + seg) - first};
}

}  // namespace

absl::Status RingReduceScatter(const Context& ctx, const void* in, const Blocks& blocks, void* out,
                               DataType dtype, ReduceOp op) {
  const int n = ctx.transport->size();
  const int r = ctx.transport->rank();
  const size_t es = SizeOf(dtype);
  const size_t seg = SegmentElems(ctx, dtype);
  const char* in_bytes = static_cast<const char*>(in);
  size_t columns = 1;
  for (size_t len : blocks.length) columns = std::max(columns, NumSegments(len, seg));

  Schedule s;
  s.slots = kRingSlots;
  s.slot_bytes = seg * es;
  s.op = op;
  s.dtype = dtype;
  const int steps = n - 1;
  // step_of[j * steps + st]: index of column j's step st, so step st+1 can forward its slot.
  std::vector<int> step_of(columns * steps, -1);
  auto in_at = [&](int block, const Segment& sg) {
    return Loc::At(in_bytes + (blocks.offset[block] + sg.first) * es);
  };
  for (size_t j0 = 0; j0 < columns; j0 += kColumnsInFlight) {
    const size_t j1 = std::min(columns, j0 + kColumnsInFlight);
    for (int st = 0; st < steps; ++st) {
      for (size_t j = j0; j < j1; ++j) {
        const int send_block = Mod(r - st - 1, n);
        const int recv_block = Mod(r - st - 2, n);
        const Segment ss = SegmentOf(blocks.length[send_block], j, seg);
        const Segment rs = SegmentOf(blocks.length[recv_block], j, seg);
        const int k = static_cast<int>(s.steps.size());
        Step step;
        step.send_peer = Mod(r + 1, n);
        step.send_bytes = ss.count * es;
        if (st == 0) {
          step.send_src = in_at(send_block, ss);  // our own contribution starts the chain
        } else {
          const int prev = step_of[j * steps + st - 1];  // received send_block at step st-1
          step.send_src = Loc::SlotOf(prev);
          step.send_after = prev;
        }
        step.recv_peer = Mod(r - 1, n);
        step.recv_bytes = rs.count * es;
        step.recv_dst = Loc::SlotOf(k);
        step.reduce = true;
        step.reduce_a = in_at(recv_block, rs);
        step.reduce_out = st == steps - 1
                              ? Loc::At(static_cast<char*>(out) + rs.first * es)  // block r: final
                              : Loc::SlotOf(k);
        step_of[j * steps + st] = s.Add(step);
      }
    }
  }
  return RunSchedule(s, ctx);
}

absl::Status RingAllGather(const Context& ctx, void* buf, const Blocks& blocks, DataType dtype) {
  const int n = ctx.transport->size();
  const int r = ctx.transport->rank();
  const size_t es = SizeOf(dtype);
  const size_t seg = SegmentElems(ctx, dtype);
  char* bytes = static_cast<char*>(buf);
  auto at = [&](int block, const Segment& sg) {
    return Loc::At(bytes + (blocks.offset[block] + sg.first) * es);
  };

  Schedule s;
  s.dtype = dtype;
  std::vector<int> prev_recv;  // step index per segment of the block received at t-1
  for (int t = 0; t < n - 1; ++t) {
    const int send_block = Mod(r - t, n);  // ours at t = 0, else the block received at t-1
    const int recv_block = Mod(r - t - 1, n);
    const size_t send_segs = NumSegments(blocks.length[send_block], seg);
    const size_t recv_segs = NumSegments(blocks.length[recv_block], seg);
    std::vector<int> this_recv(recv_segs, -1);
    for (size_t j = 0; j < std::max(send_segs, recv_segs); ++j) {
      Step step;
      if (j < send_segs) {
        const Segment ss = SegmentOf(blocks.length[send_block], j, seg);
        step.send_peer = Mod(r + 1, n);
        step.send_bytes = ss.count * es;
        step.send_src = at(send_block, ss);
        if (t > 0) step.send_after = prev_recv[j];
      }
      if (j < recv_segs) {
        const Segment rs = SegmentOf(blocks.length[recv_block], j, seg);
        step.recv_peer = Mod(r - 1, n);
        step.recv_bytes = rs.count * es;
        step.recv_dst = at(recv_block, rs);
      }
      const int k = s.Add(step);
      if (j < recv_segs) this_recv[j] = k;
    }
    prev_recv = std::move(this_recv);
  }
  return RunSchedule(s, ctx);
}

}  // namespace fairscale::comm::algo
