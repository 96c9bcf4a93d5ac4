// Ring reduce-scatter and all-gather (internal to //comm/algorithms): the large-message halves of
// all_reduce, reduce_scatter and all_gather.
#pragma once

#include "absl/status/status.h"
#include "comm/algorithms/algorithms.h"
#include "comm/algorithms/schedule.h"
#include "comm/types.h"

namespace fairscale::comm::algo {

// Every rank passes `in` with n blocks laid out as `blocks`; rank r receives block r of the
// element-wise reduction of all ranks' `in` into `out` (blocks.length[r] elements). `out` may be
// block r of `in` itself; `in` is never written. Each block's value is computed once, on its
// owner. Scratch: 4 segments.
absl::Status RingReduceScatter(const Context& ctx, const void* in, const Blocks& blocks, void* out,
                               DataType dtype, ReduceOp op);

// On entry rank r holds block r of `buf`; on exit every rank holds every block. Received data
// goes straight into `buf` (no scratch).
absl::Status RingAllGather(const Context& ctx, void* buf, const Blocks& blocks, DataType dtype);

}  // namespace fairscale::comm::algo
