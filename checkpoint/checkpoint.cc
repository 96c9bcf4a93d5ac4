#include "checkpoint/checkpoint.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/custom_class_detail.h>

#include <mutex>
#include <ostream>
#include <string>

namespace fairscale::checkpoint {
namespace {

thread_local int g_checkpointing = 0;
thread_local int g_recomputing = 0;

struct DepthGuard {
  explicit DepthGuard(int& depth) : depth_(depth) { ++depth_; }
  ~DepthGuard() { --depth_; }
  int& depth_;
};

struct AutocastState {
  bool cpu_enabled = false;
  at::ScalarType cpu_dtype = at::kBFloat16;
  bool gpu_enabled = false;
  at::ScalarType gpu_dtype = at::kHalf;

  static AutocastState Current() {
    return {at::autocast::is_cpu_enabled(), at::autocast::get_autocast_cpu_dtype(),
            at::autocast::is_enabled(), at::autocast::get_autocast_gpu_dtype()};
  }
  void Apply() const {
    at::autocast::set_cpu_enabled(cpu_enabled);
    at::autocast::set_autocast_cpu_dtype(cpu_dtype);
    at::autocast::set_enabled(gpu_enabled);
    at::autocast::set_autocast_gpu_dtype(gpu_dtype);
  }
};

// The states of the CPU generator and of every CUDA device's default generator.
struct RngState {
  at::Tensor cpu;
  std::vector<at::Tensor> cuda;

  static RngState Current() {
    RngState s;
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> lock(cpu.mutex());
      s.cpu = cpu.get_state();
    }
    if (at::hasCUDA()) {
      const auto& hooks = at::detail::getCUDAHooks();
      for (int64_t d = 0; d < hooks.getNumGPUs(); ++d) {
        at::Generator g = hooks.getDefaultCUDAGenerator(static_cast<c10::DeviceIndex>(d));
        std::lock_guard<std::mutex> lock(g.mutex());
        s.cuda.push_back(g.get_state());
      }
    }
    return s;
  }
  void Apply() const {
    at::Generator cpu_gen = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> lock(cpu_gen.mutex());
      cpu_gen.set_state(cpu);
    }
    if (!cuda.empty()) {
      const auto& hooks = at::detail::getCUDAHooks();
      for (size_t d = 0; d < cuda.size(); ++d) {
        at::Generator g = hooks.getDefaultCUDAGenerator(static_cast<c10::DeviceIndex>(d));
        std::lock_guard<std::mutex> lock(g.mutex());
        g.set_state(cuda[d]);
      }
    }
  }
};

// What the backward needs besides the saved inputs.
struct CheckpointState : torch::CustomClassHolder {
  CheckpointFn fn;
  CheckpointOptions options;
  RngState rng;
  AutocastState autocast;
  std::vector<bool> requires_grad;  // per input
  std::vector<c10::Device> devices;  // per input (offload_to_cpu moves them back)
};

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  // inputs.back() is the hidden zero-size tensor that requires grad.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<CheckpointState> state,
                                                at::TensorList inputs_and_dummy) {
    std::vector<at::Tensor> inputs(inputs_and_dummy.begin(), inputs_and_dummy.end() - 1);
    if (state->options.preserve_rng_state()) state->rng = RngState::Current();
    state->autocast = AutocastState::Current();
    std::vector<at::Tensor> saved;
    saved.reserve(inputs.size());
    for (const at::Tensor& x : inputs) {
      state->requires_grad.push_back(x.defined() && x.requires_grad());
      state->devices.push_back(x.defined() ? x.device() : c10::Device(c10::kCPU));
      if (x.defined() && state->options.offload_to_cpu()) {
        saved.push_back(x.detach().to(c10::Device(c10::kCPU), /*non_blocking=*/false));
      } else {
        saved.push_back(x);
      }
    }
    ctx->save_for_backward(saved);
    std::vector<at::Tensor> outputs;
    {
      DepthGuard checkpointing(g_checkpointing);
      at::NoGradGuard no_grad;
      outputs = state->fn(inputs);
    }
    for (const at::Tensor& y : outputs) {
      TORCH_CHECK(y.defined(), "checkpoint: fn returned an undefined tensor");
      if (!at::isFloatingType(y.scalar_type()) && !at::isComplexType(y.scalar_type())) {
        ctx->mark_non_differentiable({y});
      }
    }
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto state = c10::static_intrusive_pointer_cast<CheckpointState>(
        ctx->saved_data["state"].toCapsule());
    std::vector<at::Tensor> saved = ctx->get_saved_variables();
    std::vector<at::Tensor> inputs;
    inputs.reserve(saved.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      at::Tensor x = saved[i];
      if (x.defined()) {
        x = x.detach();
        if (x.device() != state->devices[i]) x = x.to(state->devices[i]);
        x.requires_grad_(state->requires_grad[i]);
      }
      inputs.push_back(x);
    }

    // Recompute with the forward's RNG and autocast state; the caller's state is restored after.
    std::vector<at::Tensor> outputs;
    {
      const RngState caller_rng =
          state->options.preserve_rng_state() ? RngState::Current() : RngState{};
      const AutocastState caller_autocast = AutocastState::Current();
      if (state->options.preserve_rng_state()) state->rng.Apply();
      state->autocast.Apply();
      try {
        DepthGuard recomputing(g_recomputing);
        at::AutoGradMode grad(true);
        outputs = state->fn(inputs);
      } catch (...) {
        if (state->options.preserve_rng_state()) caller_rng.Apply();
        caller_autocast.Apply();
        throw;
      }
      if (state->options.preserve_rng_state()) caller_rng.Apply();
      caller_autocast.Apply();
    }
    TORCH_CHECK(outputs.size() == grad_outputs.size(), "checkpoint: the recompute returned ",
                outputs.size(), " tensors, the forward ", grad_outputs.size());

    std::vector<at::Tensor> roots, grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].requires_grad() && grad_outputs[i].defined()) {
        roots.push_back(outputs[i]);
        grads.push_back(grad_outputs[i]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, grads);

    torch::autograd::variable_list result;
    result.reserve(inputs.size() + 2);
    result.emplace_back();  // the state argument
    for (size_t i = 0; i < inputs.size(); ++i) {
      result.push_back(state->requires_grad[i] ? inputs[i].grad() : at::Tensor());
    }
    result.emplace_back();  // the hidden tensor
    return result;
  }
};

}  // namespace

bool is_checkpointing() { return g_checkpointing > 0; }
bool is_recomputing() { return g_recomputing > 0; }

std::vector<at::Tensor> checkpoint(const CheckpointFn& fn, const std::vector<at::Tensor>& inputs,
                                   const CheckpointOptions& options) {
  TORCH_CHECK(fn, "checkpoint: fn is empty");
  if (!c10::GradMode::is_enabled()) return fn(inputs);
  auto state = c10::make_intrusive<CheckpointState>();
  state->options = options;
  // autograd::Function cannot take undefined tensors: only the defined ones go through it, and
  // fn sees the undefined ones again at their positions.
  std::vector<at::Tensor> with_dummy;
  std::vector<size_t> positions;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) continue;
    positions.push_back(i);
    with_dummy.push_back(inputs[i]);
  }
  if (positions.size() == inputs.size()) {
    state->fn = fn;
  } else {
    state->fn = [fn, positions, n = inputs.size()](const std::vector<at::Tensor>& defined) {
      std::vector<at::Tensor> all(n);
      for (size_t k = 0; k < positions.size(); ++k) all[positions[k]] = defined[k];
      return fn(all);
    };
  }
  with_dummy.push_back(at::empty({0}).requires_grad_(true));
  // As an at::TensorList: a std::vector would count as one non-tensor argument.
  return CheckpointFunction::apply(state, at::TensorList(with_dummy));
}

at::Tensor checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn,
                      const at::Tensor& input, const CheckpointOptions& options) {
  TORCH_CHECK(fn, "checkpoint: fn is empty");
  return checkpoint([fn](const std::vector<at::Tensor>& in) { return std::vector{fn(in[0])}; },
                    {input}, options)
      .at(0);
}

CheckpointWrapperImpl::CheckpointWrapperImpl(torch::nn::AnyModule module,
                                             CheckpointOptions options)
    : module_(std::move(module)), options_(options) {
  TORCH_CHECK(!module_.is_empty(), "CheckpointWrapper: empty module");
  const std::shared_ptr<torch::nn::Module> m = module_.ptr();
  for (const auto& p : m->named_parameters(/*recurse=*/false)) {
    register_parameter(p.key(), p.value(), p.value().requires_grad());
  }
  for (const auto& b : m->named_buffers(/*recurse=*/false)) register_buffer(b.key(), b.value());
  for (const auto& c : m->named_children()) register_module(c.key(), c.value());
}

at::Tensor CheckpointWrapperImpl::forward(const at::Tensor& x) {
  torch::nn::AnyModule m = module_;
  return checkpoint([m](const at::Tensor& in) mutable { return m.forward<at::Tensor>(in); }, x,
                    options_);
}

void CheckpointWrapperImpl::pretty_print(std::ostream& stream) const {
  stream << "fairscale::checkpoint::CheckpointWrapper(" << module_.ptr()->name()
         << (options_.offload_to_cpu() ? ", offload_to_cpu" : "") << ")";
}

at::Tensor checkpoint_every_kth(std::vector<torch::nn::AnyModule>& blocks, at::Tensor x,
                                int64_t every_k, const CheckpointOptions& options) {
  TORCH_CHECK(every_k >= 0, "checkpoint_every_kth: every_k must be >= 0, got ", every_k);
  for (size_t i = 0; i < blocks.size(); ++i) {
    torch::nn::AnyModule block = blocks[i];  // a copy sharing the module: the recompute needs it
    if (every_k > 0 && static_cast<int64_t>(i) % every_k == 0) {
      x = checkpoint(
          [block](const at::Tensor& in) mutable { return block.forward<at::Tensor>(in); }, x,
          options);
    } else {
      x = block.forward<at::Tensor>(x);
    }
  }
  return x;
}

}  // namespace fairscale::checkpoint
