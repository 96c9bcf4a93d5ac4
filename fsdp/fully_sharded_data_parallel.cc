// FullyShardedDataParallelImpl, the LibTorch module: finds what the wrapped module holds, hands
// it to its engine (internal::Unit), registers what the wrapper shows, and forwards the calls
// around the wrapped forward to the root's Coordinator. no_sync, clip_grad_norm_ and
// summon_full_params are in full_params_and_norm.cc; local state dicts in local_state_dict.cc.
#include "fsdp/fully_sharded_data_parallel.h"

#include <c10/core/GradMode.h>

#include <functional>
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
  shard_module();
  if (unit_->options().flatten_parameters()) {
    register_nested();
  } else {
    register_original();
  }
}

FullyShardedDataParallelImpl::~FullyShardedDataParallelImpl() = default;

void FullyShardedDataParallelImpl::shard_module() {
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
            if (!seen) {
              nested_.push_back({child_path, unit});
              unit_->AddNested(child_path, unit->unit_);
            }
            continue;
          }
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
  for (const auto& item : module_->named_parameters(/*recurse=*/false)) {
    register_parameter(item.key(), item.value(), item.value().requires_grad());
  }
  for (const auto& item : module_->named_buffers(/*recurse=*/false)) {
    register_buffer(item.key(), item.value());
  }
  for (const auto& item : module_->named_children()) register_module(item.key(), item.value());
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
