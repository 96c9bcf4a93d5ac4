// fsdp::FullyShardedDataParallel: FairScale's fully sharded data parallel (ZeRO-2/3) for
// LibTorch modules (//fsdp). Training code wraps a module (or several nested ones) and builds its
// optimizer over the wrapper's parameters(), which are this rank's shards:
//
//   auto comm = ...;  // std::shared_ptr<comm::Communicator>, one per rank
//   fsdp::FullyShardedDataParallel model(
//       MyNet(), comm, fsdp::FsdpOptions().sharding_strategy(fsdp::ShardingStrategy::kFullShard));
//   torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
//   auto loss = model(x).pow(2).mean();   // forward(Args...) -> torch::Tensor by default
//   loss.backward();                      // gradients are reduced into the shards' .grad()
//   opt.step();
//
// Every rank must construct the same model with the same initial parameters (checked at
// construction; FsdpOptions::sync_module_states(true) broadcasts rank 0's instead) and call
// forward and backward on the same units in the same order (like every collective). See fsdp_options.h for
// the strategies. Nested wrapping: construct the inner FullyShardedDataParallel modules first and
// register them in their parent module as usual; the outer one shards only what is left and
// drives the nested ones (one root per model: the outermost wrapper whose forward is called).
// wrap.h decides the nesting by policy (size, module type); local_checkpoint.h saves and
// restores each rank's shards with its optimizer state.
//
// With FsdpOptions::flatten_parameters(false) (the per-parameter layout of PyTorch's FSDP2)
// the wrapper's named_parameters() are the wrapped module's own parameter tensors under their
// own names, each holding this rank's rows of its dim 0 between steps, so param groups work:
//
//   auto opts = fsdp::FsdpOptions().flatten_parameters(false);
//   fsdp::FullyShardedDataParallel model(MyNet(), comm, opts);
//   std::vector<torch::Tensor> decay, no_decay;  // e.g. no weight decay on biases and norms
//   for (auto& p : model->named_parameters()) {
//     if (!p.value().requires_grad()) continue;  // frozen: no gradient, no reduction
//     (p.value().dim() >= 2 ? decay : no_decay).push_back(p.value());
//   }
//
// (see fsdp/README.md for the whole example).
//
// How it hooks into LibTorch (which has no module hooks): forward() all-gathers the unit's flat
// parameter before calling the wrapped module (per-parameter layout: into a staging buffer,
// copied out into the parameters, which set_data points at their full values until the unit's
// backward is done and then back at their rows); hooks on the outputs re-gather it when backward
// reaches the unit; a hook on each original parameter's AccumulateGrad node collects its
// gradient into the unit's flat gradient and issues the reduce-scatter once the unit's last
// gradient arrived, and then completes the reductions issued before it (at most one stays in
// flight, so full gradients do not pile up); a callback queued on the autograd engine waits for
// the rest, fills the shards' .grad() and frees the full parameters at the end of backward.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "fsdp/fsdp_options.h"
#include "fsdp/flat_param_info.h"
#include "fsdp/local_grad_hook.h"

namespace fairscale::fsdp {

class FullyShardedDataParallelImpl;

namespace internal {
class Unit;  // the engine of one unit (internal/unit.h)

// The tensors of a forward's result, for the pre-backward hooks. Supported results: a Tensor, and
// std::vector / std::tuple / std::pair of supported results.
inline void CollectTensors(const at::Tensor& t, std::vector<at::Tensor>& out) { out.push_back(t); }
template <typename T>
void CollectTensors(const std::vector<T>& v, std::vector<at::Tensor>& out);
template <typename A, typename B>
void CollectTensors(const std::pair<A, B>& p, std::vector<at::Tensor>& out);
template <typename... Ts>
void CollectTensors(const std::tuple<Ts...>& t, std::vector<at::Tensor>& out);
template <typename T>
struct DependentFalse : std::false_type {};
template <typename T>
void CollectTensors(const T&, std::vector<at::Tensor>&) {
  // Without the output tensors FSDP cannot tell when backward reaches the unit.
  static_assert(DependentFalse<T>::value,
                "FullyShardedDataParallel::forward<ReturnType>: ReturnType must be a Tensor or a "
                "std::vector/std::tuple/std::pair of Tensors");
}
template <typename T>
void CollectTensors(const std::vector<T>& v, std::vector<at::Tensor>& out) {
  for (const auto& e : v) CollectTensors(e, out);
}
template <typename A, typename B>
void CollectTensors(const std::pair<A, B>& p, std::vector<at::Tensor>& out) {
  CollectTensors(p.first, out);
  CollectTensors(p.second, out);
}
template <typename... Ts>
void CollectTensors(const std::tuple<Ts...>& t, std::vector<at::Tensor>& out) {
  std::apply([&](const auto&... e) { (CollectTensors(e, out), ...); }, t);
}
}  // namespace internal

// FairScale's local_state_dict(): what one rank holds, loadable only into an identically
// wrapped model at the same world size and rank (the cheap, communication-free checkpoint; a
// full state dict is the portable one). Tensors are copies, detached from the model.
struct LocalStateDict {
  struct Shard {
    std::string unit;  // the unit's prefix() ("" for the root)
    ShardingStrategy sharding_strategy = ShardingStrategy::kFullShard;
    FlatParamInfo info;  // names, shapes, numels, offsets and padding of the flat parameter
    at::Tensor tensor;   // this rank's shard (info.shard_numel elements)
  };
  int rank = 0;
  int world_size = 1;
  std::vector<Shard> shards;  // every flat parameter of every unit, parents before children
  std::vector<std::pair<std::string, at::Tensor>> buffers;  // full buffers, by full name
};

class FullyShardedDataParallelImpl : public torch::nn::Module {
 public:
  // Shards `module`'s parameters (those not owned by nested FullyShardedDataParallel modules
  // nor in FsdpOptions::ignored_modules) over `comm` and broadcasts its buffers from rank 0.
  // Collective: every rank constructs its wrappers in the same order. Raises c10::Error on bad
  // input (naming the parameter or ignored module, and the rank).
  FullyShardedDataParallelImpl(torch::nn::AnyModule module,
                               std::shared_ptr<comm::Communicator> comm, FsdpOptions options = {});
  template <typename M>
  FullyShardedDataParallelImpl(torch::nn::ModuleHolder<M> module,
                               std::shared_ptr<comm::Communicator> comm, FsdpOptions options = {})
      : FullyShardedDataParallelImpl(torch::nn::AnyModule(std::move(module)), std::move(comm),
                                     std::move(options)) {}
  template <typename M, typename = std::enable_if_t<std::is_base_of_v<torch::nn::Module, M>>>
  FullyShardedDataParallelImpl(std::shared_ptr<M> module, std::shared_ptr<comm::Communicator> comm,
                               FsdpOptions options = {})
      : FullyShardedDataParallelImpl(torch::nn::AnyModule(std::move(module)), std::move(comm),
                                     std::move(options)) {}
  ~FullyShardedDataParallelImpl() override;

  // Calls the wrapped module's forward with `args` (their types must match its signature exactly,
  // as with torch::nn::AnyModule) and returns its result as ReturnType, e.g.
  //   auto [a, b] = model->forward<std::tuple<torch::Tensor, torch::Tensor>>(x, y);
  template <typename ReturnType = torch::Tensor, typename... Args>
  ReturnType forward(Args&&... args) {
    pre_forward();
    std::vector<at::Tensor> outputs;
    try {
      ReturnType result = module_any_.forward<ReturnType>(cast_input(std::forward<Args>(args))...);
      internal::CollectTensors(result, outputs);
      post_forward(outputs);
      return result;
    } catch (...) {
      forward_failed();
      throw;
    }
  }

  // Also switches the wrapped module (it is not a registered child, see module()).
  void train(bool on = true) override;
  void pretty_print(std::ostream& stream) const override;

  // The wrapped module. Its parameters are views into this unit's full flat parameter: they hold
  // valid values only inside forward/backward and summon_full_params; between steps their
  // storage is freed (kFullShard, kShardGradOp). It is deliberately not a registered child, so
  // parameters() lists only the shards (and named_parameters() the names of the flat params).
  // With flatten_parameters(false) its parameters hold this rank's rows between steps (full
  // values inside forward/backward and summon_full_params), and the wrapper registers its
  // parameters, buffers and children under their own names instead: named_parameters() then
  // lists the same tensors as module()->named_parameters(), nested units included, less those
  // of FsdpOptions::ignored_modules (a child holding an ignored module is shown by a stand-in
  // module with the same names).
  const std::shared_ptr<torch::nn::Module>& module() const { return module_; }
  const FsdpOptions& options() const;
  const std::shared_ptr<comm::Communicator>& communicator() const;
  int rank() const;
  int world_size() const;
  // The ranks that shard this unit's flat parameters: communicator() itself, or the HYBRID_SHARD
  // shard group. The replicate group (null unless hybrid with more than one group) joins the
  // ranks holding the same shard; replicate_rank() is 0 and replicate_world_size() 1 without.
  const std::shared_ptr<comm::Communicator>& shard_communicator() const;
  const std::shared_ptr<comm::Communicator>& replicate_communicator() const;
  int shard_rank() const;
  int shard_world_size() const;
  int replicate_rank() const;
  int replicate_world_size() const;

  // Gradient accumulation without communication, FairScale's no_sync(): while the returned
  // guard lives, backward passes accumulate full (unsharded) gradients on each rank and reduce
  // nothing; the first backward after the guard is gone reduces everything accumulated.
  // Costs a full gradient per unit of memory. Root only, outside forward/backward.
  class NoSyncGuard {
   public:
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;
    ~NoSyncGuard();

   private:
    friend class FullyShardedDataParallelImpl;
    NoSyncGuard(FullyShardedDataParallelImpl* root, bool previous)
        : root_(root), previous_(previous) {}
    FullyShardedDataParallelImpl* root_;
    bool previous_;
  };
  NoSyncGuard no_sync();

  // Scales the gradients of every unit so that their global norm (over all shards of all ranks,
  // computed exactly: each rank's partial sum, then one all-reduce) is at most `max_norm`, like
  // torch::nn::utils::clip_grad_norm_; `norm_type` may be any p > 0 or infinity. Returns the
  // norm before clipping. Collective; root only, after backward and outside no_sync.
  // FsdpOptions::ignored_modules' gradients are neither counted nor scaled: combine your own
  // norm of them with the returned one.
  at::Tensor clip_grad_norm_(double max_norm, double norm_type = 2.0);

  // Observes each rank's own gradients before any reduction (see local_grad_hook.h): at the end
  // of every backward pass (also under no_sync()) `hook` gets this rank's squared L2 norm of
  // that backward's unsharded gradient of every trainable tensor the optimizer steps (flat
  // shards, or per-parameter the parameters), in f64. For statistics a reduce-scatter would
  // hide (AdaScale's gradient variance: //adascale:fsdp). Costs one f64 sum of squares per
  // parameter gradient per backward while registered. One hook per root: registering a second
  // raises (remove the first); nested units cannot have one. Root only, outside
  // forward/backward; no communication.
  void register_local_grad_hook(LocalGradHook hook);
  void remove_local_grad_hook();
  bool has_local_grad_hook() const;

  // Makes the full parameters of this unit and its nested units available in module() while
  // the returned guard lives (e.g. for evaluation, inspection or initialization after wrapping).
  // With `writeback`, each rank copies its slice of the (possibly modified) full parameters
  // back into its shard when the guard goes; without, changes are discarded (also for
  // kNoShard, whose parameters are the shard itself). Collective; not inside forward/backward,
  // and forward may not run while it lives. Between a forward and its backward it is allowed
  // (backward gathers again), but a writeback there makes the gradients those of the old values.
  class FullParamsGuard {
   public:
    FullParamsGuard(const FullParamsGuard&) = delete;
    FullParamsGuard& operator=(const FullParamsGuard&) = delete;
    ~FullParamsGuard();

   private:
    friend class FullyShardedDataParallelImpl;
    FullParamsGuard(std::vector<FullyShardedDataParallelImpl*> units, bool writeback,
                    std::vector<at::Tensor> snapshots)
        : units_(std::move(units)), writeback_(writeback), snapshots_(std::move(snapshots)) {}
    std::vector<FullyShardedDataParallelImpl*> units_;
    bool writeback_;
    std::vector<at::Tensor> snapshots_;  // kNoShard shards, restored when !writeback
  };
  FullParamsGuard summon_full_params(bool writeback = true);

  // This unit's position in the root's wrapped module, "" for the root, "blocks.0." for a unit
  // nested there (known once the root's first forward ran; "" before).
  const std::string& prefix() const;
  // This unit and every unit nested in it, parents before children.
  std::vector<FullyShardedDataParallelImpl*> fsdp_units();
  std::vector<FlatParamInfo> flat_param_info() const;
  // This rank's shard of each flat parameter (flat_param_info() order) and the original
  // parameter tensor of each of its entries (what an optimizer steps when
  // flatten_parameters(false); their values are this rank's rows between steps).
  struct FlatShard {
    at::Tensor shard;
    std::vector<at::Tensor> params;
  };
  std::vector<FlatShard> flat_shards() const;
  // Every unit of the model this root drives, parents before children, with their prefix()es
  // set (initializes the root on first use, as forward would). Root only; no communication.
  std::vector<FullyShardedDataParallelImpl*> root_units();
  // Whether this unit keeps only a shard of its flat parameters (see sharded()).
  bool is_sharded() const;

  // FsdpOptions::ignored_modules: the parameters this unit and its nested units leave alone
  // (each once, in module order), for the caller's own optimizer; and whether this unit
  // ignores a module (one of its ignored modules or a module inside one) or a parameter.
  std::vector<at::Tensor> ignored_parameters();
  bool ignores(const torch::nn::Module& module) const;
  bool ignores(const at::Tensor& parameter) const;

  // This rank's shards of every unit plus their layout and the model's buffers (root only,
  // outside forward/backward; no communication). See LocalStateDict, and local_checkpoint.h
  // for saving it to a file together with the optimizer state.
  LocalStateDict local_state_dict();
  // Copies `state`'s shards and buffers into this model and frees any gathered full
  // parameters. Checks first, and raises c10::Error naming what differs (world size, rank,
  // units, flat parameters, their entries, names, shapes, strategy or padding) before changing
  // anything.
  void load_local_state_dict(const LocalStateDict& state);

 private:
  struct Nested {
    std::string path;  // in module_: "blocks.0"
    std::shared_ptr<FullyShardedDataParallelImpl> unit;
  };

  // Mixed precision: floating-point tensor arguments of forward go in the compute dtype.
  template <typename T>
  decltype(auto) cast_input(T&& arg) const {
    if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
      return cast_tensor(arg);
    } else {
      return std::forward<T>(arg);
    }
  }
  at::Tensor cast_tensor(const at::Tensor& t) const;
  bool is_root() const;
  std::string label() const;  // "FSDP unit 'blocks.0.' (Block) rank 1/4"
  // The engine's hooks around the wrapped forward (internal/coordinator.h).
  void pre_forward();
  void post_forward(const std::vector<at::Tensor>& outputs);
  void forward_failed();
  // Checks that this unit can serve as a root outside forward/backward (making it the root on
  // first use); `what` names the operation in the errors.
  void check_root_idle(const char* what);
  // The constructor's parts: find the parameters, buffers and nested units of module_, shard
  // them, and register what the wrapper shows (the flat parameters and nested units, or the
  // module's own parameters, buffers and children with flatten_parameters(false)).
  // FsdpOptions::ignored_modules: checks them and records what they hold (before shard_module).
  void collect_ignored();
  void shard_module();
  void register_nested();
  void register_original();

  torch::nn::AnyModule module_any_;
  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<internal::Unit> unit_;
  std::vector<Nested> nested_;
  // The ignored modules with everything below them, and their parameters (module order).
  std::set<const torch::nn::Module*> ignored_modules_;
  std::set<const c10::TensorImpl*> ignored_param_impls_;
  std::vector<at::Tensor> ignored_params_;
};

// The ModuleHolder, as TORCH_MODULE would write it, plus a call operator: ModuleHolder's own
// cannot see a forward() that is a template. `model(x)` returns a Tensor;
// `model.operator()<ReturnType>(args...)` or `model->forward<ReturnType>(args...)` anything else.
// Because forward() is a template, a FullyShardedDataParallel cannot be stored in a
// torch::nn::AnyModule (nor a Sequential): call it from your module's forward.
class FullyShardedDataParallel : public torch::nn::ModuleHolder<FullyShardedDataParallelImpl> {
 public:
  using torch::nn::ModuleHolder<FullyShardedDataParallelImpl>::ModuleHolder;
  using Impl = FullyShardedDataParallelImpl;

  template <typename ReturnType = torch::Tensor, typename... Args>
  ReturnType operator()(Args&&... args) {
    return get()->template forward<ReturnType>(std::forward<Args>(args)...);
  }
};

}  // namespace fairscale::fsdp
