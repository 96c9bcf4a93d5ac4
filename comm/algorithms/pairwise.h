// Algorithms in which every message goes straight from its source to its destination (internal
// to //comm/algorithms): the small-message direct exchanges, all_to_all, send/recv and the
// barrier.
#pragma once

#include <vector>

#include "absl/status/status.h"
#include "comm/algorithms/algorithms.h"
#include "comm/types.h"

namespace fairscale::comm::algo {

// Every rank sends its whole input to every other rank and reduces the n inputs locally in rank
// order 0..n-1, so all ranks get bit-identical results. `out` may equal `in`. Scratch: n inputs.
absl::Status DirectAllReduce(const Context& ctx, const void* in, void* out, size_t count,
                             DataType dtype, ReduceOp op);

// Rank p gets block p of every input and reduces them in rank order. `out` may be block r of
// `in`. Scratch: n blocks.
absl::Status DirectReduceScatter(const Context& ctx, const void* in, void* out, size_t block_count,
                                 DataType dtype, ReduceOp op);

// Every rank sends its block to every other rank, received straight into `out`. `in` may be
// block r of `out`.
absl::Status DirectAllGather(const Context& ctx, const void* in, void* out, size_t block_count,
                             DataType dtype);

// Step i (1 <= i < n): send block r+i to rank r+i, receive block r-i from rank r-i; the own
// block is copied locally. Blocks are segmented.
absl::Status PairwiseAllToAll(const Context& ctx, const void* in, void* out, size_t block_count,
                              DataType dtype);

// One segmented message stream to / from `peer`.
absl::Status SendTo(const Context& ctx, const void* data, size_t count, DataType dtype, int peer);
absl::Status RecvFrom(const Context& ctx, void* data, size_t count, DataType dtype, int peer);

// Dissemination barrier: in round k a zero-byte message goes to rank r + 2^k once the message of
// round k-1 has arrived; after ceil(log2 n) rounds every rank has heard from every rank.
absl::Status DisseminationBarrier(const Context& ctx);
absl::Status BatchedSendRecv(const Context& ctx, const std::vector<P2PItem>& items);

}  // namespace fairscale::comm::algo
