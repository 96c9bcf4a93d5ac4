// vocab_parallel_cross_entropy (//model_parallel): the cross-entropy loss of logits that are
// sharded along the vocabulary, as ColumnParallelLinear(gather_output = false) produces them for
// a tensor-parallel output layer. FairScale's fairscale/nn/model_parallel/cross_entropy.py and
// Megatron-LM's tensor_parallel/cross_entropy.py, in LibTorch.
//
// Contract (T = comm.size(), r = comm.rank(), V = T * logits_parallel.size(-1)):
// * logits_parallel [..., V/T] holds columns [r*V/T, (r+1)*V/T) of the full logits [..., V];
//   targets (int64, shape [...], the logits' shape without its last dim) are class ids in [0, V),
//   the same on every rank. The result is the mean over all tokens of
//   -log softmax(full logits)[target], a scalar, equal on every rank, and equal (rounding aside)
//   to torch::nn::functional::cross_entropy(full logits.view(-1, V), targets.view(-1)).
// * The full logits are never materialized: one all-reduce (max) of the per-token maxima and one
//   all-reduce (sum) of [the target logit (from the owning rank; zeros elsewhere), the sum of
//   exp] per token: 2 collectives, each of O(tokens) elements.
// * Differentiable in logits_parallel (a torch::autograd::Function): the gradient is the
//   Megatron one, (softmax - one_hot(target)) / tokens on the local shard, computed locally (no
//   collective in backward). Once differentiable.
// * Collective on `comm` (same calls, same shapes on every rank); `comm` must outlive the call.
//   Bad shapes or dtypes raise c10::Error before anything is sent; a target outside [0, V) makes
//   the loss wrong (it is not checked: that would cost a collective).
// * Missing: ignore_index, label smoothing, class weights, reductions other than the mean.
#pragma once

#include <ATen/core/Tensor.h>

#include "comm/communicator.h"

namespace fairscale::model_parallel {

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits_parallel,
                                        const at::Tensor& targets, comm::Communicator& comm);

}  // namespace fairscale::model_parallel
