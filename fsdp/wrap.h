// Policy-driven wrapping (//fsdp): FairScale's enable_wrap / wrap / auto_wrap for LibTorch.
//
// The C++ shape, and why: FairScale's auto_wrap walks a finished model and replaces children by
// FSDP wrappers. In LibTorch that cannot work in general: a FullyShardedDataParallel's forward is
// a template, so it cannot live in a torch::nn::AnyModule, Sequential or ModuleList, and a
// parent's forward calls its children through typed members that a walk cannot swap. So the
// wrapping happens where the child is created: the model's constructor passes each candidate
// child through fsdp::wrap(), which returns a Wrapped handle (the FSDP unit or the plain module)
// that the parent registers and calls. Whether it wraps is decided by the innermost EnableWrap
// scope of the calling thread (threads are ranks in tests, so the scope is thread-local):
//
//   class NetImpl : public torch::nn::Module {
//     NetImpl() {
//       for (int i = 0; i < 4; ++i) {
//         blocks_.push_back(fsdp::wrap(Block(dim)));  // wraps or not, per the scope's policy
//         register_module("block" + std::to_string(i), blocks_.back().ptr());
//       }
//     }
//     torch::Tensor forward(torch::Tensor x) { for (auto& b : blocks_) x = b(x); return x; }
//     std::vector<fsdp::Wrapped> blocks_;
//   };
//   {
//     fsdp::EnableWrap scope(comm, opts, fsdp::module_type_auto_wrap_policy<BlockImpl>());
//     fsdp::FullyShardedDataParallel model(Net(), comm, opts);  // the root wraps what is left
//   }
//
// Outside any scope wrap() returns the plain module, so the same class builds the single-process
// model. Only modules passed to wrap() are candidates (it is not recursive); children are built
// before their parents, so the wrapping is bottom-up as in FairScale.
#pragma once

#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <type_traits>
#include <utility>

#include "comm/communicator.h"
#include "fsdp/fsdp_options.h"
#include "fsdp/fully_sharded_data_parallel.h"

namespace fairscale::fsdp {

// Decides whether wrap() wraps `module`. `unwrapped_numel`: the number of elements of the
// module's distinct parameters that no nested FSDP unit owns yet and that are not in the scope's
// FsdpOptions::ignored_modules. wrap() never wraps an ignored module, and gives each unit it
// creates the scope's ignored modules that lie inside it (ignored_modules' nesting rule).
using AutoWrapPolicy =
    std::function<bool(const torch::nn::Module& module, int64_t unwrapped_numel)>;

// FairScale's default_auto_wrap_policy: wrap when at least `min_num_params` elements are left.
AutoWrapPolicy size_based_auto_wrap_policy(int64_t min_num_params);

// Wraps every module of one of the given types (Impl or ModuleHolder types), e.g. transformer
// blocks: module_type_auto_wrap_policy<BlockImpl, torch::nn::Embedding>().
namespace internal {
// The Impl type of an Impl or ModuleHolder type.
template <typename M, typename = void>
struct ImplOf {
  using type = M;
};
template <typename M>
struct ImplOf<M, std::void_t<typename M::ContainedType>> {
  using type = typename M::ContainedType;
};
}  // namespace internal

template <typename... Modules>
AutoWrapPolicy module_type_auto_wrap_policy() {
  return [](const torch::nn::Module& module, int64_t) {
    return ((dynamic_cast<const typename internal::ImplOf<Modules>::type*>(&module) != nullptr) ||
            ...);
  };
}

// While alive, wrap() on this thread wraps over `comm` with `options`: every module when
// `policy` is null, else those the policy accepts. Scopes nest; the innermost one applies.
class EnableWrap {
 public:
  EnableWrap(std::shared_ptr<comm::Communicator> comm, FsdpOptions options = {},
             AutoWrapPolicy policy = nullptr);
  ~EnableWrap();
  EnableWrap(const EnableWrap&) = delete;
  EnableWrap& operator=(const EnableWrap&) = delete;

 private:
  friend class WrapAccess;
  std::shared_ptr<comm::Communicator> comm_;
  FsdpOptions options_;
  AutoWrapPolicy policy_;
  EnableWrap* previous_;
};

// What wrap() returns: a FullyShardedDataParallel unit or the plain module, called the same way.
// Register ptr() in the parent (register_module) and call it from the parent's forward.
class Wrapped {
 public:
  Wrapped() = default;
  bool is_wrapped() const { return !unit_.is_empty(); }
  // The module to register: the FSDP unit when wrapped, else the module itself.
  const std::shared_ptr<torch::nn::Module>& ptr() const { return ptr_; }
  // The FSDP unit (empty holder when not wrapped).
  const FullyShardedDataParallel& unit() const { return unit_; }

  template <typename ReturnType = torch::Tensor, typename... Args>
  ReturnType forward(Args&&... args) {
    if (is_wrapped()) return unit_->forward<ReturnType>(std::forward<Args>(args)...);
    return plain_.forward<ReturnType>(std::forward<Args>(args)...);
  }
  template <typename ReturnType = torch::Tensor, typename... Args>
  ReturnType operator()(Args&&... args) {
    return forward<ReturnType>(std::forward<Args>(args)...);
  }

 private:
  friend Wrapped wrap_any(torch::nn::AnyModule module);
  FullyShardedDataParallel unit_{nullptr};
  torch::nn::AnyModule plain_;
  std::shared_ptr<torch::nn::Module> ptr_;
};

// See the file comment. The module must have a (non-template) forward, as AnyModule requires.
Wrapped wrap_any(torch::nn::AnyModule module);
template <typename M>
Wrapped wrap(torch::nn::ModuleHolder<M> module) {
  return wrap_any(torch::nn::AnyModule(std::move(module)));
}
template <typename M, typename = std::enable_if_t<std::is_base_of_v<torch::nn::Module, M>>>
Wrapped wrap(std::shared_ptr<M> module) {
  return wrap_any(torch::nn::AnyModule(std::move(module)));
}

// The number of elements of `module`'s distinct parameters outside nested FSDP units.
int64_t unwrapped_numel(const torch::nn::Module& module);

}  // namespace fairscale::fsdp
