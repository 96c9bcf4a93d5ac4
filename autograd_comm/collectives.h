// Differentiable collectives (//autograd_comm): the communication steps of tensor, sequence and
// expert parallelism as autograd functions over a comm::Communicator, for the layers built on
// them (column/row-parallel Linear, vocab-parallel embedding, MoE dispatch/combine). They are
// FairScale's fairscale/nn/model_parallel/mappings.py and Megatron-LM's tensor_parallel/mappings.py
// (sequence parallel) in LibTorch; depends on //comm:interface, //comm/torch and LibTorch only.
//
// Contract (n = comm.size(), r = comm.rank(); "all-gather along d" = the concatenation along d of
// every rank's tensor in rank order; "chunk r along d" = x.narrow(d, r * s / n, s / n) for
// s = x.size(d)):
//
//   function                                forward                     backward (of the grad)
//   copy_to_parallel_region(x)              identity                    all-reduce (sum)
//   reduce_from_parallel_region(x)          all-reduce (sum)            identity
//   scatter_to_parallel_region(x, d)        chunk r along d             all-gather along d
//   gather_from_parallel_region(x, d)       all-gather along d          chunk r along d
//   scatter_to_sequence_parallel_region(x)  chunk r along 0             all-gather along 0
//   gather_from_sequence_parallel_region(x, tensor_parallel_output_grad = true)
//                                           all-gather along 0          reduce-scatter (sum)
//                                                                       along 0; chunk r along 0
//                                                                       when false
//   reduce_scatter_to_sequence_parallel_region(x)
//                                           reduce-scatter (sum) along 0  all-gather along 0
//   all_to_all(x)                           block j (of n equal blocks  the same all-to-all
//                                           along 0) to rank j; block i
//                                           of the result from rank i
//
// * Collective: every rank of `comm` calls the same functions in the same order, with tensors of
//   the same shape, dtype and device (a backward pass issues its collectives in the order the
//   autograd engine runs them, which is the same on every rank for the same graph). A rank whose
//   element count differs from its peers' gets the communicator's mismatch error (kInvalidArgument
//   on the rank that detects it, kUnavailable on the others), never a hang; equal counts in
//   different shapes cannot be detected.
// * Shapes: d may be negative (counted from the end, as in LibTorch) and must be in range. Where
//   a result is a chunk, x.size(d) must be divisible by n (else c10::Error naming the function,
//   the dimension, its size and n, raised before anything is sent, on every rank alike).
//   all_to_all keeps the shape. Results of a collective or a chunk are new contiguous tensors;
//   identity paths return x (n == 1) or an autograd view of it (copy_to at n > 1). Inputs and
//   gradients may be non-contiguous (copied before they are sent).
// * dtypes: every floating type the comm layer carries (f32, f64, f16, bf16); sums of f16/bf16
//   are computed by the backend (in f32, rounded back).
// * With n == 1 every function is the identity in forward and backward and issues nothing.
// * Blocking: each function waits for its collective (forward in the call, backward in the
//   backward pass) with the communicator's timeout. A failed or timed-out operation raises
//   c10::Error "autograd_comm::<function> [backward] rank r/n x [shape]: <CODE>: <message>"
//   (base/torch_error.h). After such an error the communicator is broken (comm/communicator.h).
// * `comm` must outlive the backward pass of every result (it is held by reference).
// * Once differentiable: the backward passes are not themselves recorded (no double backward),
//   like the Python originals.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "comm/communicator.h"

namespace fairscale::autograd_comm {

// Identity forward; all-reduce (sum) of the gradient in backward. FairScale's
// copy_to_model_parallel_region: the input of a column-parallel layer.
at::Tensor copy_to_parallel_region(const at::Tensor& x, comm::Communicator& comm);

// All-reduce (sum) forward; identity backward. FairScale's reduce_from_model_parallel_region:
// the output of a row-parallel layer.
at::Tensor reduce_from_parallel_region(const at::Tensor& x, comm::Communicator& comm);

// This rank's chunk of `dim` forward (x.size(dim) divisible by comm.size()); all-gather along
// `dim` backward. FairScale's scatter_to_model_parallel_region (dim -1).
at::Tensor scatter_to_parallel_region(const at::Tensor& x, comm::Communicator& comm,
                                      int64_t dim = -1);

// All-gather along `dim` forward; this rank's chunk of `dim` backward. FairScale's
// gather_from_model_parallel_region (dim -1): a column-parallel layer's gather_output.
at::Tensor gather_from_parallel_region(const at::Tensor& x, comm::Communicator& comm,
                                       int64_t dim = -1);

// Megatron-LM's sequence-parallel mappings, all along dim 0 (the sequence dimension).
// Chunk r of dim 0 forward; all-gather along dim 0 backward.
at::Tensor scatter_to_sequence_parallel_region(const at::Tensor& x, comm::Communicator& comm);

// All-gather along dim 0 forward. Backward: reduce-scatter (sum) along dim 0 when the consumer
// is tensor-parallel (every rank holds a partial gradient of the full sequence: Megatron's
// default, true), else chunk r of dim 0 (every rank holds the same full gradient).
at::Tensor gather_from_sequence_parallel_region(const at::Tensor& x, comm::Communicator& comm,
                                                bool tensor_parallel_output_grad = true);

// Reduce-scatter (sum) along dim 0 forward (x.size(0) divisible by comm.size()); all-gather
// along dim 0 backward: a row-parallel layer's output under sequence parallelism.
at::Tensor reduce_scatter_to_sequence_parallel_region(const at::Tensor& x,
                                                      comm::Communicator& comm);

// All-to-all with equal splits along dim 0 (x.size(0) divisible by comm.size()): block j goes to
// rank j, block i of the result comes from rank i; same shape. Backward is the same all-to-all
// of the gradient (the exchange is its own inverse). MoE dispatch / combine.
at::Tensor all_to_all(const at::Tensor& x, comm::Communicator& comm);

}  // namespace fairscale::autograd_comm
