// The main job's GPT (model.h) with Megatron-style tensor parallelism (//examples/gpt:tp_model):
// the same architecture and parameter names as Gpt, with its matrices split over a
// tensor-parallel group of T ranks by //model_parallel's layers. A TpGpt loaded from a dense
// Gpt's parameters computes the same loss and logits (rounding aside), and its full state dict
// is the dense one, so checkpoints stay in the dense layout and load at any T.
//
//   part of Gpt                 TpGpt on rank r of T
//   embed.tok [V, C]            VocabParallelEmbedding: rows [r*V/T, (r+1)*V/T)
//   embed.pos [seq, C]          torch::nn::Embedding, replicated
//   blockI.ln1/ln2, lm_head.ln_f  LayerNorm, replicated
//   blockI.qkv [3C, C]          ColumnParallelLinear(gather_output = false), heads
//                               [r*H/T, (r+1)*H/T): see "The fused QKV layout" below
//   blockI.proj [C, C]          RowParallelLinear(input_is_parallel = true)
//   blockI.fc1 [4C, C]          ColumnParallelLinear(gather_output = false)
//   blockI.fc2 [C, 4C]          RowParallelLinear(input_is_parallel = true)
//   lm_head.head [V, C]         ColumnParallelLinear(gather_output = false): vocab shard r
//
// The fused QKV layout. Gpt's qkv weight stacks [Q; K; V] (rows [0, C), [C, 2C), [2C, 3C)),
// each ordered by head (head h owns rows h*d .. (h+1)*d of its part, d = C/H). Rank r must hold
// Q, K and V of its own heads, so its qkv shard [3C/T, C] is the strided slice
//   [Q rows r*C/T .. (r+1)*C/T ; K rows (same range) ; V rows (same range)]
// (likewise the bias), not the contiguous rows r*3C/T .. that a plain ColumnParallelLinear
// takes. qkv_to_rank_major() reorders a dense [3C, ...] tensor so that the contiguous slice r of
// the result is that strided slice; qkv_to_dense() is its inverse. load_dense_state_dict() and
// full_state_dict() apply them, so users only ever see the dense layout.
//
// Contract (T = comm->size()):
// * Sizes: vocab and heads must be divisible by T (then so are C and 4C); otherwise the
//   constructor raises c10::Error naming the size and T. GptConfig::checkpoint_every_k must be 0
//   (activation checkpointing is not wired here). A null communicator is an error.
// * Initialization: seeded from `init_seed` with private generators (never torch's global RNG,
//   so ranks may be threads), the same full model on every rank and at every T for a given seed
//   (the constructor is local: no collective); it is NOT the
//   dense Gpt's initialization: load a dense state dict to get a dense twin.
// * forward(tokens), loss(tokens, targets), full_state_dict() are collectives on the group (every
//   rank calls them in the same order with the same tokens); load_dense_state_dict is local.
// * FSDP over the data dimension: build the TpGpt inside an fsdp::EnableWrap scope over the
//   data-parallel group (see the constructor) and wrap it in a FullyShardedDataParallel over the
//   same group; full_state_dict() then needs the FSDP parameters summoned
//   (summon_full_params) around it.
// * Missing: dropout (Gpt has none), sequence parallelism, activation checkpointing, vocab
//   padding (an indivisible vocab is an error).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "examples/gpt/model.h"
#include "fsdp/wrap.h"
#include "model_parallel/layers.h"

namespace fairscale::examples::gpt {

// x + attn(ln1(x)), then x + mlp(ln2(x)), with this rank's H/T heads and 4C/T MLP columns.
class TpTransformerBlockImpl : public torch::nn::Module {
 public:
  TpTransformerBlockImpl(int64_t width, int64_t heads, std::shared_ptr<comm::Communicator> comm,
                         uint64_t init_seed);
  torch::Tensor forward(torch::Tensor x);

 private:
  int64_t local_heads_;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  model_parallel::ColumnParallelLinear qkv_{nullptr}, fc1_{nullptr};
  model_parallel::RowParallelLinear proj_{nullptr}, fc2_{nullptr};
};
TORCH_MODULE(TpTransformerBlock);

// Token + position embeddings, the token table split over the vocabulary: int64 tokens
// [batch, t] -> [batch, t, width] (full, the same on every rank of the group).
class TpEmbeddingsImpl : public torch::nn::Module {
 public:
  TpEmbeddingsImpl(int64_t vocab, int64_t seq, int64_t width,
                   std::shared_ptr<comm::Communicator> comm, uint64_t init_seed);
  torch::Tensor forward(torch::Tensor tokens);

 private:
  model_parallel::VocabParallelEmbedding tok_{nullptr};
  torch::nn::Embedding pos_{nullptr};
};
TORCH_MODULE(TpEmbeddings);

// Final LayerNorm and the head split over the vocabulary: [batch, t, width] -> this rank's
// logits [batch, t, vocab/T] (score them with model_parallel::vocab_parallel_cross_entropy).
class TpLmHeadImpl : public torch::nn::Module {
 public:
  TpLmHeadImpl(int64_t width, int64_t vocab, std::shared_ptr<comm::Communicator> comm,
               uint64_t init_seed);
  torch::Tensor forward(torch::Tensor x);

 private:
  torch::nn::LayerNorm ln_f_{nullptr};
  model_parallel::ColumnParallelLinear head_{nullptr};
};
TORCH_MODULE(TpLmHead);

// Submodule and parameter names are Gpt's: embed (tok, pos), block0.., lm_head (ln_f, head).
// The children in order (embed, block0.., lm_head) are the layers of a pipeline
// (pipe::Pipe over torch::nn::Sequential): see tp_pipe_model.cc.
class TpGptImpl : public torch::nn::Module {
 public:
  // Each block goes through fsdp::wrap() (as Gpt's do): inside an fsdp::EnableWrap scope with
  // module_type_auto_wrap_policy<TpTransformerBlockImpl>() every block becomes its own FSDP unit
  // over the scope's (data-parallel) communicator; outside one the blocks are plain.
  TpGptImpl(const GptConfig& config, std::shared_ptr<comm::Communicator> comm,
            uint64_t init_seed = 0);
  // int64 tokens [batch, t], t <= seq -> full logits [batch, t, vocab] on every rank (gathered;
  // for sampling and checks; differentiable).
  torch::Tensor forward(torch::Tensor tokens);
  // This rank's vocabulary shard of the logits: [batch, t, vocab/T].
  torch::Tensor parallel_logits(torch::Tensor tokens);
  // Mean cross-entropy of the next-token targets (int64 [batch, t] in [0, vocab)), computed on
  // the vocabulary-sharded logits (vocab_parallel_cross_entropy: the full logits are never
  // built). A scalar, equal on every rank, equal to cross_entropy(Gpt(tokens), targets).
  torch::Tensor loss(torch::Tensor tokens, torch::Tensor targets);

  // Loads a dense Gpt's parameters (its named_parameters(), keys and shapes of the same config):
  // this rank's slice of every split matrix, the replicated ones whole. Local. Missing, extra or
  // mis-shaped keys raise c10::Error naming the key.
  void load_dense_state_dict(const model_parallel::TensorDict& dense);
  // The dense Gpt's parameters (keys, shapes and layout), gathered on every rank. Collective.
  model_parallel::TensorDict full_state_dict();

  const GptConfig& config() const { return config_; }
  comm::Communicator& communicator() const { return *comm_; }

  // Whether the parameter `name` (a TpGpt name, with any prefix in front: "gpt.block0.qkv.weight")
  // holds a slice of its dense twin (embed.tok, qkv, fc1, head weights and biases; proj and fc2
  // weights) rather than a replicated copy (positions, LayerNorms, proj and fc2 biases).
  static bool is_split(const std::string& name);

 private:
  GptConfig config_;
  std::shared_ptr<comm::Communicator> comm_;
  TpEmbeddings embed_{nullptr};
  std::vector<fsdp::Wrapped> blocks_;
  TpLmHead lm_head_{nullptr};
};
TORCH_MODULE(TpGpt);

// Reorders a dense fused-QKV tensor [3C, ...] (Q; K; V, each by head) into rank-major order
// [rank 0: Q0; K0; V0, rank 1: Q1; K1; V1, ...] for T ranks, so that contiguous slice r (rows
// r*3C/T ..) holds rank r's heads. C must be divisible by T. qkv_to_dense is the inverse.
at::Tensor qkv_to_rank_major(const at::Tensor& dense, int64_t tp_size);
at::Tensor qkv_to_dense(const at::Tensor& rank_major, int64_t tp_size);

}  // namespace fairscale::examples::gpt
