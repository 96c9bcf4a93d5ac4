// Collectives of deterministic mode (//deterministic): reductions over the canonical
// micro-batch tree (tree.h) whose result does not depend on the number of ranks or on the
// order in which peers' data arrive, and an exact sum of squares for gradient norms.
//
// A reduction here moves partial sums (tree nodes), never adds across ranks in arrival order:
// each rank sends the partials of its own micro-batches; the receiver adds siblings in the
// tree's order (Merge). With one partial per rank (W and M/W powers of two) a ReduceScatter
// sends exactly what a ring reduce-scatter sends ((W-1)/W of the buffer per rank), as one
// all-to-all; with several (other world sizes) it sends each of them.
//
// Users: fsdp (gradient reduce-scatter / all-reduce, HYBRID_SHARD's two levels), oss and
// ShardedDataParallel (reduce to the owning rank), pipe (across data-parallel replicas), and
// the main job (the step loss). All functions are collective over `comm` (every rank calls
// them with the same node structure), block until done, and raise c10::Error prefixed with
// `what` (naming the rank and the operation) on a failed or timed-out operation or bad input.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "deterministic/tree.h"

namespace fairscale::deterministic {

// `mine` is consumed: its values may be sent as they are or added into in place.
//
// Every rank holds partials `mine` with nodes nodes_of[comm.rank()] (in that order), each value
// a contiguous 1-D tensor of comm.size() * shard elements (one dtype and device on every
// rank). Returns this rank's block [rank * shard, (rank + 1) * shard) of every rank's
// partials, merged (sorted by begin). nodes_of[r] is rank r's node list (equal on every rank).
std::vector<Partial> ReduceScatter(comm::Communicator& comm, std::vector<Partial> mine,
                                   const std::vector<std::vector<Node>>& nodes_of,
                                   const std::string& what);

// Every rank gets every rank's partials (values of equal numel), merged.
std::vector<Partial> AllGather(comm::Communicator& comm, std::vector<Partial> mine,
                               const std::vector<std::vector<Node>>& nodes_of,
                               const std::string& what);

// `root` gets every rank's partials, merged; the other ranks get an empty vector.
std::vector<Partial> Gather(comm::Communicator& comm, int root, std::vector<Partial> mine,
                            const std::vector<std::vector<Node>>& nodes_of,
                            const std::string& what);

// The canonical sum of each rank's partials, on every rank (ReduceScatter over a zero-padded
// copy, Total, AllGather): `mine`'s values have any equal numel; the result has that numel.
// The partials of all ranks together must cover [0, micro_batches).
at::Tensor AllReduce(comm::Communicator& comm, std::vector<Partial> mine,
                     const std::vector<std::vector<Node>>& nodes_of, int64_t micro_batches,
                     const std::string& what);

// The mean over a step's micro-batches of per-micro-batch scalars (losses): `mine` holds this
// rank's, in micro-batch order (layout.per_rank() of them). The canonical tree of the M values
// divided by M, equal on every rank and on every world size.
double Mean(comm::Communicator& comm, const MicroBatchLayout& layout,
            const std::vector<double>& mine, const std::string& what);

// An exact sum of squares, for gradient norms in deterministic mode: each element's square
// (computed in double) is added into a fixed-point integer accumulator that spans every double,
// so the sum is exact and does not depend on the order of the elements, on how they are split
// among tensors or ranks, or on the thread count; AllReduce adds the accumulators of a group
// (an integer sum). value() rounds it to a double deterministically. NaN and infinity are
// counted apart and make value() NaN / infinity, as a plain sum would.
class ExactSquareSum {
 public:
  // Adds the squares of the elements of `t` (a floating tensor on any device; copied to the CPU
  // in chunks when it is elsewhere).
  void Add(const at::Tensor& t);
  // Replaces this rank's accumulator by the sum over every rank of `comm`.
  void AllReduce(comm::Communicator& comm, const std::string& what);
  double value() const;
  // sqrt(value()).
  double norm() const;

  // Limbs of 32 bits (held in int64 with headroom for carries), lowest first, spanning from
  // 2^-1128 (below the least double's square mantissa) to above the largest double.
  static constexpr int kLimbs = 72;
  static constexpr int kLowestExponent = -1128;

 private:
  void AddDouble(double s);
  void Normalize();
  std::array<int64_t, kLimbs> limbs_{};
  int64_t nan_ = 0;
  int64_t inf_ = 0;
  int64_t pending_ = 0;  // additions since the last Normalize
};

}  // namespace fairscale::deterministic
