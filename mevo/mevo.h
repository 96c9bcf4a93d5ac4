// MEVO, the memory-efficient vocabulary output (//mevo): FairScale 0.4.13's
// fairscale.experimental.nn.MemoryEfficientVocabOutput in LibTorch. The output projection of a
// language model and its cross-entropy loss, fused and computed in [token_chunk, vocab_chunk]
// tiles, so that the [tokens, V] logits (and their softmax, and its gradient) never exist: for a
// large vocabulary they are the biggest activation of the whole model. For LM heads whose
// projection weight is often tied with the input embedding.
//
//   auto opts = mevo::MevoOptions().vocab_chunk(4096).token_chunk(1024).reduction("mean");
//   at::Tensor loss = mevo::mevo_cross_entropy(hidden, embed->weight, targets, opts);
//   loss.backward();  // hidden.grad(), embed->weight.grad() as from linear + cross_entropy
//
// Contract (T tokens, D = model width, V = vocabulary):
// * Value: equals torch::nn::functional::cross_entropy(at::linear(input, weight[, bias]),
//   targets, CrossEntropyFuncOptions().ignore_index(i).reduction(r)) (no class weights, no label
//   smoothing), input [..., D] (any leading shape, flattened to [T, D]), weight [V, D], targets
//   int64 of input's leading shape (T values). Tokens whose target equals ignore_index
//   (default -100, as in PyTorch) contribute nothing; "mean" divides by the number of the other
//   tokens (NaN when there are none, T = 0 included, as PyTorch), "sum" is 0 then.
// * Algorithm and memory: forward takes, per token chunk, the target logits as row dot products
//   and an online log-sum-exp over the vocabulary chunks (one [token_chunk, vocab_chunk] tile
//   alive at a time), and saves input, weight, bias, targets (references, no copies) and the
//   per-token log-sum-exp [T]. Backward recomputes each tile's logits, turns them into
//   coefficient * softmax in place and accumulates grad_input [T, D], grad_weight [V, D] (and
//   grad_bias [V]) with addmm_ into the results; the one-hot part (-coefficient at each target)
//   is applied once per token chunk (index_add_). Peak extra bytes beyond the gradients:
//   O(token_chunk * vocab_chunk + T + token_chunk * D), never O(T * V). The price: each tile's
//   matmul is computed twice (forward and backward), as in FairScale. Token chunks whose tokens
//   are all ignored are skipped.
// * Precision: f32 and f64 compute in their own dtype (online log-sum-exp over the vocabulary
//   chunks, f32 agrees with the plain loss to ~1e-6). bf16 / f16: tiles, log-sum-exp and the
//   gradient accumulators are f32 (FairScale's fp_max / fp_sum / fp_target); the loss is f32,
//   the gradients are cast back to the input dtype at the end (a transient f32 [V, D] and [T, D],
//   and f32 copies of each tile's [token_chunk, D] and [vocab_chunk, D] rows).
// * Errors (c10::Error via base::ThrowIfError, "mevo::mevo_cross_entropy: INVALID_ARGUMENT: ..."):
//   weight not 2-D, bias not [V] of weight's dtype, input.size(-1) != weight.size(1), targets'
//   shape not input's leading shape, targets not int64, input and weight dtypes differ or are
//   not floating point, a target outside [0, V) that is not ignore_index (the first such token
//   and its value are named), and, from MevoOptions, vocab_chunk or token_chunk <= 0 or a
//   reduction other than "mean" / "sum" (MevoLoss checks its options at construction).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <string>

namespace fairscale::mevo {

struct MevoOptions {
  // Rows of the weight (vocabulary entries) per tile.
  TORCH_ARG(int64_t, vocab_chunk) = 4096;
  // Tokens per tile.
  TORCH_ARG(int64_t, token_chunk) = 1024;
  // "mean" (PyTorch's default: over the non-ignored tokens) or "sum" (FairScale's default).
  TORCH_ARG(std::string, reduction) = "mean";
  // Targets equal to this are skipped (PyTorch's default, -100).
  TORCH_ARG(int64_t, ignore_index) = -100;
};

// The fused projection + cross-entropy: a 0-dim loss, differentiable in input and weight.
at::Tensor mevo_cross_entropy(const at::Tensor& input, const at::Tensor& weight,
                              const at::Tensor& targets, const MevoOptions& options = {});
// With a bias [V] (a torch::nn::Linear head's; FairScale's MEVO has none): the logits are
// at::linear(input, weight, bias). An undefined bias is the overload above.
at::Tensor mevo_cross_entropy(const at::Tensor& input, const at::Tensor& weight,
                              const at::Tensor& bias, const at::Tensor& targets,
                              const MevoOptions& options = {});

// The loss as a module holding its options, like torch::nn::CrossEntropyLoss: the weight is an
// argument of forward (it belongs to the embedding or head that owns it; registering a tied
// weight here too would hand it to the optimizer twice).
class MevoLossImpl : public torch::nn::Cloneable<MevoLossImpl> {
 public:
  explicit MevoLossImpl(MevoOptions options = {});
  void reset() override {}
  // bias: optional [V] (undefined: none).
  at::Tensor forward(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& targets,
                     const at::Tensor& bias = {});
  MevoOptions options;
};
TORCH_MODULE(MevoLoss);

}  // namespace fairscale::mevo
