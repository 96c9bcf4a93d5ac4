// Binomial-tree broadcast and reduce (internal to //comm/algorithms).
#pragma once

#include "absl/status/status.h"
#include "comm/algorithms/algorithms.h"
#include "comm/types.h"

namespace fairscale::comm::algo {

// Copies `root`'s buf to every rank's buf.
absl::Status TreeBroadcast(const Context& ctx, void* buf, size_t count, DataType dtype, int root);

// The root gets the element-wise reduction of every rank's `in` in `out` (which may be `in`);
// `out` is unused elsewhere. Scratch: 4 segments.
absl::Status TreeReduce(const Context& ctx, const void* in, void* out, size_t count, DataType dtype,
                        ReduceOp op, int root);

}  // namespace fairscale::comm::algo
