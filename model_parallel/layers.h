// Tensor-parallel layers (//model_parallel): FairScale's fairscale.nn.model_parallel.layers
// (Megatron-LM's tensor_parallel/layers.py) as LibTorch modules over a comm::Communicator, the
// tensor-parallel group. Users build a transformer's MLP and attention projections from them
// (ColumnParallelLinear -> activation -> RowParallelLinear), a vocab-parallel input embedding and,
// with vocab_parallel_cross_entropy (cross_entropy.h), a vocab-parallel output layer.
//
// Contract (T = comm->size(), r = comm->rank(); "slice r of d" = narrow(d, r * s / T, s / T)):
//
//   layer                       parameters on rank r                 forward
//   ColumnParallelLinear        weight [out/T, in] = slice r of dim 0  copy_to_parallel_region(x)
//                               bias [out/T] = slice r                 -> linear -> all-gather
//                                                                      along the last dim if
//                                                                      gather_output
//   RowParallelLinear           weight [out, in/T] = slice r of dim 1  scatter x along the last
//                               bias [out] (full, replicated)          dim unless
//                                                                      input_is_parallel ->
//                                                                      linear without bias ->
//                                                                      reduce_from (all-reduce)
//                                                                      -> + bias
//   ... sequence_parallel       (the same)                             Column: x = chunk r of the
//                                                                      sequence (dim 0) ->
//                                                                      gather_from_sequence_
//                                                                      parallel_region (all-gather
//                                                                      along 0; backward reduce-
//                                                                      scatters dx) -> linear.
//                                                                      Row (input_is_parallel):
//                                                                      linear without bias ->
//                                                                      reduce_scatter_to_sequence_
//                                                                      parallel_region (chunk r of
//                                                                      the sum along 0) -> + bias
//   VocabParallelEmbedding      weight [V/T, dim] = rows               rows of tokens in
//                               [r*V/T, (r+1)*V/T)                     [r*V/T, (r+1)*V/T), zeros
//                                                                      for others -> reduce_from
//
// * Every layer equals its dense LibTorch twin (torch::nn::Linear / Embedding) built from the
//   full ("master") tensors: same outputs, the same input gradient, and the gradients of the
//   shards are the slices of the dense gradients (rounding aside: the all-reduce sums in
//   another order). The collectives are //autograd_comm's, so the backward passes issue the
//   matching collectives.
// * Sizes: out_features (column), in_features (row) and num_embeddings must be divisible by T;
//   otherwise the constructor raises c10::Error naming the option, its size and T.
// * Initialization: the full master tensors are drawn from a private at::Generator seeded with
//   the options' init_seed (weight and bias uniform(-1/sqrt(in), 1/sqrt(in)) as torch::nn::Linear;
//   embedding normal(0, 1) as torch::nn::Embedding), and each rank keeps its slice: every rank
//   draws the same full tensor, and the same seed gives the same full model at every T. Torch's
//   global RNG is not used. load_full() replaces the parameters by this rank's slice of given
//   full tensors (e.g. a dense model's).
// * Collective: forward, backward, full_state_dict() and the free full_state_dict() are
//   collectives on the group (every rank calls them in the same order with the same shapes);
//   load_full() / load_full_state_dict() are local. `comm` is held by the module and must be the
//   same group on every rank of it. Errors from the group raise c10::Error (base/torch_error.h).
// * dtypes: parameters are f32 at construction; module.to(kDouble) etc. work as for any Module
//   (f32, f64, f16, bf16: what the comm layer carries).
// * Sequence parallelism (Megatron-LM's `sequence_parallel`): Column(sequence_parallel,
//   gather_output false) -> ... -> Row(sequence_parallel, input_is_parallel) keeps the
//   activations outside the pair (LayerNorm, dropout, residual) as this rank's chunk [s/T, ...]
//   of the sequence, with the same bytes on the wire as the all-reduces it replaces (an
//   all-reduce is a reduce-scatter plus an all-gather). The replicated parameters used on the
//   chunk (LayerNorm weights, the row layer's bias) then have partial gradients: call
//   all_reduce_sequence_parallel_grads (sequence_parallel.h) after backward.
// * Dropout across the group: rng.h (ModelParallelRng). Missing (see README.md):
//   ParallelEmbedding (embedding-dim split), padding_idx / max_norm, strided (fused QKV)
//   partitions; a sequence-parallel VocabParallelEmbedding output (reduce-scatter instead of
//   all-reduce).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/ordered_dict.h>

#include <cstdint>
#include <memory>
#include <string>

#include "comm/communicator.h"

namespace fairscale::model_parallel {

using TensorDict = torch::OrderedDict<std::string, at::Tensor>;

// What every tensor-parallel layer offers for full (unsharded) state dicts: the dense twin's
// parameters gathered from the group, and loading this rank's slice of them.
class TensorParallelModule {
 public:
  virtual ~TensorParallelModule() = default;
  // The full (dense-twin) parameters, keyed like the dense module's ("weight", "bias"), on every
  // rank (all-gather; collective). Detached, new tensors.
  virtual TensorDict full_state_dict() = 0;
  // Copies this rank's slice of `full` (keys and shapes of full_state_dict()) into the
  // parameters. Local; raises c10::Error on a missing key or a wrong shape.
  virtual void load_full_state_dict(const TensorDict& full) = 0;
};

struct ColumnParallelLinearOptions {
  ColumnParallelLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);  // the full output size; must be divisible by T
  TORCH_ARG(bool, bias) = true;
  // All-gather the output (full [.., out] on every rank); false leaves this rank's [.., out/T],
  // for a following RowParallelLinear(input_is_parallel) or vocab_parallel_cross_entropy.
  TORCH_ARG(bool, gather_output) = true;
  // Megatron's sequence parallelism: the input is this rank's chunk [s/T, ...] of the sequence
  // (dim 0) and is all-gathered along dim 0 (gather_from_sequence_parallel_region, whose backward
  // reduce-scatters the input gradient) instead of copy_to_parallel_region. Requires
  // gather_output(false) (c10::Error at construction otherwise). See sequence_parallel.h.
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(uint64_t, init_seed) = 0;  // seed of the full master weight (see the header)
};

// Y = X A^T + b with A split along its rows (the output features): FairScale's / Megatron's
// ColumnParallelLinear.
class ColumnParallelLinearImpl : public torch::nn::Module, public TensorParallelModule {
 public:
  ColumnParallelLinearImpl(ColumnParallelLinearOptions options,
                           std::shared_ptr<comm::Communicator> comm);
  at::Tensor forward(const at::Tensor& input);
  // Copies this rank's rows of weight [out, in] (and bias [out], if the layer has one).
  void load_full(const at::Tensor& weight, const at::Tensor& bias = {});
  at::Tensor full_weight();  // [out, in] on every rank (collective)
  at::Tensor full_bias();    // [out] on every rank (collective); undefined without bias
  TensorDict full_state_dict() override;
  void load_full_state_dict(const TensorDict& full) override;
  void pretty_print(std::ostream& stream) const override;

  const ColumnParallelLinearOptions& options() const { return options_; }
  comm::Communicator& communicator() const { return *comm_; }

  at::Tensor weight;  // [out/T, in]
  at::Tensor bias;    // [out/T], undefined without bias

 private:
  ColumnParallelLinearOptions options_;
  std::shared_ptr<comm::Communicator> comm_;
};
TORCH_MODULE(ColumnParallelLinear);

struct RowParallelLinearOptions {
  RowParallelLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);  // the full input size; must be divisible by T
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  // The input is already this rank's [.., in/T] (a ColumnParallelLinear without gather_output);
  // false: the input is the full [.., in] and is scattered along its last dim.
  TORCH_ARG(bool, input_is_parallel) = false;
  // Megatron's sequence parallelism: the output is reduce-scattered along dim 0 (the sequence;
  // reduce_scatter_to_sequence_parallel_region), so each rank gets the sum over the group of its
  // chunk [s/T, ..., out], instead of the all-reduced full output; the replicated bias is added
  // to the chunk (its gradient is then partial per rank: sequence_parallel.h). Requires
  // input_is_parallel(true) (c10::Error at construction otherwise) and the input's dim 0
  // divisible by T (c10::Error in forward naming the size and T).
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(uint64_t, init_seed) = 0;
};

// Y = X A^T + b with A split along its columns (the input features): FairScale's / Megatron's
// RowParallelLinear. The output is full and identical on every rank (this rank's chunk of the
// sequence under sequence_parallel); the bias is added once, after the reduction.
class RowParallelLinearImpl : public torch::nn::Module, public TensorParallelModule {
 public:
  RowParallelLinearImpl(RowParallelLinearOptions options, std::shared_ptr<comm::Communicator> comm);
  at::Tensor forward(const at::Tensor& input);
  // Copies this rank's columns of weight [out, in] and the whole bias [out].
  void load_full(const at::Tensor& weight, const at::Tensor& bias = {});
  at::Tensor full_weight();  // [out, in] on every rank (collective)
  at::Tensor full_bias();    // [out] (a copy of the replicated bias; no collective)
  TensorDict full_state_dict() override;
  void load_full_state_dict(const TensorDict& full) override;
  void pretty_print(std::ostream& stream) const override;

  const RowParallelLinearOptions& options() const { return options_; }
  comm::Communicator& communicator() const { return *comm_; }

  at::Tensor weight;  // [out, in/T]
  at::Tensor bias;    // [out], undefined without bias

 private:
  RowParallelLinearOptions options_;
  std::shared_ptr<comm::Communicator> comm_;
};
TORCH_MODULE(RowParallelLinear);

struct VocabParallelEmbeddingOptions {
  VocabParallelEmbeddingOptions(int64_t num_embeddings, int64_t embedding_dim)
      : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {}
  TORCH_ARG(int64_t, num_embeddings);  // V, the full vocabulary; must be divisible by T
  TORCH_ARG(int64_t, embedding_dim);
  TORCH_ARG(uint64_t, init_seed) = 0;
};

// An embedding table split along the vocabulary: FairScale's / Megatron's
// VocabParallelEmbedding. Input: int64 token ids in [0, V) of any shape; output [..., dim], full
// and identical on every rank.
class VocabParallelEmbeddingImpl : public torch::nn::Module, public TensorParallelModule {
 public:
  VocabParallelEmbeddingImpl(VocabParallelEmbeddingOptions options,
                             std::shared_ptr<comm::Communicator> comm);
  at::Tensor forward(const at::Tensor& tokens);
  void load_full(const at::Tensor& weight);  // copies rows [r*V/T, (r+1)*V/T) of [V, dim]
  at::Tensor full_weight();                  // [V, dim] on every rank (collective)
  TensorDict full_state_dict() override;
  void load_full_state_dict(const TensorDict& full) override;
  void pretty_print(std::ostream& stream) const override;

  const VocabParallelEmbeddingOptions& options() const { return options_; }
  comm::Communicator& communicator() const { return *comm_; }
  int64_t vocab_start() const { return vocab_start_; }  // r * V / T
  int64_t vocab_end() const { return vocab_end_; }      // (r + 1) * V / T

  at::Tensor weight;  // [V/T, dim]

 private:
  VocabParallelEmbeddingOptions options_;
  std::shared_ptr<comm::Communicator> comm_;
  int64_t vocab_start_ = 0;
  int64_t vocab_end_ = 0;
};
TORCH_MODULE(VocabParallelEmbedding);

// The full (unsharded) state dict of a model containing tensor-parallel layers: its
// named_parameters() and named_buffers(), with every TensorParallelModule's parameters replaced
// by the gathered full ones, so the keys and shapes are those of the dense twin (the same model
// built from torch::nn::Linear / Embedding under the same names). Collective when the model has
// tensor-parallel layers. Values are detached.
TensorDict full_state_dict(torch::nn::Module& model);

// Loads a full state dict (as full_state_dict() makes, or a dense twin's parameters and buffers)
// into a model with tensor-parallel layers at any T: each TensorParallelModule takes its slice,
// other parameters and buffers are copied whole. Every parameter and buffer of the model must
// have a key (c10::Error naming the first missing one or a shape mismatch); extra keys are an
// error too. Local (no collective).
void load_full_state_dict(torch::nn::Module& model, const TensorDict& full);

}  // namespace fairscale::model_parallel
