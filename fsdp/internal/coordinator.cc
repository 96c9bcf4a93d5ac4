#include "fsdp/internal/coordinator.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <functional>
#include <string>

namespace fairscale::fsdp::internal {

// Runs after a parameter's AccumulateGrad node: hands the gradient to its unit. `inputs` is the
// gradient of this backward that AccumulateGrad received (the engine passes a post hook the
// node's inputs), whatever .grad holds now.
class PostBackwardHook : public torch::autograd::FunctionPostHook {
 public:
  PostBackwardHook(std::weak_ptr<Unit> unit, size_t flat, size_t slot)
      : unit_(std::move(unit)), flat_(flat), slot_(slot) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& inputs) override {
    if (auto unit = unit_.lock()) {
      Coordinator::Of(*unit).OnParamGrad(*unit, flat_, slot_,
                                         inputs.empty() ? at::Tensor() : inputs[0]);
    }
    return outputs;
  }

 private:
  std::weak_ptr<Unit> unit_;
  size_t flat_;
  size_t slot_;
};

void AttachGradHooks(Unit& unit) {
  std::vector<FlatParam>& flats = unit.flats();
  for (size_t f = 0; f < flats.size(); ++f) {
    if (!flats[f].requires_grad) continue;
    for (size_t s = 0; s < flats[f].slots.size(); ++s) {
      ParamSlot& slot = flats[f].slots[s];
      slot.grad_accumulator = torch::autograd::impl::grad_accumulator(slot.param);
      slot.hook_key = slot.grad_accumulator->add_post_hook(
          std::make_unique<PostBackwardHook>(unit.weak_from_this(), f, s));
    }
  }
}

Coordinator& Coordinator::Of(Unit& unit) {
  TORCH_CHECK(unit.coordinator() != nullptr, unit.label(), ": backward before the first forward");
  return *unit.coordinator();
}

Coordinator& Coordinator::RootOf(Unit& unit) {
  if (!unit.coordinator()) MakeRoot(unit);
  return *unit.coordinator();
}

void Coordinator::MakeRoot(Unit& root) {
  std::shared_ptr<Coordinator> c(new Coordinator(&root));
  const bool flatten = root.options().flatten_parameters();
  std::function<void(Unit&, const std::string&)> visit = [&](Unit& unit,
                                                             const std::string& prefix) {
    TORCH_CHECK(!unit.coordinator() || !unit.coordinator()->backward_active_, unit.label(),
                ": becomes part of a new root while its backward is running");
    TORCH_CHECK(unit.options().flatten_parameters() == flatten, unit.label(),
                ": flatten_parameters(", unit.options().flatten_parameters() ? "true" : "false",
                ") but its root has flatten_parameters(", flatten ? "true" : "false",
                "); every unit of a model must use the same layout");
    TORCH_CHECK(unit.options().deterministic() == root.options().deterministic() &&
                    unit.options().micro_batches() == root.options().micro_batches(),
                unit.label(), ": deterministic(", unit.options().deterministic() ? "true" : "false",
                ") micro_batches(", unit.options().micro_batches(), ") but its root has deterministic(",
                root.options().deterministic() ? "true" : "false", ") micro_batches(",
                root.options().micro_batches(), "); every unit of a model must use the same mode");
    TORCH_CHECK(&unit == &root || !unit.local_grad_hook, unit.label(),
                ": has a local gradient hook but becomes part of the root ", root.label(),
                ", whose backward it joins; register the hook on that root instead");
    unit.JoinRoot(c, c->gathers_);
    unit.set_prefix(prefix);
    unit.progress.forward_index = unit.progress.backward_index = -1;
    c->units_.push_back(&unit);
    for (const Unit::Nested& n : unit.nested()) visit(*n.unit, prefix + n.path + ".");
  };
  visit(root, root.prefix());
}

// ---- forward -------------------------------------------------------------------------------

void Coordinator::PreForward(Unit& unit) {
  Unit::Progress& pr = unit.progress;
  pr.in_forward = true;
  if (!forward_order_done_ &&
      std::find(forward_order_.begin(), forward_order_.end(), &unit) == forward_order_.end()) {
    pr.forward_index = static_cast<int>(forward_order_.size());
    forward_order_.push_back(&unit);
  }
  unit.IssueGathers();
  if (forward_order_done_ && unit.options().forward_prefetch() && pr.forward_index >= 0 &&
      pr.forward_index + 1 < static_cast<int>(forward_order_.size())) {
    Prefetch(unit, forward_order_[pr.forward_index + 1], /*backward=*/false);
  }
  unit.WaitGathers();
  unit.SetParamViews(true);
}

void Coordinator::PostForward(Unit& unit, const std::vector<at::Tensor>& outputs) {
  unit.progress.in_forward = false;
  bool needs_backward = false;
  if (c10::GradMode::is_enabled()) {
    std::weak_ptr<Unit> weak = unit.weak_from_this();
    for (const at::Tensor& t : outputs) {
      if (!t.defined() || !t.requires_grad()) continue;
      needs_backward = true;
      t.register_hook([weak](const at::Tensor&) {
        if (auto u = weak.lock()) Of(*u).PreBackward(*u);
      });
    }
  }
  if (needs_backward) unit.progress.forwarded = true;
  const bool is_root = &unit == root_;
  const bool keep = is_root && unit.options().disable_reshard_on_root();
  if (unit.reshards_after_forward() && !keep) unit.Reshard();
  if (!is_root) return;
  if (!forward_order_.empty()) forward_order_done_ = true;
  // No backward will use the full parameters of this forward: nothing stays gathered, so no
  // unit can compute with a copy that an optimizer step makes stale.
  if (!needs_backward && !backward_active_) {
    for (Unit* u : units_) {
      if (!u->progress.forwarded) u->Reshard();
    }
  }
}

void Coordinator::ForwardFailed(Unit& unit) {
  unit.progress.in_forward = false;
  if (&unit != root_) return;
  for (Unit* u : units_) {
    if (!u->progress.forwarded) u->Reshard();
  }
}

void Coordinator::Prefetch(Unit& from, Unit* next, bool backward) {
  if (next == nullptr || next == &from || next->coordinator().get() != this) return;
  if (backward && next->progress.pre_backward_done) return;
  next->IssueGathers();
}

// ---- backward ------------------------------------------------------------------------------

void Coordinator::BeginBackward() {
  if (backward_active_) return;
  backward_active_ = true;
  std::weak_ptr<Unit> root = root_->weak_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([root] {
    if (auto r = root.lock()) Of(*r).FinalizeBackward();
  });
}

void Coordinator::PreBackward(Unit& unit) {
  BeginBackward();
  Unit::Progress& pr = unit.progress;
  if (pr.pre_backward_done) return;
  pr.pre_backward_done = true;
  for (FlatParam& fp : unit.flats()) {
    if (fp.grad_views) unit.AttachGradViews(fp);
  }
  if (!backward_order_done_) {
    pr.backward_index = static_cast<int>(backward_order_.size());
    backward_order_.push_back(&unit);
  }
  unit.IssueGathers();
  if (backward_order_done_ &&
      unit.options().backward_prefetch() == BackwardPrefetch::kBackwardPre &&
      pr.backward_index >= 0 && pr.backward_index + 1 < static_cast<int>(backward_order_.size())) {
    Prefetch(unit, backward_order_[pr.backward_index + 1], /*backward=*/true);
  }
  unit.WaitGathers();
  unit.SetParamViews(true);
}

void Coordinator::OnParamGrad(Unit& unit, size_t flat, size_t slot, const at::Tensor& incoming) {
  BeginBackward();
  c10::NoGradGuard no_grad;
  if (root_->local_grad_hook && incoming.defined()) unit.AddLocalGradSqr(flat, slot, incoming);
  // Starting this unit's full gradient: first let older reductions finish down to the allowed
  // number, so their full gradients are freed before this one is allocated.
  if (unit.NeedsGradBuffer(flat, slot)) {
    reductions_.Drain(static_cast<size_t>(unit.options().reductions_in_flight()));
  }
  if (!unit.AccumulateGrad(flat, slot)) return;
  if (unit.det_layout() != nullptr) {
    // Deterministic mode: this flat parameter's gradient of this micro-batch is complete: into
    // its tree now (and, after the step's last micro-batch, reduced now), so the full gradient
    // is freed during backward as in the default mode.
    DeterministicFlatDone(unit, flat);
    if (unit.sharded() && unit.flats()[flat].requires_grad && unit.flats().size() == 1) {
      unit.Reshard();
    }
    return;
  }
  if (no_sync_) return;
  // Every use of this flat parameter in backward is done: free it now rather than at the end.
  if (unit.sharded() && unit.flats()[flat].requires_grad && unit.flats().size() == 1) {
    unit.Reshard();
  }
  // BACKWARD_POST: this unit's gradient is complete (all its flat parameters that need one),
  // so the next unit's gather goes out now, ahead of this unit's reduction.
  const int next = unit.progress.backward_index + 1;
  if (backward_order_done_ &&
      unit.options().backward_prefetch() == BackwardPrefetch::kBackwardPost && next > 0 &&
      next < static_cast<int>(backward_order_.size()) && unit.GradientsCompleteBesides(flat)) {
    Prefetch(unit, backward_order_[next], /*backward=*/true);
  }
  IssueReduce(unit, flat);
}

void Coordinator::IssueReduce(Unit& unit, size_t flat) {
  const bool in_place = unit.flats()[flat].grad_views;
  reductions_.Submit(unit, flat, unit.TakeGradient(flat), in_place);
}

void Coordinator::DeterministicFlatDone(Unit& unit, size_t flat) {
  const deterministic::MicroBatchLayout& layout = *root_->det_layout();
  unit.flats()[flat].reduced = true;  // handled in this backward
  unit.PushMicroBatchGrad(flat, layout.first() + det_done_);
  if (det_done_ + 1 < layout.per_rank()) return;
  TORCH_CHECK(!no_sync_, root_->label(), ": deterministic mode reduces the gradients after this "
              "rank's last micro-batch of the step (", layout.per_rank(), " of ",
              layout.micro_batches, " micro-batches over ", layout.world,
              " ranks), but no_sync() covers it; run the last backward outside no_sync()");
  unit.ReduceDeterministic(flat);
}

void Coordinator::FinalizeDeterministic() {
  // Flat parameters whose gradient did not complete in this backward (unused parameters, or
  // none at all: zeros) join their trees now, in the same order on every rank.
  for (Unit* u : units_) {
    for (size_t f = 0; f < u->flats().size(); ++f) {
      const FlatParam& fp = u->flats()[f];
      if (fp.requires_grad && !fp.reduced) DeterministicFlatDone(*u, f);
    }
  }
  ++det_done_;
  if (det_done_ == root_->det_layout()->per_rank()) det_done_ = 0;
}

void Coordinator::FinalizeBackward() {
  if (root_->det_layout() != nullptr) {
    try {
      FinalizeDeterministic();
      for (Unit* u : units_) {
        u->Reshard();
        u->MarkStale();
      }
      if (!backward_order_.empty()) backward_order_done_ = true;
      ReportLocalGrads();
    } catch (...) {
      ResetBackward();
      throw;
    }
    ResetBackward();
    return;
  }
  try {
    // Units whose gradients did not all arrive (unused parameters) reduce now, in the same
    // order on every rank.
    for (Unit* u : units_) {
      for (size_t f = 0; f < u->flats().size() && !no_sync_; ++f) {
        const FlatParam& fp = u->flats()[f];
        if (fp.requires_grad && !fp.reduced &&
            (u->progress.forwarded || fp.full_grad.defined() || fp.grads_ready > 0)) {
          IssueReduce(*u, f);
        }
      }
    }
    reductions_.Flush(static_cast<size_t>(std::max(1, root_->options().reductions_in_flight())));
    reductions_.WaitAll();
    for (Unit* u : units_) {
      u->Reshard();
      u->MarkStale();  // the optimizer steps next
    }
    if (!backward_order_.empty()) backward_order_done_ = true;
    ReportLocalGrads();
  } catch (...) {
    ResetBackward();
    throw;
  }
  ResetBackward();
}

void Coordinator::ReportLocalGrads() {
  if (!root_->local_grad_hook) return;
  std::vector<LocalGradSqr> report;
  for (Unit* u : units_) u->LocalGradSqrs(report);
  root_->local_grad_hook(report);
}

void Coordinator::ResetBackward() {
  for (Unit* u : units_) u->ResetBackward();
  reductions_.Clear();
  backward_active_ = false;
}

}  // namespace fairscale::fsdp::internal
