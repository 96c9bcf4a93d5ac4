#include "deterministic/tree.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fairscale::deterministic {
namespace {

bool IsPowerOfTwo(int64_t n) { return n > 0 && (n & (n - 1)) == 0; }

void CheckNoOverlap(const Node& prev, const Node& next) {
  TORCH_CHECK(prev.end() <= next.begin, "deterministic: partial sums ", NodeName(prev), " and ",
              NodeName(next), " overlap (a micro-batch counted twice)");
}

}  // namespace

std::string NodeName(const Node& node) {
  return absl::StrCat("[", node.begin, ", ", node.end(), ")");
}

bool IsDyadic(const Node& node) {
  return node.begin >= 0 && IsPowerOfTwo(node.size) && node.begin % node.size == 0;
}

bool AreSiblings(const Node& left, const Node& right) {
  return left.size == right.size && left.end() == right.begin && IsDyadic(left) &&
         left.begin % (2 * left.size) == 0;
}

std::vector<Node> Decompose(int64_t begin, int64_t end) {
  TORCH_CHECK(0 <= begin && begin <= end, "deterministic: bad micro-batch range [", begin, ", ",
              end, ")");
  std::vector<Node> out;
  while (begin < end) {
    int64_t size = 1;
    while ((begin % (2 * size)) == 0 && begin + 2 * size <= end) size *= 2;
    out.push_back({begin, size});
    begin += size;
  }
  return out;
}

std::vector<Node> MergeNodes(std::vector<Node> nodes) {
  std::sort(nodes.begin(), nodes.end(),
            [](const Node& a, const Node& b) { return a.begin < b.begin; });
  std::vector<Node> stack;
  for (const Node& n : nodes) {
    TORCH_CHECK(IsDyadic(n), "deterministic: ", NodeName(n), " is not a node of the tree");
    if (!stack.empty()) CheckNoOverlap(stack.back(), n);
    stack.push_back(n);
    while (stack.size() >= 2 && AreSiblings(stack[stack.size() - 2], stack.back())) {
      stack.pop_back();
      stack.back().size *= 2;
    }
  }
  return stack;
}

MicroBatchLayout MicroBatchLayout::Make(int64_t micro_batches, int world, int rank) {
  TORCH_CHECK(micro_batches >= 1, "deterministic mode: the number of micro-batches per step must "
              "be at least 1, got ", micro_batches);
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "deterministic mode: bad rank ", rank,
              " of ", world);
  if (micro_batches % world != 0) {
    std::vector<int64_t> ok;
    for (int64_t w = 1; w <= micro_batches && ok.size() < 16; ++w) {
      if (micro_batches % w == 0) ok.push_back(w);
    }
    TORCH_CHECK(false, "deterministic mode: ", micro_batches,
                " micro-batches per step cannot be split evenly over ", world,
                " ranks (each rank computes the same number of whole micro-batches); world "
                "sizes that divide it: ",
                absl::StrJoin(ok, ", "), ", or change the micro-batch count");
  }
  MicroBatchLayout layout;
  layout.micro_batches = micro_batches;
  layout.world = world;
  layout.rank = rank;
  return layout;
}

std::vector<std::vector<Node>> MicroBatchLayout::nodes_by_rank() const {
  std::vector<std::vector<Node>> out;
  out.reserve(world);
  for (int r = 0; r < world; ++r) out.push_back(nodes_of(r));
  return out;
}

std::vector<Partial> Merge(std::vector<Partial> parts) {
  std::stable_sort(parts.begin(), parts.end(), [](const Partial& a, const Partial& b) {
    return a.node.begin < b.node.begin;
  });
  std::vector<Partial> stack;
  stack.reserve(parts.size());
  for (Partial& p : parts) {
    TORCH_CHECK(IsDyadic(p.node), "deterministic: ", NodeName(p.node),
                " is not a node of the tree");
    if (!stack.empty()) CheckNoOverlap(stack.back().node, p.node);
    stack.push_back(std::move(p));
    while (stack.size() >= 2 && AreSiblings(stack[stack.size() - 2].node, stack.back().node)) {
      Partial right = std::move(stack.back());
      stack.pop_back();
      Partial& left = stack.back();
      left.value.add_(right.value);
      left.node.size *= 2;
    }
  }
  return stack;
}

at::Tensor Total(std::vector<Partial> parts, int64_t n) {
  std::vector<Partial> merged = Merge(std::move(parts));
  // Merged partials that cover [0, n) without a gap are exactly Decompose(0, n).
  int64_t covered = 0;
  for (const Partial& p : merged) {
    TORCH_CHECK(p.node.begin == covered, "deterministic: the partial sums do not cover "
                "micro-batches [0, ", n, "): missing ", covered, " (next partial ",
                NodeName(p.node), ")");
    covered = p.node.end();
  }
  TORCH_CHECK(covered == n, "deterministic: the partial sums do not cover micro-batches [0, ", n,
              ") exactly: ", covered < n ? "missing " : "they reach ", covered);
  TORCH_CHECK(!merged.empty(), "deterministic: nothing to sum");
  at::Tensor total = std::move(merged[0].value);
  for (size_t i = 1; i < merged.size(); ++i) total.add_(merged[i].value);
  return total;
}

double TotalOf(const std::vector<double>& values) {
  TORCH_CHECK(!values.empty(), "deterministic: nothing to sum");
  // The same tree as Total, on scalars: a stack of (node, value).
  std::vector<std::pair<Node, double>> stack;
  for (size_t i = 0; i < values.size(); ++i) {
    stack.push_back({Node{static_cast<int64_t>(i), 1}, values[i]});
    while (stack.size() >= 2 && AreSiblings(stack[stack.size() - 2].first, stack.back().first)) {
      const double right = stack.back().second;
      stack.pop_back();
      stack.back().second += right;
      stack.back().first.size *= 2;
    }
  }
  double total = stack[0].second;
  for (size_t i = 1; i < stack.size(); ++i) total += stack[i].second;
  return total;
}

void Accumulator::Add(int64_t index, at::Tensor value) {
  TORCH_CHECK(index >= 0, "deterministic: negative micro-batch index ", index);
  auto pos = std::lower_bound(parts_.begin(), parts_.end(), index,
                              [](const Partial& p, int64_t i) { return p.node.end() <= i; });
  TORCH_CHECK(pos == parts_.end() || pos->node.begin > index, "deterministic: micro-batch ",
              index, " was already added (in ", NodeName(pos->node), ")");
  size_t at = static_cast<size_t>(pos - parts_.begin());
  parts_.insert(pos, Partial{Node{index, 1}, std::move(value)});
  ++count_;
  // Add siblings around the new node until it has none.
  while (true) {
    if (at > 0 && AreSiblings(parts_[at - 1].node, parts_[at].node)) {
      parts_[at - 1].value.add_(parts_[at].value);
      parts_[at - 1].node.size *= 2;
      parts_.erase(parts_.begin() + static_cast<std::ptrdiff_t>(at));
      --at;
    } else if (at + 1 < parts_.size() && AreSiblings(parts_[at].node, parts_[at + 1].node)) {
      parts_[at].value.add_(parts_[at + 1].value);
      parts_[at].node.size *= 2;
      parts_.erase(parts_.begin() + static_cast<std::ptrdiff_t>(at) + 1);
    } else {
      break;
    }
  }
}

std::vector<Partial> Accumulator::Take() {
  std::vector<Partial> out = std::move(parts_);
  parts_.clear();
  count_ = 0;
  return out;
}

}  // namespace fairscale::deterministic
