// A small GPT-style language model (//examples/gpt:model): token + position embeddings,
// pre-norm transformer blocks with causal multi-head attention and a GELU MLP, a final
// LayerNorm and a linear LM head. Used by the main job (//examples:train_gpt), the FSDP
// benchmark (//fsdp/bench:fsdp_bench) and the integration tests, so all three train the same
// architecture.
//
// Each block is passed through fsdp::wrap(), so inside an fsdp::EnableWrap scope every block
// becomes its own FSDP unit and outside one the same class is the plain single-process model
// (a checkpointed block, GptConfig::checkpoint_every_k, is wrapped with its CheckpointWrapper
// inside the unit: the unit gathers its parameters again for the recompute):
//
//   {
//     fsdp::EnableWrap scope(comm, opts, fsdp::module_type_auto_wrap_policy<TransformerBlockImpl>());
//     fsdp::FullyShardedDataParallel model(Gpt(GptConfig().vocab(65)), comm, opts);
//   }
#pragma once

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "fsdp/wrap.h"
#include "moe/moe_layer.h"

namespace fairscale::examples::gpt {

struct GptConfig {
  TORCH_ARG(int64_t, vocab) = 256;  // token ids are in [0, vocab)
  TORCH_ARG(int64_t, seq) = 64;     // context length (position embeddings)
  TORCH_ARG(int64_t, width) = 128;  // model dimension; divisible by heads
  TORCH_ARG(int64_t, heads) = 4;
  TORCH_ARG(int64_t, blocks) = 4;
  // Activation checkpointing: block i is wrapped in a checkpoint::CheckpointWrapper (its forward
  // keeps only its input; backward recomputes it) when k > 0 and i % k == 0: 0 = none, 1 = every
  // block, 2 = blocks 0, 2, 4, ... (checkpoint::checkpoint_every_kth's rule). Parameter names and
  // values are unchanged (the wrapper is transparent), and the model has no randomness in its
  // forward, so the numbers are bitwise those of the plain model.
  TORCH_ARG(int64_t, checkpoint_every_k) = 0;
  // Mixture of experts (//moe): with moe_experts E > 0 the MLP of every odd block (1, 3, ...) is
  // a moe::MOELayer: a Top2Gate over E experts (capacity factor moe_capacity_factor; the
  // second-expert Gumbel noise from the model's own generator, see GptImpl::seed_moe_noise),
  // each expert an ExpertMlp of hidden width 2 * width, so that a token's two experts cost the
  // FLOPs of the dense MLP they replace. The experts are spread over the expert communicator
  // given to the Gpt (E divisible by its size). The gates' load-balancing loss: aux_loss().
  TORCH_ARG(int64_t, moe_experts) = 0;
  TORCH_ARG(double, moe_capacity_factor) = 1.0;
};

// One expert of an MoE block: x -> fc2(gelu(fc1(x))), width -> hidden -> width, computed in the
// expert's parameter dtype (the output in x's).
class ExpertMlpImpl : public torch::nn::Module {
 public:
  ExpertMlpImpl(int64_t width, int64_t hidden);
  torch::Tensor forward(torch::Tensor x);

 private:
  torch::nn::Linear fc1_{nullptr}, fc2_{nullptr};
};
TORCH_MODULE(ExpertMlp);

// The experts of a Gpt's MoE blocks that live on this rank: for MoE block j (block 2j + 1), the
// experts [r L, (r + 1) L) of the E (rank r of n in the expert communicator, L = E / n). Built
// before the rest of the model (MakeGptExperts), so that a data-parallel wrapper can be told to
// leave them alone (fsdp::FsdpOptions::ignored_modules: they are rank-local, their gradients
// already hold every rank's tokens).
struct GptExperts {
  std::vector<std::vector<ExpertMlp>> per_block;
  // Every expert module, block by block (for FsdpOptions::ignored_modules).
  std::vector<std::shared_ptr<torch::nn::Module>> modules() const;
};

// Draws every block's E experts from torch's global generator (the same draws on every rank and
// at every world size, so the model does not depend on n) and keeps this rank's. Empty for a
// dense config. c10::Error when E is not divisible by the communicator's size (naming both).
GptExperts MakeGptExperts(const GptConfig& config, const comm::Communicator& expert_comm);

// x + attn(ln1(x)), then x + mlp(ln2(x)); causal multi-head attention, MLP width 4x.
// With `moe` (non-null) the MLP is that MoE layer (registered as "moe"; no fc1/fc2).
class TransformerBlockImpl : public torch::nn::Module {
 public:
  TransformerBlockImpl(int64_t width, int64_t heads, moe::MOELayer moe = moe::MOELayer(nullptr));
  torch::Tensor forward(torch::Tensor x);

 private:
  int64_t heads_;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr}, fc1_{nullptr}, fc2_{nullptr};
  moe::MOELayer moe_{nullptr};
};
TORCH_MODULE(TransformerBlock);

// Token + position embeddings: int64 tokens [batch, t] -> [batch, t, width].
class EmbeddingsImpl : public torch::nn::Module {
 public:
  EmbeddingsImpl(int64_t vocab, int64_t seq, int64_t width);
  torch::Tensor forward(torch::Tensor tokens);

 private:
  torch::nn::Embedding tok_{nullptr}, pos_{nullptr};
};
TORCH_MODULE(Embeddings);

// Final LayerNorm and the linear LM head: [batch, t, width] -> logits [batch, t, vocab].
class LmHeadImpl : public torch::nn::Module {
 public:
  LmHeadImpl(int64_t width, int64_t vocab);
  torch::Tensor forward(torch::Tensor x);

 private:
  torch::nn::LayerNorm ln_f_{nullptr};
  torch::nn::Linear head_{nullptr};
};
TORCH_MODULE(LmHead);

// forward: int64 tokens [batch, t] with t <= seq -> logits [batch, t, vocab].
// Submodule names: embed (tok, pos), block0..block{n-1}, lm_head (ln_f, head). The embeddings,
// every block and the head each go through fsdp::wrap(): GptWrapPolicy() makes each of them its
// own FSDP unit, so the root holds no parameters. (A root holding the embeddings and the head
// would keep both, and their full gradient, alive for the whole backward pass: they are used
// first and last.)
//
// Mixture of experts (config.moe_experts > 0): `expert_comm` is the expert-parallel group (every
// rank of it calls forward together; see moe::MOELayer) and `experts` this rank's experts from
// MakeGptExperts(config, *expert_comm) (built here when empty). The experts are drawn first,
// then the embeddings, the blocks (each MoE block's gate before its own layers) and the head.
// Expert parameters are named "block<2j+1>.moe.experts.<l>.fc1.weight" etc. (l local).
class GptImpl : public torch::nn::Module {
 public:
  explicit GptImpl(const GptConfig& config,
                   std::shared_ptr<comm::Communicator> expert_comm = nullptr,
                   GptExperts experts = {});
  torch::Tensor forward(torch::Tensor tokens);
  const GptConfig& config() const { return config_; }

  // The MoE layers (empty for a dense config), block 1, 3, ...
  const std::vector<moe::MOELayer>& moe_layers() const { return moe_layers_; }
  // The sum of the MoE layers' load-balancing losses (moe::MOELayer::l_aux) of the last
  // forward: differentiable, a 0-dim tensor; undefined for a dense model or before a forward.
  at::Tensor aux_loss() const;
  // Reseeds the generator of the gates' second-expert noise (e.g. per step and rank, so that a
  // resumed run draws what the uninterrupted one drew).
  void seed_moe_noise(uint64_t seed);

 private:
  GptConfig config_;
  fsdp::Wrapped embed_, lm_head_;
  std::vector<fsdp::Wrapped> blocks_;
  std::vector<moe::MOELayer> moe_layers_;
  at::Generator moe_noise_;
};
TORCH_MODULE(Gpt);

// The wrap policy of the GPT model: every TransformerBlock (checkpointed or not), the Embeddings
// and the LmHead.
fsdp::AutoWrapPolicy GptWrapPolicy();

struct SampleOptions {
  TORCH_ARG(double, temperature) = 0.8;  // > 0; logits are divided by it
  TORCH_ARG(int64_t, top_k) = 0;         // 0: the whole vocabulary
  TORCH_ARG(uint64_t, seed) = 0;
};

// Autoregressive sampling: appends `new_tokens` tokens to `prompt` (non-empty) and returns only
// the new ones. `logits_fn` maps int64 tokens [1, t] to logits [1, t, vocab] (any float dtype);
// the context is cropped to the last `context` tokens. The draw uses its own counter-based
// generator seeded by options.seed, not torch's, so ranks that run the same model in lockstep
// (an FSDP model must: its forward is collective) pick the same tokens. Runs under NoGradGuard.
std::vector<int64_t> generate(const std::function<torch::Tensor(torch::Tensor)>& logits_fn,
                              const std::vector<int64_t>& prompt, int64_t new_tokens,
                              int64_t context, const SampleOptions& options = {});

}  // namespace fairscale::examples::gpt
