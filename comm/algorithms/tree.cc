// Binomial trees, rooted at `root`, over ranks renumbered v = (rank - root) mod n.
//
// The parent of v is v with its lowest set bit cleared; the children of v are v + 2^k for every
// 2^k below that bit (below n for the root). Messages are cut into algo.chunk_bytes segments and
// every segment flows through the tree on its own, so a deep tree streams instead of
// store-and-forwarding whole messages: broadcast forwards segment j as soon as it arrives, reduce
// sends segment j up as soon as every child's segment j has been added.
#include "comm/algorithms/tree.h"

#include <algorithm>
#include <vector>

#include "comm/algorithms/schedule.h"

namespace fairscale::comm::algo {
namespace {

constexpr int kTreeSlots = 4;

struct TreeNode {
  int parent = -1;            // absolute rank; -1 at the root
  std::vector<int> children;  // absolute ranks, largest subtree first
};

TreeNode BinomialNode(int rank, int size, int root) {
  const int v = Mod(rank - root, size);
  TreeNode node;
  int low = 1;  // lowest set bit of v (or the first power of two >= size for the root)
  while (low < size && (v & low) == 0) low <<= 1;
  if (v != 0) node.parent = Mod(v - low + root, size);
  for (int mask = low >> 1; mask > 0; mask >>= 1) {
    if (v + mask < size) node.children.push_back(Mod(v + mask + root, size));
  }
  return node;
}

}  // namespace

absl::Status TreeBroadcast(const Context& ctx, void* buf, size_t count, DataType dtype, int root) {
  const TreeNode node = BinomialNode(ctx.transport->rank(), ctx.transport->size(), root);
  const size_t es = SizeOf(dtype);
  const size_t seg = SegmentElems(ctx, dtype);
  char* bytes = static_cast<char*>(buf);
  Schedule s;
  s.dtype = dtype;
  for (size_t j = 0; j < NumSegments(count, seg); ++j) {
    const size_t first = j * seg;
    const size_t len = std::min(count, first + seg) - std::min(count, first);
    const Loc at = Loc::At(bytes + first * es);
    int received = -1;
    if (node.parent >= 0) {
      Step step;
      step.recv_peer = node.parent;
      step.recv_bytes = len * es;
      step.recv_dst = at;
      received = s.Add(step);
    }
    // Largest subtree first: it has the longest way to go.
    for (int child : node.children) {
      Step step;
      step.send_peer = child;
      step.send_bytes = len * es;
      step.send_src = at;
      step.send_after = received;
      s.Add(step);
    }
  }
  return RunSchedule(s, ctx);
}

absl::Status TreeReduce(const Context& ctx, const void* in, void* out, size_t count, DataType dtype,
                        ReduceOp op, int root) {
  TreeNode node = BinomialNode(ctx.transport->rank(), ctx.transport->size(), root);
  // Smallest subtree first: its partial sum is ready earliest.
  std::reverse(node.children.begin(), node.children.end());
  const size_t es = SizeOf(dtype);
  const size_t seg = SegmentElems(ctx, dtype);
  const bool is_root = node.parent < 0;
  Schedule s;
  s.slots = kTreeSlots;
  s.slot_bytes = seg * es;
  s.op = op;
  s.dtype = dtype;
  for (size_t j = 0; j < NumSegments(count, seg); ++j) {
    const size_t first = j * seg;
    const size_t len = std::min(count, first + seg) - std::min(count, first);
    const Loc mine = Loc::At(static_cast<const char*>(in) + first * es);
    if (node.children.empty()) {  // a leaf sends its own data
      Step step;
      step.send_peer = node.parent;
      step.send_bytes = len * es;
      step.send_src = mine;
      s.Add(step);
      continue;
    }
    // The partial sum of this segment accumulates in the output on the root, else in the slot
    // of the first child's receive (freed once it has been sent up).
    int acc_step = -1;
    int last = -1;
    for (size_t i = 0; i < node.children.size(); ++i) {
      const int k = static_cast<int>(s.steps.size());
      const Loc acc = is_root ? Loc::At(static_cast<char*>(out) + first * es)
                              : Loc::SlotOf(i == 0 ? k : acc_step);
      Step step;
      step.recv_peer = node.children[i];
      step.recv_bytes = len * es;
      step.recv_dst = Loc::SlotOf(k);
      step.reduce = true;
      step.reduce_out = acc;
      step.reduce_a = i == 0 ? mine : acc;
      last = s.Add(step);
      if (i == 0) acc_step = k;
    }
    if (!is_root) {
      Step step;
      step.send_peer = node.parent;
      step.send_bytes = len * es;
      step.send_src = Loc::SlotOf(acc_step);
      step.send_after = last;
      s.Add(step);
    }
  }
  return RunSchedule(s, ctx);
}

}  // namespace fairscale::comm::algo
