// Megatron-LM's sequence parallelism around the tensor-parallel layers (//model_parallel): the
// gradient all-reduce of the replicated parameters that run on a rank's chunk of the sequence.
// Users of ColumnParallelLinear / RowParallelLinear with sequence_parallel(true) (layers.h) call
// it once per step, after backward.
//
// The layout (T = comm.size(), s = the sequence length, dim 0 of the activations):
//
//   x [s/T, b, C] -> LayerNorm -> Column(sequence_parallel, gather_output false)  all-gather
//     -> gelu -> Row(sequence_parallel, input_is_parallel) [s/T, b, C]             reduce-scatter
//     -> dropout -> + x                                                            (on the chunk)
//
// The first chunk comes from autograd_comm::scatter_to_sequence_parallel_region (e.g. of the
// embeddings' output; s divisible by T, else c10::Error naming the size and T); the last layer's
// output goes back to the full sequence with gather_from_sequence_parallel_region(h, comm,
// /*tensor_parallel_output_grad=*/false) (e.g. before a replicated LM head). Dropout inside a
// sequence-parallel region draws a different mask per rank (ModelParallelRng::parallel(), rng.h),
// as each rank holds different tokens.
//
// Why the all-reduce: a replicated parameter applied to this rank's tokens only (LayerNorm's
// weight and bias, the row layer's bias, anything else outside the Column..Row pair) gets the
// gradient of those tokens only; the dense gradient is the sum over the tensor-parallel group.
// Megatron marks these parameters `sequence_parallel = True` and sums their gradients over the
// tensor group (`_allreduce_layernorm_grads`). The Column / Row weights and the column bias need
// nothing: they see the whole sequence.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "comm/communicator.h"

namespace fairscale::model_parallel {

// Sums the gradients of `params` over `comm` (the tensor-parallel group) in place: one
// all-reduce (sum) per dtype of the flattened gradients. Call it after backward and before
// gradient clipping and the optimizer step (and before any data-parallel reduction, which then
// averages the summed gradients), every step, with the same list on every rank of the group: the
// replicated parameters used inside sequence-parallel regions (LayerNorm weights and biases,
// RowParallelLinear(sequence_parallel)'s bias). An undefined gradient is first set to zeros (so
// every rank issues the same collective). Collective; no-op at T = 1. Raises c10::Error
// "model_parallel::all_reduce_sequence_parallel_grads rank r/T (Float, n elements): ..." if the
// group fails.
void all_reduce_sequence_parallel_grads(const std::vector<at::Tensor>& params,
                                        comm::Communicator& comm);

}  // namespace fairscale::model_parallel
