// Activation checkpointing (//checkpoint): FairScale's checkpoint_wrapper and PyTorch's
// torch.utils.checkpoint (the reentrant variant) for LibTorch.
//
// checkpoint(fn, inputs) runs fn without keeping its intermediate activations: the forward runs
// under NoGradGuard and saves only the inputs (optionally on the CPU: offload_to_cpu) plus the
// CPU (and CUDA, when present) RNG state and the autocast state. Its backward restores that state,
// runs fn again with grad enabled on detached copies of the inputs, and back-propagates the
// incoming gradients through the recomputed graph (a reentrant backward). So
//   - dropout draws the same masks in the recompute (and the caller's RNG stream continues as if
//     the recompute had not happened: its state is restored afterwards);
//   - parameters used inside fn get their gradients from that inner backward, so their
//     AccumulateGrad (and any post hook on it, e.g. FSDP's) fires while the outer backward is
//     inside this function's backward;
//   - fn must be deterministic given inputs + RNG state, and must not depend on state that changes
//     between forward and backward (e.g. BatchNorm running statistics are updated twice: keep
//     batch-norm modules outside checkpointed regions, or in eval mode).
// When grad mode is off, checkpoint() just calls fn. Parameters get gradients even when no input
// requires grad (a hidden zero-size input that requires grad keeps the outputs differentiable,
// FairScale's "dummy tensor").
//
// Errors (an empty fn or module, an undefined output, a recompute that differs from the forward)
// raise c10::Error, like every user API of this repository; an exception fn throws propagates.
//
//   auto block = checkpoint::CheckpointWrapper(Block(64));      // any module with a forward
//   torch::Tensor y = block(x);                                // forward_any<R>(args...) too
//   auto outs = checkpoint::checkpoint(
//       [&](const std::vector<torch::Tensor>& in) { return std::vector{f(in[0], in[1], 0.5)}; },
//       {a, b});
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace fairscale::checkpoint {

struct CheckpointOptions {
  // Keep the saved boundary activations (the inputs of each checkpointed region) on the CPU
  // between forward and backward; they return to their device for the recompute. A no-op on CPU.
  TORCH_ARG(bool, offload_to_cpu) = false;
  // Save the RNG state at forward and replay it in the recompute (identical dropout masks).
  TORCH_ARG(bool, preserve_rng_state) = true;
};

using CheckpointFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// Runs fn(inputs) checkpointed. Inputs may be undefined or not require grad (their gradients are
// then undefined); outputs must be tensors (floating point outputs are differentiable).
// Non-tensor arguments are captured by fn. Nests: fn may itself call checkpoint().
std::vector<at::Tensor> checkpoint(const CheckpointFn& fn, const std::vector<at::Tensor>& inputs,
                                   const CheckpointOptions& options = {});

// One tensor in, one tensor out.
at::Tensor checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn,
                      const at::Tensor& input, const CheckpointOptions& options = {});

// True on this thread while a checkpointed forward runs (without grad) / while it is recomputed
// in backward (FairScale's is_checkpointing() / is_recomputing()).
bool is_checkpointing();
bool is_recomputing();

namespace internal {
template <typename T>
constexpr bool kIsTensor = std::is_same_v<std::decay_t<T>, at::Tensor>;

template <typename R>
std::vector<at::Tensor> ToVector(R&& r) {
  if constexpr (std::is_same_v<std::decay_t<R>, at::Tensor>) {
    return {std::forward<R>(r)};
  } else if constexpr (std::is_same_v<std::decay_t<R>, std::vector<at::Tensor>>) {
    return std::forward<R>(r);
  } else {
    return std::apply([](auto&&... t) { return std::vector<at::Tensor>{t...}; }, r);
  }
}

template <typename R, size_t... I>
R TupleFromVector(const std::vector<at::Tensor>& v, std::index_sequence<I...>) {
  return R{v.at(I)...};
}

template <typename R>
R FromVector(std::vector<at::Tensor> v) {
  if constexpr (std::is_same_v<R, at::Tensor>) {
    return v.at(0);
  } else if constexpr (std::is_same_v<R, std::vector<at::Tensor>>) {
    return v;
  } else {
    return TupleFromVector<R>(v, std::make_index_sequence<std::tuple_size_v<R>>{});
  }
}
}  // namespace internal

// Calls callable(args...) checkpointed: the at::Tensor arguments become the region's inputs, the
// others are captured by value. R: at::Tensor, std::vector<at::Tensor> or std::tuple of tensors.
template <typename R = at::Tensor, typename F, typename... Args>
R checkpoint_call(const CheckpointOptions& options, F callable, Args&&... args) {
  std::tuple<std::decay_t<Args>...> stored(std::forward<Args>(args)...);
  std::vector<at::Tensor> inputs;
  std::apply(
      [&](const auto&... a) {
        (
            [&](const auto& x) {
              if constexpr (internal::kIsTensor<decltype(x)>) inputs.push_back(x);
            }(a),
            ...);
      },
      stored);
  CheckpointFn fn = [callable, stored](const std::vector<at::Tensor>& in) mutable {
    auto call_args = stored;
    size_t k = 0;
    std::apply(
        [&](auto&... a) {
          (
              [&](auto& x) {
                if constexpr (internal::kIsTensor<decltype(x)>) x = in.at(k++);
              }(a),
              ...);
        },
        call_args);
    return internal::ToVector(std::apply(callable, std::move(call_args)));
  };
  return internal::FromVector<R>(checkpoint(fn, inputs, options));
}

// FairScale's checkpoint_wrapper: a module whose forward is the wrapped module's forward,
// checkpointed. Transparent for state: the wrapped module's parameters, buffers and children are
// registered under their own names, so named_parameters() / state_dict keys are unchanged.
// forward(x) (one tensor in, one out) is a plain method, so a CheckpointWrapper fits in a
// torch::nn::AnyModule, a Sequential and a FullyShardedDataParallel unit; other signatures go
// through forward_any<R>(args...), whose tensor arguments are the region's inputs and the others
// are captured (R: at::Tensor, std::vector<at::Tensor> or a std::tuple of tensors).
class CheckpointWrapperImpl : public torch::nn::Module {
 public:
  explicit CheckpointWrapperImpl(torch::nn::AnyModule module, CheckpointOptions options = {});
  template <typename ModuleType>
  explicit CheckpointWrapperImpl(torch::nn::ModuleHolder<ModuleType> module,
                                 CheckpointOptions options = {})
      : CheckpointWrapperImpl(torch::nn::AnyModule(std::move(module)), options) {}

  at::Tensor forward(const at::Tensor& x);

  template <typename R = at::Tensor, typename... Args>
  R forward_any(Args&&... args) {
    torch::nn::AnyModule m = module_;
    return checkpoint_call<R>(
        options_, [m](auto&&... a) mutable { return m.forward<R>(a...); },
        std::forward<Args>(args)...);
  }

  const torch::nn::AnyModule& module() const { return module_; }
  const CheckpointOptions& options() const { return options_; }
  void pretty_print(std::ostream& stream) const override;

 private:
  torch::nn::AnyModule module_;
  CheckpointOptions options_;
};
TORCH_MODULE(CheckpointWrapper);

// Applies blocks[0..n) in turn to x (each maps one tensor to one tensor); block i is checkpointed
// when i % every_k == 0 (every_k = 1: all; 2: blocks 0, 2, 4, ...; 0: none).
at::Tensor checkpoint_every_kth(std::vector<torch::nn::AnyModule>& blocks, at::Tensor x,
                                int64_t every_k, const CheckpointOptions& options = {});

}  // namespace fairscale::checkpoint
