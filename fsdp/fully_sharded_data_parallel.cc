#include "fsdp/fully_sharded_data_parallel.h"

#include <ATen/Context.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <ostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "comm/torch/tensor_buffer.h"
#include "fsdp/internal/errors.h"
#include "fsdp/internal/hybrid_groups.h"
#include "fsdp/internal/param_ranges.h"
#include "fsdp/internal/root_state.h"
#include "fsdp/internal/unit_util.h"

namespace fairscale::fsdp {

const char* ShardingStrategyName(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kFullShard:
      return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp:
      return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard:
      return "NO_SHARD";
    case ShardingStrategy::kHybridShard:
      return "HYBRID_SHARD";
    case ShardingStrategy::kHybridShardZero2:
      return "_HYBRID_SHARD_ZERO2";
  }
  return "?";
}

const char* BackwardPrefetchName(BackwardPrefetch mode) {
  switch (mode) {
    case BackwardPrefetch::kNone:
      return "NONE";
    case BackwardPrefetch::kBackwardPre:
      return "BACKWARD_PRE";
    case BackwardPrefetch::kBackwardPost:
      return "BACKWARD_POST";
  }
  return "?";
}

double default_gradient_predivide_factor(int world_size) {
  int factor = 1;
  while (world_size % factor == 0 && world_size / factor > factor) factor *= 2;
  return factor;
}

namespace internal {

// Runs after a parameter's AccumulateGrad node: hands the gradient to its unit.
class PostBackwardHook : public torch::autograd::FunctionPostHook {
 public:
  PostBackwardHook(std::weak_ptr<FullyShardedDataParallelImpl*> unit, size_t flat, size_t slot)
      : unit_(std::move(unit)), flat_(flat), slot_(slot) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto unit = unit_.lock()) (*unit)->on_param_grad(flat_, slot_);
    return outputs;
  }

 private:
  std::weak_ptr<FullyShardedDataParallelImpl*> unit_;
  size_t flat_;
  size_t slot_;
};

namespace {

// An empty module that holds nested units under their dotted path ("blocks" -> "0" -> unit).
class PathModule : public torch::nn::Module {
 public:
  PathModule() : torch::nn::Module("FsdpPath") {}
  std::shared_ptr<torch::nn::Module> add(const std::string& name,
                                         std::shared_ptr<torch::nn::Module> m) {
    return register_module(name, std::move(m));
  }
};

}  // namespace
}  // namespace internal

using internal::FlatParam;
using internal::ParamSlot;
using internal::ThrowIfError;

FullyShardedDataParallelImpl::FullyShardedDataParallelImpl(torch::nn::AnyModule module,
                                                           std::shared_ptr<comm::Communicator> comm,
                                                           FsdpOptions options)
    : torch::nn::Module("fairscale::fsdp::FullyShardedDataParallel"),
      module_any_(std::move(module)),
      comm_(std::move(comm)),
      options_(std::move(options)) {
  TORCH_CHECK(comm_ != nullptr, "FullyShardedDataParallel: the communicator is null");
  TORCH_CHECK(!module_any_.is_empty(), "FullyShardedDataParallel: the module is empty");
  TORCH_CHECK(options_.reductions_in_flight() >= 0,
              "FullyShardedDataParallel: reductions_in_flight must be >= 0, got ",
              options_.reductions_in_flight());
  TORCH_CHECK(options_.all_gathers_in_flight() >= 0,
              "FullyShardedDataParallel: all_gathers_in_flight must be >= 0 (0 = unlimited), got ",
              options_.all_gathers_in_flight());
  TORCH_CHECK(!options_.move_grads_to_cpu_set() ||
                  options_.move_grads_to_cpu() == options_.move_params_to_cpu(),
              "FullyShardedDataParallel: move_grads_to_cpu(", options_.move_grads_to_cpu(),
              ") with move_params_to_cpu(", options_.move_params_to_cpu(),
              "): the optimizer steps the shard where it lives, so its gradient must be there too; "
              "leave move_grads_to_cpu unset (it follows move_params_to_cpu)");
  if (const auto& device = options_.compute_device()) {
    TORCH_CHECK(device->is_cpu() || (device->is_cuda() && at::hasCUDA()),
                "FullyShardedDataParallel: compute_device ", *device,
                " is not available (this LibTorch ",
                at::hasCUDA() ? "has CUDA" : "has no CUDA or sees no GPU", ")");
  }
  const auto bp = options_.backward_prefetch();
  TORCH_CHECK(bp == BackwardPrefetch::kNone || bp == BackwardPrefetch::kBackwardPre ||
                  bp == BackwardPrefetch::kBackwardPost,
              "FullyShardedDataParallel: backward_prefetch is not a BackwardPrefetch value: ",
              static_cast<int>(bp));
  module_ = module_any_.ptr();
  rank_ = comm_->rank();
  world_ = comm_->size();
  TORCH_CHECK(dynamic_cast<FullyShardedDataParallelImpl*>(module_.get()) == nullptr, label(),
              ": wrapping a FullyShardedDataParallel directly in another is not supported");
  alive_ = std::make_shared<FullyShardedDataParallelImpl*>(this);
  init_groups();
  collect_and_shard();
  if (options_.flatten_parameters()) {
    register_nested();
  } else {
    register_original();
  }
}

FullyShardedDataParallelImpl::~FullyShardedDataParallelImpl() {
  alive_.reset();
  if (state_) {
    auto& g = state_->gathering;
    g.erase(std::remove(g.begin(), g.end(), this), g.end());
  }
  for (FlatParam& fp : flats_) {
    // The communicator may still write into `full`: wait before the memory goes.
    if (fp.gather_pending) {
      fp.gather_work.Wait().IgnoreError();
      if (state_) --state_->gathers_in_flight;
    }
    for (ParamSlot& slot : fp.slots) {
      if (slot.grad_accumulator) slot.grad_accumulator->del_post_hook(slot.hook_key);
    }
  }
  if (state_ && state_->root == this) {
    for (auto& p : state_->pending) p.work.Wait().IgnoreError();
  }
}

void FullyShardedDataParallelImpl::init_groups() {
  const ShardingStrategy strategy = options_.sharding_strategy();
  const int group_size = options_.hybrid_shard_group_size();
  const bool explicit_groups =
      options_.hybrid_shard_comm() != nullptr || options_.hybrid_replicate_comm() != nullptr;
  shard_comm_ = comm_;
  if (!IsHybrid(strategy)) {
    TORCH_CHECK(group_size == 0 && !explicit_groups, label(),
                ": hybrid_shard_group_size / hybrid_shard_groups are for HYBRID_SHARD and "
                "_HYBRID_SHARD_ZERO2, the sharding strategy is ",
                ShardingStrategyName(strategy));
  } else {
    TORCH_CHECK(group_size >= 0, label(), ": hybrid_shard_group_size must be >= 0 (0 = by host), got ",
                group_size);
    TORCH_CHECK(group_size == 0 || !explicit_groups, label(),
                ": give either hybrid_shard_group_size (", group_size,
                ") or hybrid_shard_groups, not both");
    TORCH_CHECK(group_size == 0 || world_ % group_size == 0, label(),
                ": hybrid_shard_group_size ", group_size, " does not divide the world size ",
                world_);
    internal::HybridGroups groups;
    if (explicit_groups) {
      groups = {options_.hybrid_shard_comm(), options_.hybrid_replicate_comm()};
      ThrowIfError(internal::CheckHybridGroups(comm_, groups), label());
    } else {
      groups = internal::ValueOrThrow(internal::SharedHybridGroups(comm_, group_size),
                                      label() + ": making the HYBRID_SHARD groups");
    }
    shard_comm_ = groups.shard;
    if (groups.replicate->size() > 1) replicate_comm_ = groups.replicate;
  }
  shard_rank_ = shard_comm_->rank();
  shard_world_ = shard_comm_->size();
  replicate_rank_ = replicate_comm_ ? replicate_comm_->rank() : 0;
  replicate_world_ = replicate_comm_ ? replicate_comm_->size() : 1;
}

std::string FullyShardedDataParallelImpl::label() const {
  return absl::StrCat("FSDP unit '", prefix_, "' (", module_ ? module_->name() : "?", ") rank ",
                      rank_, "/", world_);
}

bool FullyShardedDataParallelImpl::is_root() const { return state_ && state_->root == this; }

void FullyShardedDataParallelImpl::collect_and_shard() {
  // Walk the wrapped module; stop at nested units, which own their subtree.
  std::vector<std::pair<std::string, at::Tensor>> params;
  std::vector<std::pair<std::string, at::Tensor>> buffers;
  std::function<void(const std::shared_ptr<torch::nn::Module>&, const std::string&)> visit =
      [&](const std::shared_ptr<torch::nn::Module>& m, const std::string& path) {
        for (const auto& item : m->named_parameters(/*recurse=*/false)) {
          params.emplace_back(path + item.key(), item.value());
        }
        for (const auto& item : m->named_buffers(/*recurse=*/false)) {
          buffers.emplace_back(path + item.key(), item.value());
        }
        for (const auto& child : m->named_children()) {
          const std::string child_path = path + child.key();
          if (auto unit = std::dynamic_pointer_cast<FullyShardedDataParallelImpl>(child.value())) {
            bool seen = false;
            for (const Nested& n : nested_) seen = seen || n.unit == unit;
            if (!seen) nested_.push_back({child_path, unit});
            continue;
          }
          visit(child.value(), child_path + ".");
        }
      };
  visit(module_, "");

  // Parameters owned by nested units may not appear here (tied across units).
  std::map<const c10::TensorImpl*, std::string> nested_owned;
  for (const Nested& n : nested_) {
    TORCH_CHECK(n.unit->comm_ == comm_, label(), ": nested unit '", n.path,
                "' uses a different communicator; all units of a model must share one");
    for (const auto& [impl, name] : n.unit->owned_params_) {
      nested_owned.emplace(impl, n.path + "." + name);
      owned_params_.emplace_back(impl, n.path + "." + name);
    }
  }

  // Distinct parameters in registration order; a tensor registered twice (tied) is one slot.
  std::vector<ParamSlot> trainable;
  std::vector<ParamSlot> frozen;
  std::map<const c10::TensorImpl*, std::pair<bool, size_t>> index;
  for (const auto& [name, p] : params) {
    const c10::TensorImpl* impl = p.unsafeGetTensorImpl();
    auto owned = nested_owned.find(impl);
    TORCH_CHECK(owned == nested_owned.end(), label(), ": parameter '", name,
                "' is the same tensor as '", owned == nested_owned.end() ? "" : owned->second,
                "', which a nested FullyShardedDataParallel owns. Tied weights must be wrapped in "
                "the same unit: wrap their common parent instead");
    auto it = index.find(impl);
    if (it != index.end()) {
      auto& list = it->second.first ? trainable : frozen;
      list[it->second.second].aliases.push_back(name);
      continue;
    }
    TORCH_CHECK(p.is_floating_point(), label(), ": parameter '", name, "' has dtype ",
                p.scalar_type(), "; FSDP shards floating-point parameters only");
    auto& list = p.requires_grad() ? trainable : frozen;
    index.emplace(impl, std::make_pair(p.requires_grad(), list.size()));
    ParamSlot slot;
    slot.name = name;
    slot.param = p;
    slot.shape = p.sizes().vec();
    slot.numel = p.numel();
    list.push_back(std::move(slot));
  }

  c10::NoGradGuard no_grad;
  for (int kind = 0; kind < 2; ++kind) {
    std::vector<ParamSlot>& slots = kind == 0 ? trainable : frozen;
    if (slots.empty()) continue;
    const at::Tensor& first = slots.front().param;
    FlatParam& fp = flats_.emplace_back();
    fp.requires_grad = kind == 0;
    for (ParamSlot& slot : slots) {
      TORCH_CHECK(
          slot.param.scalar_type() == first.scalar_type() && slot.param.device() == first.device(),
          label(), ": parameter '", slot.name, "' is ", slot.param.scalar_type(), " on ",
          slot.param.device(), " but '", slots.front().name, "' is ", first.scalar_type(), " on ",
          first.device(), "; a unit's parameters are flattened into one tensor and must agree");
      slot.offset = fp.numel;
      fp.numel += slot.numel;
    }
    const auto& mp = options_.mixed_precision();
    fp.mixed = mp.param_dtype().has_value() && *mp.param_dtype() != first.scalar_type();
    fp.reduce_dtype = mp.reduce_dtype().value_or(fp.mixed ? *mp.param_dtype() : first.scalar_type());
    const c10::Device compute = options_.compute_device().value_or(first.device());
    TORCH_CHECK(compute == first.device() ||
                    (options_.move_params_to_cpu() && first.device().is_cpu()),
                label(), ": the parameters are on ", first.device(), " but compute_device is ",
                compute, "; move them there first (or, with move_params_to_cpu, keep them on the CPU)");
    fp.offloaded = options_.move_params_to_cpu() &&
                   (!compute.is_cpu() || internal::OffloadOnCpuForTesting());
    fp.separate = fp.mixed || fp.offloaded;
    if (!options_.flatten_parameters()) {
      TORCH_CHECK(!fp.offloaded, label(),
                  ": move_params_to_cpu with a compute device other than the CPU is implemented "
                  "for the flat layout only (flatten_parameters(true))");
      init_dim0(fp, slots);  // the shard, `full`, and the parameters pointed at `full`
    } else {
      if (sharded()) {
        fp.shard_numel = internal::ShardNumel(fp.numel, shard_world_);
        fp.padded_numel = fp.shard_numel * shard_world_;
        fp.shard_offset = shard_rank_ * fp.shard_numel;
      } else {
        fp.shard_numel = fp.padded_numel = fp.numel;
      }
      // The master values in the parameters' own dtype; `full` is the same tensor unless mixed
      // precision computes in another dtype or the shard is offloaded to the CPU.
      at::Tensor master = at::zeros({fp.padded_numel}, first.options().requires_grad(false));
      for (ParamSlot& slot : slots) {
        master.narrow(0, slot.offset, slot.numel).copy_(slot.param.detach().reshape({-1}));
      }
      const at::ScalarType compute_dtype = fp.mixed ? *mp.param_dtype() : first.scalar_type();
      fp.full = fp.separate ? master.to(compute, compute_dtype, false, /*copy=*/true) : master;
      fp.shard = sharded() ? master.narrow(0, fp.shard_offset, fp.shard_numel).clone() : master;
      if (fp.offloaded) {
        fp.shard = fp.shard.to(at::kCPU, /*non_blocking=*/false, /*copy=*/!sharded());
        if (at::hasCUDA()) fp.shard = fp.shard.pin_memory();  // fast copies to the device
      }
      {
        const auto [pre, post] = internal::DivideFactors(options_, world_);
        fp.grad_views = fp.requires_grad && !sharded() && !fp.separate &&
                        fp.reduce_dtype == master.scalar_type() &&
                        std::abs(pre * post - world_) <= 1e-9 * world_;
      }
      for (ParamSlot& slot : slots) {
        // Same TensorImpl, new storage: the module keeps using its tensor, which now views `full`.
        slot.param.set_data(fp.full.narrow(0, slot.offset, slot.numel).view(slot.shape));
        if (slot.param.grad().defined()) slot.param.mutable_grad() = at::Tensor();
      }
    }
    const size_t flat_index = flats_.size() - 1;
    for (size_t s = 0; s < slots.size(); ++s) {
      ParamSlot& slot = slots[s];
      if (fp.requires_grad) {
        slot.grad_accumulator = torch::autograd::impl::grad_accumulator(slot.param);
        slot.hook_key = slot.grad_accumulator->add_post_hook(
            std::make_unique<internal::PostBackwardHook>(alive_, flat_index, s));
      }
      owned_params_.emplace_back(slot.param.unsafeGetTensorImpl(), slot.name);
    }
    fp.slots = std::move(slots);
    if (!fp.per_param) {
      register_parameter(fp.requires_grad ? "flat_param" : "flat_param_frozen", fp.shard,
                         fp.requires_grad);
    }
    if (sharded()) internal::FreeStorage(fp.full);
  }
  set_param_views(false);  // per-parameter layout: the parameters show their rows

  std::vector<at::Tensor> distinct_buffers;
  for (const auto& [name, b] : buffers) {
    bool seen = false;
    for (const at::Tensor& d : distinct_buffers) seen = seen || d.is_same(b);
    if (!seen && b.defined()) distinct_buffers.push_back(b);
  }
  broadcast_buffers(distinct_buffers);
  // move_params_to_cpu with the parameters on the CPU: the module computes on the compute device,
  // so its buffers go there (the parameters already view `full` there).
  if (options_.move_params_to_cpu() && options_.compute_device()) {
    c10::NoGradGuard no_grad;
    for (const at::Tensor& b : distinct_buffers) {
      if (b.device() != *options_.compute_device()) {
        at::Tensor(b).set_data(b.to(*options_.compute_device()));
      }
    }
  }
  if (const auto dtype = options_.mixed_precision().buffer_dtype()) {
    for (const at::Tensor& b : distinct_buffers) {
      if (b.is_floating_point()) at::Tensor(b).set_data(b.to(*dtype));
    }
  }
}

at::Tensor FullyShardedDataParallelImpl::cast_tensor(const at::Tensor& t) const {
  const auto& dtype = options_.mixed_precision().param_dtype();
  if (!dtype || !t.defined() || !t.is_floating_point() || t.scalar_type() == *dtype) return t;
  return t.to(*dtype);
}

void FullyShardedDataParallelImpl::broadcast_buffers(const std::vector<at::Tensor>& buffers) {
  if (world_ == 1) return;
  std::vector<comm::Work> works;
  for (const at::Tensor& b : buffers) {
    works.push_back(comm_->Broadcast(internal::Buf(b, label() + ": buffer broadcast"), 0));
  }
  ThrowIfError(comm::WaitAll(works.data(), works.size()), label() + ": buffer broadcast");
}

void FullyShardedDataParallelImpl::register_nested() {
  for (const Nested& n : nested_) {
    std::vector<std::string> parts = absl::StrSplit(n.path, '.');
    torch::nn::Module* parent = this;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      const auto children = parent->named_children();
      const auto* existing = children.find(parts[i]);
      std::shared_ptr<torch::nn::Module> next;
      if (existing != nullptr) {
        next = *existing;
      } else {
        next = std::make_shared<internal::PathModule>();
        if (parent == this) {
          register_module(parts[i], next);
        } else {
          static_cast<internal::PathModule*>(parent)->add(parts[i], next);
        }
      }
      parent = next.get();
    }
    if (parent == this) {
      register_module(parts.back(), n.unit);
    } else {
      static_cast<internal::PathModule*>(parent)->add(parts.back(), n.unit);
    }
  }
}

std::vector<FullyShardedDataParallelImpl*> FullyShardedDataParallelImpl::fsdp_units() {
  std::vector<FullyShardedDataParallelImpl*> out{this};
  for (const Nested& n : nested_) {
    for (FullyShardedDataParallelImpl* u : n.unit->fsdp_units()) out.push_back(u);
  }
  return out;
}

std::vector<FlatParamInfo> FullyShardedDataParallelImpl::flat_param_info() const {
  std::vector<FlatParamInfo> out;
  for (const FlatParam& fp : flats_) {
    FlatParamInfo info;
    info.name = fp.requires_grad ? "flat_param" : "flat_param_frozen";
    info.requires_grad = fp.requires_grad;
    info.numel = fp.numel;
    info.padded_numel = fp.padded_numel;
    info.shard_numel = fp.shard_numel;
    info.shard_offset = fp.shard_offset;
    info.per_parameter = fp.per_param;
    for (const ParamSlot& slot : fp.slots) {
      FlatParamInfo::Entry e;
      e.name = prefix_ + slot.name;
      for (const std::string& a : slot.aliases) e.aliases.push_back(prefix_ + a);
      e.shape = slot.shape;
      e.offset = slot.offset;
      e.numel = slot.numel;
      e.shard_offset = fp.per_param ? slot.shard_offset : 0;
      e.rank_numel = fp.per_param ? slot.rank_numel : 0;
      info.params.push_back(std::move(e));
    }
    out.push_back(std::move(info));
  }
  return out;
}

void FullyShardedDataParallelImpl::train(bool on) {
  torch::nn::Module::train(on);
  module_->train(on);
}

void FullyShardedDataParallelImpl::pretty_print(std::ostream& stream) const {
  int64_t numel = 0;
  for (const FlatParam& fp : flats_) numel += fp.numel;
  stream << "fairscale::fsdp::FullyShardedDataParallel(module=" << module_->name()
         << ", strategy=" << ShardingStrategyName(options_.sharding_strategy())
         << ", world_size=" << world_ << ", numel=" << numel << ")";
}

// ---- forward -------------------------------------------------------------------------------

void FullyShardedDataParallelImpl::init_root() {
  auto state = std::make_shared<internal::RootState>();
  state->root = this;
  std::function<void(FullyShardedDataParallelImpl*, const std::string&)> visit =
      [&](FullyShardedDataParallelImpl* unit, const std::string& prefix) {
        TORCH_CHECK(!unit->state_ || !unit->state_->backward_active, unit->label(),
                    ": becomes part of a new root while its backward is running");
        TORCH_CHECK(unit->options_.flatten_parameters() == options_.flatten_parameters(),
                    unit->label(), ": flatten_parameters(",
                    unit->options_.flatten_parameters() ? "true" : "false",
                    ") but its root has flatten_parameters(",
                    options_.flatten_parameters() ? "true" : "false",
                    "); every unit of a model must use the same layout");
        unit->state_ = state;
        unit->prefix_ = prefix;
        unit->forward_index_ = unit->backward_index_ = -1;
        state->units.push_back(unit);
        for (const Nested& n : unit->nested_) visit(n.unit.get(), prefix + n.path + ".");
      };
  visit(this, prefix_);
}

void FullyShardedDataParallelImpl::pre_forward() {
  TORCH_CHECK(!summoned_, label(), ": forward inside summon_full_params");
  if (!state_) init_root();
  in_forward_ = true;
  internal::RootState& st = *state_;
  if (!st.forward_order_done &&
      std::find(st.forward_order.begin(), st.forward_order.end(), this) == st.forward_order.end()) {
    forward_index_ = static_cast<int>(st.forward_order.size());
    st.forward_order.push_back(this);
  }
  issue_gathers();
  if (st.forward_order_done && options_.forward_prefetch() && forward_index_ >= 0 &&
      forward_index_ + 1 < static_cast<int>(st.forward_order.size())) {
    prefetch(st.forward_order[forward_index_ + 1], /*backward=*/false);
  }
  wait_gathers();
  set_param_views(true);
}

void FullyShardedDataParallelImpl::post_forward(const std::vector<at::Tensor>& outputs) {
  internal::RootState& st = *state_;
  in_forward_ = false;
  bool needs_backward = false;
  if (c10::GradMode::is_enabled()) {
    std::weak_ptr<FullyShardedDataParallelImpl*> alive = alive_;
    for (const at::Tensor& t : outputs) {
      if (!t.defined() || !t.requires_grad()) continue;
      needs_backward = true;
      t.register_hook([alive](const at::Tensor&) {
        if (auto unit = alive.lock()) (*unit)->pre_backward();
      });
    }
  }
  if (needs_backward) forwarded_ = true;
  const bool keep = is_root() && options_.disable_reshard_on_root();
  const ShardingStrategy strategy = options_.sharding_strategy();
  if ((strategy == ShardingStrategy::kFullShard || strategy == ShardingStrategy::kHybridShard) &&
      !keep) {
    reshard();
  }
  if (is_root()) {
    if (!st.forward_order.empty()) st.forward_order_done = true;
    // No backward will use the full parameters of this forward: nothing stays gathered, so no
    // unit can compute with a copy that an optimizer step makes stale.
    if (!needs_backward && !st.backward_active) {
      for (FullyShardedDataParallelImpl* u : st.units) {
        if (!u->forwarded_) u->reshard();
      }
    }
  }
}

void FullyShardedDataParallelImpl::forward_failed() {
  in_forward_ = false;
  if (state_ && is_root()) {
    for (FullyShardedDataParallelImpl* u : state_->units) {
      if (!u->forwarded_) u->reshard();
    }
  }
}

// ---- communication -------------------------------------------------------------------------

int FullyShardedDataParallelImpl::gathers_needed() const {
  if (!sharded()) return 0;
  int n = 0;
  for (const FlatParam& fp : flats_) {
    if (!fp.gather_pending && !internal::HasStorage(fp.full)) ++n;
  }
  return n;
}

void FullyShardedDataParallelImpl::prefetch(FullyShardedDataParallelImpl* next, bool backward) {
  if (next == nullptr || next == this || next->state_ != state_) return;
  if (backward && next->pre_backward_done_) return;
  next->issue_gathers();
}

void FullyShardedDataParallelImpl::issue_gathers() {
  c10::NoGradGuard no_grad;
  const int needed = gathers_needed();
  const int limit = options_.all_gathers_in_flight();
  if (needed > 0 && state_ && limit > 0) {
    // Rate limit: wait for the oldest in-flight gathers (their units keep the gathered
    // parameters; their own wait is then a no-op) until this unit's fit, or none is left.
    internal::RootState& st = *state_;
    while (st.gathers_in_flight > 0 && st.gathers_in_flight + needed > limit &&
           !st.gathering.empty()) {
      FullyShardedDataParallelImpl* oldest = st.gathering.front();
      oldest->wait_gathers();
    }
  }
  bool issued = false;
  for (FlatParam& fp : flats_) {
    if (!sharded()) {
      if (fp.stale) fp.full.copy_(fp.shard.detach());
      fp.stale = false;
      continue;
    }
    if (fp.gather_pending || internal::HasStorage(fp.full)) continue;
    internal::AllocateStorage(fp.full);
    const std::string context = label() + ": all_gather of the flat parameter";
    // The shard on the compute device in the compute dtype (a copy when offloaded: blocking, so
    // the communicator may read it at once whichever stream it uses).
    fp.gather_send = fp.separate ? fp.shard.detach().to(fp.full.device(), fp.full.scalar_type(),
                                                        /*non_blocking=*/false,
                                                        /*copy=*/fp.offloaded)
                                 : fp.shard.detach();
    // Per-parameter layout: gathered rank-major into a staging buffer, copied out on wait.
    if (fp.per_param) fp.gather_buf = at::empty({fp.padded_numel}, fp.full.options());
    fp.gather_work = shard_comm_->AllGather(
        internal::Buf(fp.gather_send, context),
        internal::Buf(fp.per_param ? fp.gather_buf : fp.full, context));
    fp.gather_pending = true;
    issued = true;
    if (state_) ++state_->gathers_in_flight;
  }
  if (issued && state_) state_->gathering.push_back(this);
}

void FullyShardedDataParallelImpl::wait_gathers() {
  if (state_) {
    auto& g = state_->gathering;
    g.erase(std::remove(g.begin(), g.end(), this), g.end());
  }
  for (FlatParam& fp : flats_) {
    if (!fp.gather_pending) continue;
    fp.gather_pending = false;
    if (state_) --state_->gathers_in_flight;
    absl::Status status = fp.gather_work.Wait();
    fp.gather_send = at::Tensor();
    ThrowIfError(status, label() + ": all_gather of the flat parameter");
    if (fp.per_param) internal::CopyOutGathered(fp, dim0_world());
  }
}

void FullyShardedDataParallelImpl::reshard() {
  set_param_views(false);
  if (!sharded()) return;
  wait_gathers();
  for (FlatParam& fp : flats_) {
    if (internal::HasStorage(fp.full) && fp.full.numel() > 0) internal::FreeStorage(fp.full);
  }
}

void FullyShardedDataParallelImpl::attach_grad_views(FlatParam& fp) {
  c10::NoGradGuard no_grad;
  at::Tensor& g = fp.shard.mutable_grad();
  if (!g.defined()) g = at::zeros({fp.shard_numel}, fp.shard.options().requires_grad(false));
  const auto* base = static_cast<const char*>(g.data_ptr());
  for (ParamSlot& slot : fp.slots) {
    const at::Tensor& pg = slot.param.grad();
    const void* want = base + slot.offset * static_cast<int64_t>(g.element_size());
    if (!pg.defined() || pg.data_ptr() != want || !pg.is_alias_of(g)) {
      slot.param.mutable_grad() = g.narrow(0, slot.offset, slot.numel).view(slot.shape);
    }
  }
}

// ---- backward ------------------------------------------------------------------------------

void FullyShardedDataParallelImpl::begin_backward() {
  internal::RootState& st = *state_;
  if (st.backward_active) return;
  st.backward_active = true;
  std::weak_ptr<FullyShardedDataParallelImpl*> alive = alive_;
  torch::autograd::Engine::get_default_engine().queue_callback([alive] {
    if (auto root = alive.lock()) (*root)->finalize_backward();
  });
}

void FullyShardedDataParallelImpl::pre_backward() {
  TORCH_CHECK(state_ != nullptr, label(), ": backward before the first forward");
  internal::RootState& st = *state_;
  st.root->begin_backward();
  if (pre_backward_done_) return;
  pre_backward_done_ = true;
  for (FlatParam& fp : flats_) {
    if (fp.grad_views) attach_grad_views(fp);
  }
  if (!st.backward_order_done) {
    backward_index_ = static_cast<int>(st.backward_order.size());
    st.backward_order.push_back(this);
  }
  issue_gathers();
  if (st.backward_order_done && options_.backward_prefetch() == BackwardPrefetch::kBackwardPre &&
      backward_index_ >= 0 && backward_index_ + 1 < static_cast<int>(st.backward_order.size())) {
    prefetch(st.backward_order[backward_index_ + 1], /*backward=*/true);
  }
  wait_gathers();
  set_param_views(true);
}

void FullyShardedDataParallelImpl::on_param_grad(size_t flat, size_t slot_index) {
  TORCH_CHECK(state_ != nullptr, label(), ": backward before the first forward");
  state_->root->begin_backward();
  FlatParam& fp = flats_[flat];
  ParamSlot& slot = fp.slots[slot_index];
  at::Tensor& grad = slot.param.mutable_grad();
  if (!grad.defined()) return;
  c10::NoGradGuard no_grad;
  if (fp.grad_views) {
    // Normally autograd accumulated into the view attached in pre_backward. If not (the
    // parameter got its gradient before its unit's pre-backward hook ran, or create_graph made
    // the accumulation out of place), move the gradient into the shard's .grad now.
    const at::Tensor& flat_grad = fp.shard.grad();
    if (!flat_grad.defined() || !grad.is_alias_of(flat_grad)) {
      at::Tensor g = grad;
      grad = at::Tensor();
      attach_grad_views(fp);
      slot.param.mutable_grad().add_(g.reshape(slot.shape));
    }
  } else {
    if (!fp.full_grad.defined()) {
      // Starting this unit's full gradient: first let older reductions finish down to the
      // allowed number, so their full gradients are freed before this one is allocated.
      drain_reduces(static_cast<size_t>(options_.reductions_in_flight()));
      // On the compute device (where autograd's gradients are), also when offloaded.
      fp.full_grad = at::zeros({fp.padded_numel}, fp.full.options().dtype(fp.reduce_dtype));
    }
    if (fp.per_param) {
      internal::AddDim0Grad(fp, slot, grad, dim0_world());
    } else {
      fp.full_grad.narrow(0, slot.offset, slot.numel).add_(grad.reshape({-1}));
    }
    grad = at::Tensor();
  }
  ++fp.grads_ready;
  if (fp.grads_ready == static_cast<int>(fp.slots.size()) && !fp.reduced && !state_->no_sync) {
    // Every use of this flat parameter in backward is done: free it now rather than at the end.
    if (sharded() && fp.requires_grad && flats_.size() == 1) reshard();
    // BACKWARD_POST: this unit's gradient is complete (all its flat parameters that need one),
    // so the next unit's gather goes out now, ahead of this unit's reduction.
    internal::RootState& st = *state_;
    if (st.backward_order_done &&
        options_.backward_prefetch() == BackwardPrefetch::kBackwardPost && backward_index_ >= 0 &&
        backward_index_ + 1 < static_cast<int>(st.backward_order.size())) {
      bool unit_done = true;
      for (size_t f = 0; f < flats_.size(); ++f) {
        const FlatParam& other = flats_[f];
        if (f != flat && other.requires_grad && !other.reduced &&
            other.grads_ready < static_cast<int>(other.slots.size())) {
          unit_done = false;
        }
      }
      if (unit_done) prefetch(st.backward_order[backward_index_ + 1], /*backward=*/true);
    }
    issue_reduce(flat);
  }
}

void FullyShardedDataParallelImpl::finalize_backward() {
  internal::RootState& st = *state_;
  auto reset = [&] {
    for (FullyShardedDataParallelImpl* u : st.units) {
      u->forwarded_ = false;
      u->pre_backward_done_ = false;
      for (FlatParam& fp : u->flats_) {
        fp.grads_ready = 0;
        fp.reduced = false;
      }
    }
    st.pending.clear();
    st.bucket = internal::GradBucket();
    st.backward_active = false;
  };
  try {
    // Units whose gradients did not all arrive (unused parameters) reduce now, in the same
    // order on every rank.
    for (FullyShardedDataParallelImpl* u : st.units) {
      for (size_t f = 0; f < u->flats_.size() && !st.no_sync; ++f) {
        FlatParam& fp = u->flats_[f];
        if (fp.requires_grad && !fp.reduced &&
            (u->forwarded_ || fp.full_grad.defined() || fp.grads_ready > 0)) {
          u->issue_reduce(f);
        }
      }
    }
    flush_bucket();
    c10::NoGradGuard no_grad;
    for (internal::PendingReduce& p : st.pending) {
      ThrowIfError(wait_reduce(p), p.parts.front().unit->label() + ": gradient reduction");
      complete_reduce(p);
    }
    for (FullyShardedDataParallelImpl* u : st.units) {
      u->reshard();
      // The optimizer steps next: unsharded low-precision copies must be refreshed.
      for (FlatParam& fp : u->flats_) fp.stale = fp.separate && !u->sharded();
    }
    if (!st.backward_order.empty()) st.backward_order_done = true;
  } catch (...) {
    reset();
    throw;
  }
  reset();
}

}  // namespace fairscale::fsdp
