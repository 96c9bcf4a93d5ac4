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

#include <cstdint>
#include <functional>
#include <vector>

#include "fsdp/wrap.h"

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
};

// x + attn(ln1(x)), then x + mlp(ln2(x)); causal multi-head attention, MLP width 4x.
class TransformerBlockImpl : public torch::nn::Module {
 public:
  TransformerBlockImpl(int64_t width, int64_t heads);
  torch::Tensor forward(torch::Tensor x);

 private:
  int64_t heads_;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr}, fc1_{nullptr}, fc2_{nullptr};
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
class GptImpl : public torch::nn::Module {
 public:
  explicit GptImpl(const GptConfig& config);
  torch::Tensor forward(torch::Tensor tokens);
  const GptConfig& config() const { return config_; }

 private:
  GptConfig config_;
  fsdp::Wrapped embed_, lm_head_;
  std::vector<fsdp::Wrapped> blocks_;
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
