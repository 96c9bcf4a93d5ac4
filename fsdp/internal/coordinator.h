// Coordinator: the step of one FSDP root and its nested units (//fsdp, internal).
//
// LibTorch has no module hooks, so the module (fully_sharded_data_parallel.h) calls PreForward
// / PostForward around the wrapped forward, and the coordinator installs the rest: a hook on
// each forward output (pre-backward: gather the unit again), a post-hook on each parameter's
// AccumulateGrad node (hand the gradient to its unit; reduce once the unit's last one came),
// and a callback queued on the autograd engine at the first of those (end of backward: reduce
// what is left, wait for every reduction, free the full parameters). It records the order in
// which units ran forward and backward in the first iteration and prefetches the next unit's
// gathers in that order afterwards. The units themselves (storage, collectives) are unit.h;
// the reductions in flight are collectives.h's ReductionQueue.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "fsdp/internal/collectives.h"
#include "fsdp/internal/unit.h"

namespace fairscale::fsdp::internal {

class Coordinator {
 public:
  // The coordinator of `unit`. A unit that has none yet (before its first forward, state dict,
  // no_sync, ...) becomes the root of itself and its nested units (with their prefixes set,
  // parents before children), replacing any coordinator those had. Raises if a unit's backward
  // is running or the units' layouts (flatten_parameters) differ.
  static Coordinator& RootOf(Unit& unit);

  Unit* root() const { return root_; }
  const std::vector<Unit*>& units() const { return units_; }
  bool backward_active() const { return backward_active_; }
  bool no_sync() const { return no_sync_; }
  void set_no_sync(bool on) { no_sync_ = on; }
  ReductionQueue& reductions() { return reductions_; }

  // Forward of `unit` (the root or a nested unit): gather (and prefetch the next unit in the
  // recorded order), then hooks on the outputs that need a gradient and the free after forward.
  void PreForward(Unit& unit);
  void PostForward(Unit& unit, const std::vector<at::Tensor>& outputs);
  // The wrapped forward threw: nothing stays gathered for a backward that will not come.
  void ForwardFailed(Unit& unit);

 private:
  explicit Coordinator(Unit* root) : root_(root) {}
  static void MakeRoot(Unit& root);
  friend class PostBackwardHook;
  friend void AttachGradHooks(Unit& unit);

  // The hooks' entry points (a unit whose root has not run forward yet raises).
  static Coordinator& Of(Unit& unit);
  void PreBackward(Unit& unit);
  // `incoming`: the gradient AccumulateGrad received in this backward (for the local gradient
  // hook; undefined if unknown).
  void OnParamGrad(Unit& unit, size_t flat, size_t slot, const at::Tensor& incoming);
  void BeginBackward();  // queues FinalizeBackward on the autograd engine, once per backward
  void FinalizeBackward();
  void ResetBackward();
  // Calls the root's local gradient hook (if any) with this backward's sums.
  void ReportLocalGrads();
  // Issues the gathers of `next` (a unit of this root that runs later) unless its backward
  // already ran in this iteration.
  void Prefetch(Unit& from, Unit* next, bool backward);
  void IssueReduce(Unit& unit, size_t flat);

  Unit* root_;
  std::vector<Unit*> units_;  // parents before children
  // Orders in which the units' forwards / pre-backward hooks ran in the first iteration; the
  // prefetches of later iterations follow them.
  std::vector<Unit*> forward_order_;
  std::vector<Unit*> backward_order_;
  bool forward_order_done_ = false;
  bool backward_order_done_ = false;
  bool backward_active_ = false;  // FinalizeBackward is queued on the engine
  bool no_sync_ = false;
  // Deterministic mode: the backward passes (micro-batches) of this step done so far.
  int64_t det_done_ = 0;
  // Deterministic mode: after each backward, every unit's full gradients join their trees; after
  // the step's last micro-batch on this rank, they are reduced.
  void FinalizeDeterministic();
  // Flat parameter `flat` of `unit` has this micro-batch's gradient: into its tree, and reduced
  // after the step's last micro-batch on this rank.
  void DeterministicFlatDone(Unit& unit, size_t flat);
  std::shared_ptr<GatherQueue> gathers_ = std::make_shared<GatherQueue>();
  ReductionQueue reductions_;
};

// Installs the post-backward hook on the AccumulateGrad node of each trainable parameter of
// `unit` (while the parameters have their full shape; see Unit::Shard).
void AttachGradHooks(Unit& unit);

}  // namespace fairscale::fsdp::internal
