// The canonical micro-batch tree of deterministic mode (//deterministic): sums over a step's
// micro-batches whose bits do not depend on how many ranks computed them.
//
// A step's global batch is cut into `micro_batches` micro-batches of a fixed size, numbered
// 0..M-1; rank r of W computes the contiguous block [r * M/W, (r+1) * M/W) (MicroBatchLayout).
// The sum of a per-micro-batch quantity (a gradient, a loss) is defined by one binary tree over
// the micro-batch index, whatever W is:
//   * a node is a dyadic interval [begin, begin + size): size a power of two, begin a multiple
//     of size; its value is value(left half) + value(right half), a leaf is the micro-batch's
//     own value;
//   * the total over [0, M) folds the maximal dyadic intervals of [0, M) (M's binary digits,
//     largest first) from left to right: ((B0 + B1) + B2) + ...
// Every dyadic interval inside [0, M) is a node of that tree, so a rank sums the maximal
// dyadic intervals of its own block locally (Accumulator, at most log2(M/W) + 1 partial sums),
// and whoever holds partial sums of adjacent siblings adds them (Merge): any grouping of the
// work gives the same node values, because each node is always computed as the same addition
// of the same two operands. Elementwise addition of tensors is exact per element in IEEE
// arithmetic (a + b rounds once, and a + b == b + a), so a sum over the tree is bitwise
// reproducible on any world size that divides M.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fairscale::deterministic {

// A node of the canonical tree: the micro-batches [begin, begin + size).
struct Node {
  int64_t begin = 0;
  int64_t size = 1;
  int64_t end() const { return begin + size; }
  bool operator==(const Node& other) const {
    return begin == other.begin && size == other.size;
  }
  bool operator!=(const Node& other) const { return !(*this == other); }
};

std::string NodeName(const Node& node);  // "[4, 8)"

// Whether `node` is dyadic (a node of the canonical tree).
bool IsDyadic(const Node& node);
// Whether `left` and `right` are the two halves of one node, left first.
bool AreSiblings(const Node& left, const Node& right);
// The maximal dyadic intervals covering [begin, end), left to right (empty when begin == end).
std::vector<Node> Decompose(int64_t begin, int64_t end);
// The nodes that the partial sums over `nodes` become once every pair of siblings is added
// (Merge without values), sorted by begin. Raises c10::Error if two nodes overlap.
std::vector<Node> MergeNodes(std::vector<Node> nodes);

// Which micro-batches of a step a rank computes. Raises c10::Error (from Make) unless
// `micro_batches` >= 1 and `world` divides it, saying which world sizes would.
struct MicroBatchLayout {
  int64_t micro_batches = 1;
  int world = 1;
  int rank = 0;

  static MicroBatchLayout Make(int64_t micro_batches, int world, int rank);
  int64_t per_rank() const { return micro_batches / world; }
  int64_t first_of(int r) const { return r * per_rank(); }
  int64_t first() const { return first_of(rank); }
  // The nodes rank `r`'s Accumulator ends a step with: Decompose of its block.
  std::vector<Node> nodes_of(int r) const { return Decompose(first_of(r), first_of(r) + per_rank()); }
  std::vector<std::vector<Node>> nodes_by_rank() const;
};

// A partial sum: the value of one node.
struct Partial {
  Node node;
  at::Tensor value;
};

// Adds every pair of sibling partials (left.value += right.value, in place on the left one's
// tensor) until none are left; returns them sorted by begin. Values must be distinct tensors of
// one shape and dtype. Raises c10::Error if two nodes overlap.
std::vector<Partial> Merge(std::vector<Partial> parts);

// The canonical total over [0, n) of `parts`, which must cover [0, n) exactly (raises
// c10::Error naming the first micro-batch missing or doubled otherwise). Writes into the value
// of the leftmost partial and returns it.
at::Tensor Total(std::vector<Partial> parts, int64_t n);

// The canonical total of n scalars (losses): values[i] is micro-batch i's.
double TotalOf(const std::vector<double>& values);

// Sums one rank's per-micro-batch values as they arrive, keeping the partial sums of the
// maximal dyadic intervals complete so far: arriving in micro-batch order (or in reverse, as a
// GPipe backward does) at most log2(count) + 1 tensors stay alive (a cascade).
class Accumulator {
 public:
  // `value` is micro-batch `index`'s; the accumulator keeps it (and may add into it in place).
  // Indices may come in any order; one that is already in raises c10::Error.
  void Add(int64_t index, at::Tensor value);
  // The partial sums so far, sorted by begin (for the micro-batches [a, b), all present:
  // Decompose(a, b)); the accumulator is empty afterwards.
  std::vector<Partial> Take();
  bool empty() const { return parts_.empty(); }
  // The micro-batches added since the last Take.
  int64_t count() const { return count_; }
  // The partial sums held now.
  const std::vector<Partial>& partials() const { return parts_; }

 private:
  std::vector<Partial> parts_;  // sorted by begin, no siblings
  int64_t count_ = 0;
};

}  // namespace fairscale::deterministic
