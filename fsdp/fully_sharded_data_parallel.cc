// FullyShardedDataParallelImpl, the LibTorch module: finds what the wrapped module holds, hands
// it to its engine (internal::Unit), registers what the wrapper shows, and forwards the calls
// around the wrapped forward to the root's Coordinator. no_sync, clip_grad_norm_ and
// summon_full_params are in full_params_and_norm.cc; local state dicts in local_state_dict.cc.
#include "fsdp/fully_sharded_data_parallel.h"

#include <c10/core/GradMode.h>

#include <functional>
#include <map>
#include <ostream>

#include "absl/strings/str_split.h"
#include "fsdp/internal/coordinator.h"
#include "fsdp/internal/unit.h"

namespace fairscale::fsdp {
namespace {

// An empty module that holds nested units under their dotted path ("blocks" -> "0" -> unit).
class PathModule : public torch::nn::Module {
 public:
  PathModule() : torch::nn::Module("FsdpPath") {}
  std::shared_ptr<torch::nn::Module> add(const std::string& name,
                                         std::shared_ptr<torch::nn::Module> m) {
    return register_module(name, std::move(m));
  }
  void add_parameter(const std::string& name, const at::Tensor& p, bool requires_grad) {
    register_parameter(name, p, requires_grad);
  }
  void add_buffer(const std::string& name, const at::Tensor& b) { register_buffer(name, b); }
};

}  // namespace

FullyShardedDataParallelImpl::FullyShardedDataParallelImpl(torch::nn::AnyModule module,
                                                           std::shared_ptr<comm::Communicator> comm,
                                                           FsdpOptions options)
    : torch::nn::Module("fairscale::fsdp::FullyShardedDataParallel"),
      module_any_(std::move(module)) {
  TORCH_CHECK(comm != nullptr, "FullyShardedDataParallel: the communicator is null");
  TORCH_CHECK(!module_any_.is_empty(), "FullyShardedDataParallel: the module is empty");
  internal::ValidateOptions(options);
  module_ = module_any_.ptr();
  TORCH_CHECK(dynamic_cast<FullyShardedDataParallelImpl*>(module_.get()) == nullptr,
              internal::UnitLabel("", module_->name(), comm->rank(), comm->size()),
              ": wrapping a FullyShardedDataParallel directly in another is not supported");
  unit_ = std::make_shared<internal::Unit>(module_->name(), std::move(comm), std::move(options));
  collect_ignored();
  shard_module();
  if (unit_->options().flatten_parameters()) {
    register_nested();
  } else {
    register_original();
  }
}

FullyShardedDataParallelImpl::~FullyShardedDataParallelImpl() = default;

void FullyShardedDataParallelImpl::collect_ignored() {
  const auto& ignored = unit_->options().ignored_modules();
  if (ignored.empty()) return;
  // Every module below module_, nested units' wrapped modules included: its path, and the
  // innermost nested unit that owns it (null: this unit) or wraps it.
  struct Where {
    std::string path;
    FullyShardedDataParallelImpl* owner;
    bool wrapped;  // a nested unit or the module it wraps
  };
  std::map<const torch::nn::Module*, Where> where;
  std::function<void(const std::shared_ptr<torch::nn::Module>&, const std::string&,
                     FullyShardedDataParallelImpl*)>
      walk = [&](const std::shared_ptr<torch::nn::Module>& m, const std::string& path,
                 FullyShardedDataParallelImpl* owner) {
        for (const auto& child : m->named_children()) {
          const std::string child_path = path.empty() ? child.key() : path + "." + child.key();
          if (auto unit = std::dynamic_pointer_cast<FullyShardedDataParallelImpl>(child.value())) {
            where.emplace(unit.get(), Where{child_path, unit.get(), true});
            where.emplace(unit->module().get(), Where{child_path, unit.get(), true});
            walk(unit->module(), child_path, unit.get());
            continue;
          }
          where.emplace(child.value().get(), Where{child_path, owner, false});
          walk(child.value(), child_path, owner);
        }
      };
  walk(module_, "", nullptr);
  for (size_t i = 0; i < ignored.size(); ++i) {
    const std::shared_ptr<torch::nn::Module>& m = ignored[i];
    TORCH_CHECK(m != nullptr, label(), ": ignored_modules[", i, "] is null");
    const std::string what = "ignored_modules[" + std::to_string(i) + "] (" + m->name() + ")";
    TORCH_CHECK(m.get() != module_.get(), label(), ": ", what,
                " is the wrapped module itself; to leave a whole module to the caller, do not "
                "wrap it");
    const auto it = where.find(m.get());
    TORCH_CHECK(it != where.end(), label(), ": ", what,
                " is not a submodule of the wrapped module (", module_->name(), ")");
    const Where& w = it->second;
    TORCH_CHECK(!w.wrapped, label(), ": ", what, " at '", w.path,
                "' is (the module of) a nested FullyShardedDataParallel unit; ignore a submodule "
                "of it, or do not wrap it");
    if (w.owner != nullptr) {
      TORCH_CHECK(w.owner->ignores(*m), label(), ": ", what, " at '", w.path,
                  "' is inside the nested unit ", w.owner->label(),
                  ", which does not ignore it: pass it in that unit's FsdpOptions::ignored_modules "
                  "too (fsdp::EnableWrap does)");
      continue;  // the nested unit leaves it alone
    }
    for (const auto& sub : m->modules(/*include_self=*/true)) {
      TORCH_CHECK(dynamic_cast<FullyShardedDataParallelImpl*>(sub.get()) == nullptr, label(), ": ",
                  what, " at '", w.path, "' contains a FullyShardedDataParallel unit");
      ignored_modules_.insert(sub.get());
      for (const auto& item : sub->named_parameters(/*recurse=*/false)) {
        if (item.value().defined() &&
            ignored_param_impls_.insert(item.value().unsafeGetTensorImpl()).second) {
          ignored_params_.push_back(item.value());
        }
      }
    }
  }
}

bool FullyShardedDataParallelImpl::ignores(const torch::nn::Module& module) const {
  return ignored_modules_.count(&module) > 0;
}

bool FullyShardedDataParallelImpl::ignores(const at::Tensor& parameter) const {
  return parameter.defined() && ignored_param_impls_.count(parameter.unsafeGetTensorImpl()) > 0;
}

std::vector<at::Tensor> FullyShardedDataParallelImpl::ignored_parameters() {
  std::vector<at::Tensor> out;
  std::set<const c10::TensorImpl*> seen;
  for (FullyShardedDataParallelImpl* u : fsdp_units()) {
    for (const at::Tensor& p : u->ignored_params_) {
      if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
    }
  }
  return out;
}

void FullyShardedDataParallelImpl::shard_module() {
  // Walk the wrapped module; stop at nested units, which own their subtree.
  std::vector<std::pair<std::string, at::Tensor>> params;
  std::vector<std::pair<std::string, at::Tensor>> buffers;
  std::function<void(const std::shared_ptr<torch::nn::Module>&, const std::string&)> visit =
      [&](const std::shared_ptr<torch::nn::Module>& m, const std::string& path) {
        for (const auto& item : m->named_parameters(/*recurse=*/false)) {
          if (ignores(item.value())) continue;  // FsdpOptions::ignored_modules
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
            if (!seen) {
              nested_.push_back({child_path, unit});
              unit_->AddNested(child_path, unit->unit_);
            }
            continue;
          }
          if (ignores(*child.value())) continue;  // left alone, buffers included
          visit(child.value(), child_path + ".");
        }
      };
  visit(module_, "");
  unit_->Shard(params, buffers);
  internal::AttachGradHooks(*unit_);
  if (unit_->options().flatten_parameters()) {
    for (const internal::FlatParam& fp : unit_->flats()) {
      register_parameter(fp.requires_grad ? "flat_param" : "flat_param_frozen", fp.shard,
                         fp.requires_grad);
    }
  }
  unit_->FinishSharding();
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
        next = std::make_shared<PathModule>();
        if (parent == this) {
          register_module(parts[i], next);
        } else {
          static_cast<PathModule*>(parent)->add(parts[i], next);
        }
      }
      parent = next.get();
    }
    if (parent == this) {
      register_module(parts.back(), n.unit);
    } else {
      static_cast<PathModule*>(parent)->add(parts.back(), n.unit);
    }
  }
}

void FullyShardedDataParallelImpl::register_original() {
  // Whether `m`'s subtree (nested units excluded) holds something this unit ignores.
  const bool any_ignored = !ignored_modules_.empty() || !ignored_param_impls_.empty();
  std::function<bool(const torch::nn::Module&)> holds_ignored = [&](const torch::nn::Module& m) {
    if (!any_ignored) return false;
    if (ignores(m)) return true;
    for (const auto& item : m.named_parameters(/*recurse=*/false)) {
      if (ignores(item.value())) return true;
    }
    for (const auto& child : m.children()) {
      if (dynamic_cast<const FullyShardedDataParallelImpl*>(child.get()) == nullptr &&
          holds_ignored(*child)) {
        return true;
      }
    }
    return false;
  };
  // Registers in `dst` (this wrapper or a PathModule) what `src` holds, under the same names.
  // A child holding ignored modules or parameters is mirrored by a PathModule that registers
  // the rest, so that the wrapper's parameters() and buffers() leave the ignored ones out.
  std::function<void(const torch::nn::Module&, torch::nn::Module*)> mirror =
      [&](const torch::nn::Module& src, torch::nn::Module* dst) {
        auto* path = dst == this ? nullptr : static_cast<PathModule*>(dst);
        for (const auto& item : src.named_parameters(/*recurse=*/false)) {
          if (ignores(item.value())) continue;
          if (path) {
            path->add_parameter(item.key(), item.value(), item.value().requires_grad());
          } else {
            register_parameter(item.key(), item.value(), item.value().requires_grad());
          }
        }
        for (const auto& item : src.named_buffers(/*recurse=*/false)) {
          if (path) {
            path->add_buffer(item.key(), item.value());
          } else {
            register_buffer(item.key(), item.value());
          }
        }
        for (const auto& item : src.named_children()) {
          std::shared_ptr<torch::nn::Module> child = item.value();
          const bool is_unit = dynamic_cast<FullyShardedDataParallelImpl*>(child.get()) != nullptr;
          if (!is_unit && ignores(*child)) continue;
          std::shared_ptr<torch::nn::Module> shown = child;
          if (!is_unit && holds_ignored(*child)) shown = std::make_shared<PathModule>();
          if (path) {
            path->add(item.key(), shown);
          } else {
            register_module(item.key(), shown);
          }
          if (shown != child) mirror(*child, shown.get());
        }
      };
  mirror(*module_, this);
}

// ---- accessors -----------------------------------------------------------------------------

const FsdpOptions& FullyShardedDataParallelImpl::options() const { return unit_->options(); }
const std::shared_ptr<comm::Communicator>& FullyShardedDataParallelImpl::communicator() const {
  return unit_->groups().world;
}
int FullyShardedDataParallelImpl::rank() const { return unit_->groups().rank; }
int FullyShardedDataParallelImpl::world_size() const { return unit_->groups().world_size; }
const std::shared_ptr<comm::Communicator>& FullyShardedDataParallelImpl::shard_communicator()
    const {
  return unit_->groups().shard;
}
const std::shared_ptr<comm::Communicator>& FullyShardedDataParallelImpl::replicate_communicator()
    const {
  return unit_->groups().replicate;
}
int FullyShardedDataParallelImpl::shard_rank() const { return unit_->groups().shard_rank; }
int FullyShardedDataParallelImpl::shard_world_size() const { return unit_->groups().shard_size; }
int FullyShardedDataParallelImpl::replicate_rank() const { return unit_->groups().replicate_rank; }
int FullyShardedDataParallelImpl::replicate_world_size() const {
  return unit_->groups().replicate_size;
}
const std::string& FullyShardedDataParallelImpl::prefix() const { return unit_->prefix(); }
bool FullyShardedDataParallelImpl::is_sharded() const { return unit_->sharded(); }
std::string FullyShardedDataParallelImpl::label() const { return unit_->label(); }

bool FullyShardedDataParallelImpl::is_root() const {
  return unit_->coordinator() && unit_->coordinator()->root() == unit_.get();
}

std::vector<FullyShardedDataParallelImpl*> FullyShardedDataParallelImpl::fsdp_units() {
  std::vector<FullyShardedDataParallelImpl*> out{this};
  for (const Nested& n : nested_) {
    for (FullyShardedDataParallelImpl* u : n.unit->fsdp_units()) out.push_back(u);
  }
  return out;
}

void FullyShardedDataParallelImpl::check_root_idle(const char* what) {
  const internal::Coordinator& c = internal::Coordinator::RootOf(*unit_);
  TORCH_CHECK(is_root(), label(), ": ", what, " is for the root unit");
  TORCH_CHECK(!c.backward_active() && !unit_->progress.in_forward, label(),
              ": ", what, " inside forward or backward");
}

void FullyShardedDataParallelImpl::register_local_grad_hook(LocalGradHook hook) {
  check_root_idle("register_local_grad_hook");
  TORCH_CHECK(hook, label(), ": register_local_grad_hook: the hook is empty");
  TORCH_CHECK(!unit_->local_grad_hook, label(),
              ": register_local_grad_hook: a local gradient hook is registered already (one "
              "per root); remove_local_grad_hook() first");
  unit_->local_grad_hook = std::move(hook);
}

void FullyShardedDataParallelImpl::remove_local_grad_hook() {
  check_root_idle("remove_local_grad_hook");
  unit_->local_grad_hook = nullptr;
}

bool FullyShardedDataParallelImpl::has_local_grad_hook() const {
  return static_cast<bool>(unit_->local_grad_hook);
}

std::vector<FullyShardedDataParallelImpl*> FullyShardedDataParallelImpl::root_units() {
  const internal::Coordinator& c = internal::Coordinator::RootOf(*unit_);
  TORCH_CHECK(is_root(), label(), ": the state dicts are taken from the root unit");
  TORCH_CHECK(!c.backward_active() && !unit_->progress.in_forward, label(),
              ": state dicts are not available inside forward or backward");
  return fsdp_units();  // the root's units, in the coordinator's order
}

std::vector<FlatParamInfo> FullyShardedDataParallelImpl::flat_param_info() const {
  return unit_->info();
}

std::vector<FullyShardedDataParallelImpl::FlatShard> FullyShardedDataParallelImpl::flat_shards()
    const {
  std::vector<FlatShard> out;
  for (const internal::FlatParam& fp : unit_->flats()) {
    FlatShard s{fp.shard, {}};
    for (const internal::ParamSlot& slot : fp.slots) s.params.push_back(slot.param);
    out.push_back(std::move(s));
  }
  return out;
}

void FullyShardedDataParallelImpl::train(bool on) {
  torch::nn::Module::train(on);
  module_->train(on);
}

void FullyShardedDataParallelImpl::pretty_print(std::ostream& stream) const {
  int64_t numel = 0;
  for (const internal::FlatParam& fp : unit_->flats()) numel += fp.numel;
  stream << "fairscale::fsdp::FullyShardedDataParallel(module=" << module_->name()
         << ", strategy=" << ShardingStrategyName(unit_->options().sharding_strategy())
         << ", world_size=" << world_size() << ", numel=" << numel << ")";
}

// ---- forward -------------------------------------------------------------------------------

at::Tensor FullyShardedDataParallelImpl::cast_tensor(const at::Tensor& t) const {
  const auto& dtype = unit_->options().mixed_precision().param_dtype();
  if (!dtype || !t.defined() || !t.is_floating_point() || t.scalar_type() == *dtype) return t;
  return t.to(*dtype);
}

void FullyShardedDataParallelImpl::pre_forward() {
  TORCH_CHECK(!unit_->progress.summoned, label(), ": forward inside summon_full_params");
  internal::Coordinator::RootOf(*unit_).PreForward(*unit_);
}

void FullyShardedDataParallelImpl::post_forward(const std::vector<at::Tensor>& outputs) {
  unit_->coordinator()->PostForward(*unit_, outputs);
}

void FullyShardedDataParallelImpl::forward_failed() {
  if (unit_->coordinator()) {
    unit_->coordinator()->ForwardFailed(*unit_);
  } else {
    unit_->progress.in_forward = false;
  }
}

}  // namespace fairscale::fsdp
