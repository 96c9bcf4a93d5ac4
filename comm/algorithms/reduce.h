// Element-wise reduction kernels (//comm/algorithms:reduce), used wherever a backend reduces on
// the CPU: the ring, tree and direct algorithms of this package (so tcp, ucx and inproc), and any
// other backend that needs a host-side reduction with the same semantics.
//
// Semantics per ReduceOp (the same on every rank, so results are reproducible):
//   sum, avg   a + b (avg divides once at the end, see DivideBy); integers wrap around
//   product    a * b; integers wrap around
//   min, max   the smaller / larger value; a NaN in either operand gives a NaN
// f16 and bf16 are computed in f32 and rounded back (nearest, ties to even) once per call.
//
// The loops are templated on the element type (no per-element switch) and written so GCC
// vectorizes them at -O2.
#pragma once

#include <cstddef>

#include "comm/algorithms/half.h"
#include "comm/types.h"

namespace fairscale::comm {

// inout[i] = inout[i] (op) in[i] for i < count. kAvg behaves as kSum.
void ReduceInto(ReduceOp op, DataType dtype, void* inout, const void* in, size_t count);

// out[i] = a[i] (op) b[i]. out may be the same buffer as a or b (exactly, not a partial overlap);
// this saves the copy when the first operand is not the destination (ring steps, trees).
void ReduceTo(ReduceOp op, DataType dtype, void* out, const void* a, const void* b, size_t count);

// data[i] /= n: the final step of kAvg. Floating point only divides in the element's compute
// type (f32 for f16/bf16); integers truncate toward zero.
void DivideBy(DataType dtype, void* data, size_t count, int n);

}  // namespace fairscale::comm
