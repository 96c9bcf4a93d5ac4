#include "fsdp/internal/unit.h"

#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "absl/strings/str_cat.h"
#include "fsdp/internal/collectives.h"
#include "fsdp/internal/coordinator.h"
#include "base/torch_error.h"
#include "fsdp/internal/hybrid_groups.h"
#include "fsdp/internal/param_ranges.h"
#include "fsdp/internal/param_sync.h"
#include "deterministic/collectives.h"
#include "deterministic/mode.h"

namespace fairscale::fsdp::internal {

void ValidateOptions(const FsdpOptions& options) {
  TORCH_CHECK(options.reductions_in_flight() >= 0,
              "FullyShardedDataParallel: reductions_in_flight must be >= 0, got ",
              options.reductions_in_flight());
  TORCH_CHECK(options.all_gathers_in_flight() >= 0,
              "FullyShardedDataParallel: all_gathers_in_flight must be >= 0 (0 = unlimited), got ",
              options.all_gathers_in_flight());
  TORCH_CHECK(!options.move_grads_to_cpu_set() ||
                  options.move_grads_to_cpu() == options.move_params_to_cpu(),
              "FullyShardedDataParallel: move_grads_to_cpu(", options.move_grads_to_cpu(),
              ") with move_params_to_cpu(", options.move_params_to_cpu(),
              "): the optimizer steps the shard where it lives, so its gradient must be there too; "
              "leave move_grads_to_cpu unset (it follows move_params_to_cpu)");
  if (const auto& device = options.compute_device()) {
    TORCH_CHECK(device->is_cpu() || (device->is_cuda() && at::hasCUDA()),
                "FullyShardedDataParallel: compute_device ", *device,
                " is not available (this LibTorch ",
                at::hasCUDA() ? "has CUDA" : "has no CUDA or sees no GPU", ")");
  }
  if (options.deterministic()) {
    TORCH_CHECK(options.micro_batches() >= 1,
                "FullyShardedDataParallel: deterministic(true) needs micro_batches(M), the "
                "micro-batches per optimizer step over all ranks (>= 1), got ",
                options.micro_batches());
    TORCH_CHECK(options.gradient_predivide_factor() == 0 &&
                    options.gradient_postdivide_factor() == 0,
                "FullyShardedDataParallel: deterministic mode divides the gradient sum by "
                "micro_batches itself; gradient_predivide_factor / gradient_postdivide_factor "
                "must be left unset");
  } else {
    TORCH_CHECK(options.micro_batches() == 0, "FullyShardedDataParallel: micro_batches(",
                options.micro_batches(), ") is for deterministic mode; set deterministic(true)");
  }
  const auto bp = options.backward_prefetch();
  TORCH_CHECK(bp == BackwardPrefetch::kNone || bp == BackwardPrefetch::kBackwardPre ||
                  bp == BackwardPrefetch::kBackwardPost,
              "FullyShardedDataParallel: backward_prefetch is not a BackwardPrefetch value: ",
              static_cast<int>(bp));
}

UnitGroups MakeUnitGroups(const std::shared_ptr<comm::Communicator>& world,
                          const FsdpOptions& options, const std::string& label) {
  const ShardingStrategy strategy = options.sharding_strategy();
  const int group_size = options.hybrid_shard_group_size();
  const bool explicit_groups =
      options.hybrid_shard_comm() != nullptr || options.hybrid_replicate_comm() != nullptr;
  UnitGroups g;
  g.world = g.shard = world;
  g.rank = world->rank();
  g.world_size = world->size();
  if (!IsHybrid(strategy)) {
    TORCH_CHECK(group_size == 0 && !explicit_groups, label,
                ": hybrid_shard_group_size / hybrid_shard_groups are for HYBRID_SHARD and "
                "_HYBRID_SHARD_ZERO2, the sharding strategy is ",
                ShardingStrategyName(strategy));
  } else {
    TORCH_CHECK(group_size >= 0, label,
                ": hybrid_shard_group_size must be >= 0 (0 = by host), got ", group_size);
    TORCH_CHECK(group_size == 0 || !explicit_groups, label,
                ": give either hybrid_shard_group_size (", group_size,
                ") or hybrid_shard_groups, not both");
    TORCH_CHECK(group_size == 0 || g.world_size % group_size == 0, label,
                ": hybrid_shard_group_size ", group_size, " does not divide the world size ",
                g.world_size);
    HybridGroups groups;
    if (explicit_groups) {
      groups = {options.hybrid_shard_comm(), options.hybrid_replicate_comm()};
      base::ThrowIfError(CheckHybridGroups(world, groups), label);
    } else {
      groups = base::ValueOrThrow(SharedHybridGroups(world, group_size),
                            label + ": making the HYBRID_SHARD groups");
    }
    g.shard = groups.shard;
    if (groups.replicate->size() > 1) g.replicate = groups.replicate;
  }
  g.shard_rank = g.shard->rank();
  g.shard_size = g.shard->size();
  g.replicate_rank = g.replicate ? g.replicate->rank() : 0;
  g.replicate_size = g.replicate ? g.replicate->size() : 1;
  return g;
}

Unit::Unit(std::string module_name, std::shared_ptr<comm::Communicator> comm, FsdpOptions options)
    : module_name_(std::move(module_name)), options_(std::move(options)) {
  groups_ = MakeUnitGroups(comm, options_,
                           UnitLabel(prefix_, module_name_, comm->rank(), comm->size()));
  if (options_.deterministic()) InitDeterministic();
}

void Unit::InitDeterministic() {
  const std::string what = label();
  deterministic::CheckThreads(what);
  try {
    det_layout_ = deterministic::MicroBatchLayout::Make(options_.micro_batches(),
                                                        groups_.world_size, groups_.rank);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, what, ": ", e.what_without_backtrace());
  }
  det_world_nodes_ = det_layout_->nodes_by_rank();
}

void Unit::InitDeterministicGroups() {
  if (!det_layout_ || !sharded()) return;
  const std::string what = label();
  // The world ranks of the shard group's members, by shard rank.
  const int shard_size = groups_.shard_size;
  std::vector<int64_t> members(shard_size);
  const int64_t me = groups_.rank;
  base::ThrowIfError(groups_.shard
                         ->AllGather(comm::MakeConstBuffer(&me, 1),
                                     comm::MakeBuffer(members.data(), members.size()))
                         .Wait(),
                     what + ": deterministic mode: the shard group's ranks");
  for (int64_t r : members) det_shard_nodes_.push_back(det_layout_->nodes_of(static_cast<int>(r)));
  if (!groups_.replicate || groups_.replicate_size <= 1) return;
  // Each replicate member's shard group: after the reduce-scatter it holds the merged nodes of
  // that group's micro-batches.
  std::vector<int64_t> all(static_cast<size_t>(shard_size) * groups_.replicate_size);
  base::ThrowIfError(groups_.replicate
                         ->AllGather(comm::MakeConstBuffer(members.data(), members.size()),
                                     comm::MakeBuffer(all.data(), all.size()))
                         .Wait(),
                     what + ": deterministic mode: the replicate group's shard groups");
  for (int j = 0; j < groups_.replicate_size; ++j) {
    std::vector<deterministic::Node> nodes;
    for (int i = 0; i < shard_size; ++i) {
      for (const auto& n : det_layout_->nodes_of(static_cast<int>(all[j * shard_size + i]))) {
        nodes.push_back(n);
      }
    }
    det_replicate_nodes_.push_back(deterministic::MergeNodes(std::move(nodes)));
  }
}

Unit::~Unit() {
  if (gathers_) {
    auto& q = gathers_->units;
    q.erase(std::remove(q.begin(), q.end(), this), q.end());
  }
  for (FlatParam& fp : flats_) {
    // The communicator may still write into `full`: wait before the memory goes.
    if (fp.gather_pending) {
      fp.gather_work.Wait().IgnoreError();
      if (gathers_) --gathers_->in_flight;
    }
    for (ParamSlot& slot : fp.slots) {
      if (slot.grad_accumulator) slot.grad_accumulator->del_post_hook(slot.hook_key);
    }
  }
  if (coordinator_ && coordinator_->root() == this) coordinator_->reductions().WaitIgnoringErrors();
}

std::string UnitLabel(const std::string& prefix, const std::string& module_name, int rank,
                      int world_size) {
  return absl::StrCat("FSDP unit '", prefix, "' (", module_name, ") rank ", rank, "/", world_size);
}

std::string Unit::label() const {
  return UnitLabel(prefix_, module_name_, groups_.rank, groups_.world_size);
}

bool Unit::sharded() const {
  return groups_.shard_size > 1 && options_.sharding_strategy() != ShardingStrategy::kNoShard;
}

bool Unit::reshards_after_forward() const {
  const ShardingStrategy s = options_.sharding_strategy();
  return s == ShardingStrategy::kFullShard || s == ShardingStrategy::kHybridShard;
}

void Unit::AddNested(const std::string& path, std::shared_ptr<Unit> unit) {
  for (const Nested& n : nested_) {
    if (n.unit == unit) return;
  }
  nested_.push_back({path, std::move(unit)});
}

void Unit::JoinRoot(std::shared_ptr<Coordinator> coordinator,
                    std::shared_ptr<GatherQueue> gathers) {
  coordinator_ = std::move(coordinator);
  gathers_ = std::move(gathers);
}

// ---- construction --------------------------------------------------------------------------

namespace {

// Distinct parameters in registration order, trainable and frozen apart; a tensor registered
// twice (tied) is one slot with an alias. Parameters owned by nested units may not appear.
std::pair<std::vector<ParamSlot>, std::vector<ParamSlot>> MakeSlots(
    const std::vector<std::pair<std::string, at::Tensor>>& params,
    const std::map<const c10::TensorImpl*, std::string>& nested_owned, const std::string& label) {
  std::vector<ParamSlot> trainable;
  std::vector<ParamSlot> frozen;
  std::map<const c10::TensorImpl*, std::pair<bool, size_t>> index;
  for (const auto& [name, p] : params) {
    const c10::TensorImpl* impl = p.unsafeGetTensorImpl();
    auto owned = nested_owned.find(impl);
    TORCH_CHECK(owned == nested_owned.end(), label, ": parameter '", name,
                "' is the same tensor as '", owned == nested_owned.end() ? "" : owned->second,
                "', which a nested FullyShardedDataParallel owns. Tied weights must be wrapped in "
                "the same unit: wrap their common parent instead");
    auto it = index.find(impl);
    if (it != index.end()) {
      auto& list = it->second.first ? trainable : frozen;
      list[it->second.second].aliases.push_back(name);
      continue;
    }
    TORCH_CHECK(p.is_floating_point(), label, ": parameter '", name, "' has dtype ",
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
  return {std::move(trainable), std::move(frozen)};
}

}  // namespace

void Unit::Shard(const std::vector<std::pair<std::string, at::Tensor>>& params,
                 const std::vector<std::pair<std::string, at::Tensor>>& buffers) {
  std::map<const c10::TensorImpl*, std::string> nested_owned;
  for (const Nested& n : nested_) {
    TORCH_CHECK(n.unit->groups_.world == groups_.world, label(), ": nested unit '", n.path,
                "' uses a different communicator; all units of a model must share one");
    for (const auto& [impl, name] : n.unit->owned_params_) {
      nested_owned.emplace(impl, n.path + "." + name);
      owned_params_.emplace_back(impl, n.path + "." + name);
    }
  }
  auto [trainable, frozen] = MakeSlots(params, nested_owned, label());
  std::vector<const ParamSlot*> all;
  for (const auto* list : {&trainable, &frozen}) {
    for (const ParamSlot& slot : *list) all.push_back(&slot);
  }
  CheckOrBroadcastParams(*groups_.world, all, options_.sync_module_states(), label(),
                         options_.deterministic() ? options_.micro_batches() : 0);
  InitDeterministicGroups();  // after the ranks agreed on the mode
  c10::NoGradGuard no_grad;
  for (int kind = 0; kind < 2; ++kind) {
    std::vector<ParamSlot>& slots = kind == 0 ? trainable : frozen;
    if (slots.empty()) continue;
    FlatParam& fp = flats_.emplace_back();
    fp.requires_grad = kind == 0;
    LayoutFlat(fp, slots);
    for (const ParamSlot& slot : slots) {
      owned_params_.emplace_back(slot.param.unsafeGetTensorImpl(), slot.name);
    }
    fp.slots = std::move(slots);
  }
  std::vector<at::Tensor> distinct_buffers;
  for (const auto& [name, b] : buffers) {
    bool seen = false;
    for (const at::Tensor& d : distinct_buffers) seen = seen || d.is_same(b);
    if (!seen && b.defined()) distinct_buffers.push_back(b);
  }
  InitBuffers(distinct_buffers);
}

void Unit::LayoutFlat(FlatParam& fp, std::vector<ParamSlot>& slots) {
  const at::Tensor& first = slots.front().param;
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
  fp.offloaded =
      options_.move_params_to_cpu() && (!compute.is_cpu() || OffloadOnCpuForTesting());
  fp.separate = fp.mixed || fp.offloaded;
  const at::ScalarType compute_dtype = fp.mixed ? *mp.param_dtype() : first.scalar_type();
  if (!options_.flatten_parameters()) {
    TORCH_CHECK(!fp.offloaded, label(),
                ": move_params_to_cpu with a compute device other than the CPU is implemented "
                "for the flat layout only (flatten_parameters(true))");
    LayoutDim0(fp, slots, dim0_world(), dim0_rank(), compute_dtype, sharded());
    return;
  }
  if (sharded()) {
    fp.shard_numel = ShardNumel(fp.numel, groups_.shard_size);
    fp.padded_numel = fp.shard_numel * groups_.shard_size;
    fp.shard_offset = groups_.shard_rank * fp.shard_numel;
  } else {
    fp.shard_numel = fp.padded_numel = fp.numel;
  }
  // The master values in the parameters' own dtype; `full` is the same tensor unless mixed
  // precision computes in another dtype or the shard is offloaded to the CPU.
  at::Tensor master = at::zeros({fp.padded_numel}, first.options().requires_grad(false));
  for (ParamSlot& slot : slots) {
    master.narrow(0, slot.offset, slot.numel).copy_(slot.param.detach().reshape({-1}));
  }
  fp.full = fp.separate ? master.to(compute, compute_dtype, false, /*copy=*/true) : master;
  fp.shard = sharded() ? master.narrow(0, fp.shard_offset, fp.shard_numel).clone() : master;
  if (fp.offloaded) {
    fp.shard = fp.shard.to(at::kCPU, /*non_blocking=*/false, /*copy=*/!sharded());
    if (at::hasCUDA()) fp.shard = fp.shard.pin_memory();  // fast copies to the device
  }
  const int world = groups_.world_size;
  const auto [pre, post] = DivideFactors(options_, world);
  fp.grad_views = fp.requires_grad && !sharded() && !fp.separate && !options_.deterministic() &&
                  fp.reduce_dtype == master.scalar_type() &&
                  std::abs(pre * post - world) <= 1e-9 * world;
  for (ParamSlot& slot : slots) {
    // Same TensorImpl, new storage: the module keeps using its tensor, which now views `full`.
    slot.param.set_data(fp.full.narrow(0, slot.offset, slot.numel).view(slot.shape));
    if (slot.param.grad().defined()) slot.param.mutable_grad() = at::Tensor();
  }
}

void Unit::FinishSharding() {
  if (sharded()) {
    for (FlatParam& fp : flats_) FreeStorage(fp.full);
  }
  SetParamViews(false);  // per-parameter layout: the parameters show their rows
}

void Unit::InitBuffers(const std::vector<at::Tensor>& buffers) {
  if (groups_.world_size > 1) {
    std::vector<comm::Work> works;
    for (const at::Tensor& b : buffers) {
      works.push_back(groups_.world->Broadcast(Buf(b, label() + ": buffer broadcast"), 0));
    }
    base::ThrowIfError(comm::WaitAll(works.data(), works.size()), label() + ": buffer broadcast");
  }
  c10::NoGradGuard no_grad;
  // move_params_to_cpu with the parameters on the CPU: the module computes on the compute device,
  // so its buffers go there (the parameters already view `full` there).
  if (options_.move_params_to_cpu() && options_.compute_device()) {
    for (const at::Tensor& b : buffers) {
      if (b.device() != *options_.compute_device()) {
        at::Tensor(b).set_data(b.to(*options_.compute_device()));
      }
    }
  }
  if (const auto dtype = options_.mixed_precision().buffer_dtype()) {
    for (const at::Tensor& b : buffers) {
      if (b.is_floating_point()) at::Tensor(b).set_data(b.to(*dtype));
    }
  }
}

std::vector<FlatParamInfo> Unit::info() const {
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

// ---- gathering -----------------------------------------------------------------------------

int Unit::GathersNeeded() const {
  if (!sharded()) return 0;
  int n = 0;
  for (const FlatParam& fp : flats_) {
    if (!fp.gather_pending && !HasStorage(fp.full)) ++n;
  }
  return n;
}

void Unit::IssueGathers() {
  c10::NoGradGuard no_grad;
  const int needed = GathersNeeded();
  const int limit = options_.all_gathers_in_flight();
  if (needed > 0 && gathers_ && limit > 0) {
    // Rate limit: wait for the oldest in-flight gathers (their units keep the gathered
    // parameters; their own wait is then a no-op) until this unit's fit, or none is left.
    while (gathers_->in_flight > 0 && gathers_->in_flight + needed > limit &&
           !gathers_->units.empty()) {
      gathers_->units.front()->WaitGathers();
    }
  }
  bool issued = false;
  for (FlatParam& fp : flats_) {
    if (!sharded()) {
      if (fp.stale) fp.full.copy_(fp.shard.detach());
      fp.stale = false;
      continue;
    }
    if (fp.gather_pending || HasStorage(fp.full)) continue;
    AllocateStorage(fp.full);
    const std::string context = label() + ": all_gather of the flat parameter";
    // The shard on the compute device in the compute dtype (a copy when offloaded: blocking, so
    // the communicator may read it at once whichever stream it uses).
    fp.gather_send = fp.separate ? fp.shard.detach().to(fp.full.device(), fp.full.scalar_type(),
                                                        /*non_blocking=*/false,
                                                        /*copy=*/fp.offloaded)
                                 : fp.shard.detach();
    // Per-parameter layout: gathered rank-major into a staging buffer, copied out on wait.
    if (fp.per_param) fp.gather_buf = at::empty({fp.padded_numel}, fp.full.options());
    fp.gather_work = groups_.shard->AllGather(Buf(fp.gather_send, context),
                                              Buf(fp.per_param ? fp.gather_buf : fp.full, context));
    fp.gather_pending = true;
    issued = true;
    if (gathers_) ++gathers_->in_flight;
  }
  if (issued && gathers_) gathers_->units.push_back(this);
}

void Unit::WaitGathers() {
  if (gathers_) {
    auto& q = gathers_->units;
    q.erase(std::remove(q.begin(), q.end(), this), q.end());
  }
  for (FlatParam& fp : flats_) {
    if (!fp.gather_pending) continue;
    fp.gather_pending = false;
    if (gathers_) --gathers_->in_flight;
    absl::Status status = fp.gather_work.Wait();
    fp.gather_send = at::Tensor();
    base::ThrowIfError(status, label() + ": all_gather of the flat parameter");
    if (fp.per_param) CopyOutGathered(fp, dim0_world());
  }
}

void Unit::Reshard() {
  SetParamViews(false);
  if (!sharded()) return;
  WaitGathers();
  for (FlatParam& fp : flats_) {
    if (HasStorage(fp.full) && fp.full.numel() > 0) FreeStorage(fp.full);
  }
}

void Unit::SetParamViews(bool full) {
  for (FlatParam& fp : flats_) {
    if (fp.per_param) SetDim0Views(fp, full);
  }
}

// ---- gradients -----------------------------------------------------------------------------

void Unit::AttachGradViews(FlatParam& fp) {
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

bool Unit::NeedsGradBuffer(size_t flat, size_t slot) const {
  const FlatParam& fp = flats_[flat];
  return !fp.grad_views && !fp.full_grad.defined() && fp.slots[slot].param.grad().defined();
}

bool Unit::AccumulateGrad(size_t flat, size_t slot_index) {
  FlatParam& fp = flats_[flat];
  ParamSlot& slot = fp.slots[slot_index];
  at::Tensor& grad = slot.param.mutable_grad();
  if (!grad.defined()) return false;
  c10::NoGradGuard no_grad;
  if (fp.grad_views) {
    // Normally autograd accumulated into the view attached in pre-backward. If not (the
    // parameter got its gradient before its unit's pre-backward hook ran, or create_graph made
    // the accumulation out of place), move the gradient into the shard's .grad now.
    const at::Tensor& flat_grad = fp.shard.grad();
    if (!flat_grad.defined() || !grad.is_alias_of(flat_grad)) {
      at::Tensor g = grad;
      grad = at::Tensor();
      AttachGradViews(fp);
      slot.param.mutable_grad().add_(g.reshape(slot.shape));
    }
  } else {
    // On the compute device (where autograd's gradients are), also when offloaded.
    if (!fp.full_grad.defined()) {
      const auto options = fp.full.options().dtype(fp.reduce_dtype);
      if (fp.per_param) {
        fp.full_grad = at::zeros({fp.padded_numel}, options);
      } else {
        // Uninitialized: each slot's first gradient is copied in (no memset of the whole
        // buffer and no read-modify-write pass); the padding is zeroed here, and slots that get
        // no gradient in TakeGradient.
        fp.full_grad = at::empty({fp.padded_numel}, options);
        fp.full_grad.narrow(0, fp.numel, fp.padded_numel - fp.numel).zero_();
        for (ParamSlot& s : fp.slots) s.grad_written = false;
      }
    }
    if (fp.per_param) {
      AddDim0Grad(fp, slot, grad, dim0_world());
    } else if (!slot.grad_written) {
      fp.full_grad.narrow(0, slot.offset, slot.numel).copy_(grad.reshape({-1}));
      slot.grad_written = true;
    } else {
      fp.full_grad.narrow(0, slot.offset, slot.numel).add_(grad.reshape({-1}));
    }
    grad = at::Tensor();
  }
  ++fp.grads_ready;
  return fp.grads_ready == static_cast<int>(fp.slots.size()) && !fp.reduced;
}

bool Unit::GradientsCompleteBesides(size_t flat) const {
  for (size_t f = 0; f < flats_.size(); ++f) {
    const FlatParam& other = flats_[f];
    if (f != flat && other.requires_grad && !other.reduced &&
        other.grads_ready < static_cast<int>(other.slots.size())) {
      return false;
    }
  }
  return true;
}

at::Tensor Unit::TakeGradient(size_t flat) {
  FlatParam& fp = flats_[flat];
  fp.reduced = true;
  const int world = groups_.world_size;
  const double pre = DivideFactors(options_, world).first;
  c10::NoGradGuard no_grad;
  if (fp.grad_views) {
    AttachGradViews(fp);
    if (world == 1) return at::Tensor();  // the mean over one rank; the factors multiply to 1
    at::Tensor g = fp.shard.grad();
    if (pre != 1.0) g.div_(pre);
    return g;
  }
  at::Tensor send = TakeFullGrad(fp);
  if (pre != 1.0) send.div_(pre);
  return send;
}

at::Tensor Unit::TakeFullGrad(FlatParam& fp) {
  at::Tensor send = fp.full_grad;
  fp.full_grad = at::Tensor();
  if (!send.defined()) {
    send = at::zeros({fp.padded_numel}, fp.full.options().dtype(fp.reduce_dtype));
  } else if (!fp.per_param) {
    for (const ParamSlot& slot : fp.slots) {
      if (!slot.grad_written) send.narrow(0, slot.offset, slot.numel).zero_();
    }
  }
  return send;
}

void Unit::PushMicroBatchGrad(size_t flat, int64_t index) {
  c10::NoGradGuard no_grad;
  FlatParam& fp = flats_[flat];
  fp.det_acc.Add(index, TakeFullGrad(fp));
}

void Unit::ReduceDeterministic(size_t flat) {
  c10::NoGradGuard no_grad;
  FlatParam& fp = flats_[flat];
  const int64_t m = det_layout_->micro_batches;
  const std::string what = label() + ": deterministic gradient reduction";
  std::vector<deterministic::Partial> parts = fp.det_acc.Take();
  at::Tensor reduced;
  if (sharded()) {
    std::vector<deterministic::Partial> blocks =
        deterministic::ReduceScatter(*groups_.shard, std::move(parts), det_shard_nodes_, what);
    if (!det_replicate_nodes_.empty()) {
      blocks = deterministic::AllGather(*groups_.replicate, std::move(blocks),
                                        det_replicate_nodes_, what);
    }
    reduced = deterministic::Total(std::move(blocks), m);
  } else {
    reduced = deterministic::AllReduce(*groups_.world, std::move(parts), det_world_nodes_, m, what);
  }
  reduced.div_(static_cast<double>(m));
  AddToShardGrad(fp, reduced);
}

void Unit::AddReduced(size_t flat, const at::Tensor& reduced, bool in_place) {
  c10::NoGradGuard no_grad;
  FlatParam& fp = flats_[flat];
  const double post = DivideFactors(options_, groups_.world_size).second;
  at::Tensor recv = reduced;
  if (post != 1.0) recv.div_(post);
  if (in_place) return;  // recv is the shard's .grad itself
  AddToShardGrad(fp, recv);
}

void Unit::AddToShardGrad(FlatParam& fp, const at::Tensor& recv) {
  if (fp.per_param) {
    AccumulateDim0Grads(fp, recv);
    return;
  }
  // move_grads_to_cpu: the reduced shard goes to the CPU shard's .grad (a blocking copy).
  at::Tensor& grad = fp.shard.mutable_grad();
  if (grad.defined()) {
    grad.add_(recv.device() == grad.device() ? recv : recv.to(grad.device()));
  } else {
    // A copy: recv views the whole send buffer (the unit's full gradient, a bucket, or the
    // deterministic reduction's receive buffer), which must not stay alive as the shard's
    // gradient. (Reducing into a buffer of its own instead would save this copy but hold one
    // more shard per reduction in flight: +1 shard of peak.)
    grad = recv.to(fp.shard.device(), fp.shard.scalar_type(), /*non_blocking=*/false,
                   /*copy=*/true);
  }
}

void Unit::AddLocalGradSqr(size_t flat, size_t slot_index, const at::Tensor& grad) {
  c10::NoGradGuard no_grad;
  ParamSlot& slot = flats_[flat].slots[slot_index];
  at::Tensor sqr = grad.to(at::kDouble).pow(2).sum();
  slot.local_sqr = slot.local_sqr.defined() ? slot.local_sqr.add(sqr) : sqr;
}

void Unit::LocalGradSqrs(std::vector<LocalGradSqr>& out) const {
  for (const FlatParam& fp : flats_) {
    if (!fp.requires_grad) continue;
    if (fp.per_param) {
      for (const ParamSlot& slot : fp.slots) {
        out.push_back(
            {slot.param, slot.local_sqr.defined() ? slot.local_sqr.item<double>() : 0.0});
      }
      continue;
    }
    double sum = 0.0;  // the slots are disjoint parts of the flat gradient
    for (const ParamSlot& slot : fp.slots) {
      if (slot.local_sqr.defined()) sum += slot.local_sqr.item<double>();
    }
    out.push_back({fp.shard, sum});
  }
}

void Unit::ResetBackward() {
  progress.forwarded = false;
  progress.pre_backward_done = false;
  for (FlatParam& fp : flats_) {
    fp.grads_ready = 0;
    fp.reduced = false;
    for (ParamSlot& slot : fp.slots) slot.local_sqr = at::Tensor();
  }
}

void Unit::MarkStale() {
  for (FlatParam& fp : flats_) fp.stale = fp.separate && !sharded();
}

// ---- full parameters and local state -------------------------------------------------------

std::vector<at::Tensor> Unit::SnapshotShards(bool writeback) const {
  std::vector<at::Tensor> out;
  for (const FlatParam& fp : flats_) {
    if (!sharded() && !fp.separate && !writeback) out.push_back(fp.shard.detach().clone());
  }
  return out;
}

void Unit::EndSummon(bool writeback, const std::vector<at::Tensor>& snapshots,
                     size_t& next_snapshot) {
  c10::NoGradGuard no_grad;
  for (FlatParam& fp : flats_) {
    if (sharded()) {
      if (writeback && fp.per_param) {
        WritebackDim0(fp);
      } else if (writeback) {
        fp.shard.detach().copy_(fp.full.narrow(0, fp.shard_offset, fp.shard_numel));
      }
    } else if (fp.separate) {
      // A copy on the compute device in the parameters' dtype is written back; a
      // low-precision one is read-only: its changes are dropped.
      if (writeback && !fp.mixed) {
        fp.shard.detach().copy_(fp.full);
      } else {
        fp.stale = true;
      }
    } else if (!writeback) {
      fp.shard.detach().copy_(snapshots[next_snapshot++]);
    }
  }
  progress.summoned = false;
  Reshard();
}

void Unit::LoadShard(size_t flat, const at::Tensor& shard) {
  c10::NoGradGuard no_grad;
  FlatParam& fp = flats_[flat];
  fp.shard.detach().copy_(shard);
  // An unsharded separate copy (low precision, or on the compute device) must be refreshed
  // from the new master values.
  fp.stale = fp.separate && !sharded();
}

}  // namespace fairscale::fsdp::internal
