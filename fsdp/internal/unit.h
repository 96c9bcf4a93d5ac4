// Unit: the engine of one FSDP unit, with no torch::nn::Module in it (//fsdp, internal).
//
// A Unit owns what one FullyShardedDataParallel wrapper shards: its flat parameters (FlatParam,
// flat or per-parameter layout), its communicator groups (the world, the shard group and the
// HYBRID_SHARD replicate group), and the operations on them: all-gather the full parameters
// (rate-limited across the root's units by a shared GatherQueue), reshard (free them), switch
// the per-parameter views, collect the parameters' gradients into a full gradient and hand it
// to a reduction, and add a reduced shard into the optimizer's gradients. The order of those
// operations over a step is the Coordinator's (coordinator.h); the LibTorch module that holds
// a Unit is fully_sharded_data_parallel.h; the collective arithmetic is collectives.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "fsdp/flat_param_info.h"
#include "fsdp/fsdp_options.h"
#include "fsdp/local_grad_hook.h"
#include "fsdp/internal/flat_param.h"
#include "deterministic/tree.h"

namespace fairscale::fsdp::internal {

class Coordinator;
class Unit;

// The ranks a unit talks to. `shard` is the world itself unless HYBRID_SHARD; `replicate` is
// null unless HYBRID_SHARD with more than one group.
struct UnitGroups {
  std::shared_ptr<comm::Communicator> world;
  std::shared_ptr<comm::Communicator> shard;
  std::shared_ptr<comm::Communicator> replicate;
  int rank = 0;
  int world_size = 1;
  int shard_rank = 0;
  int shard_size = 1;
  int replicate_rank = 0;
  int replicate_size = 1;
};

// The groups `options` ask for over `world` (collective when HYBRID_SHARD makes its groups);
// raises c10::Error naming `label` on inconsistent options.
UnitGroups MakeUnitGroups(const std::shared_ptr<comm::Communicator>& world,
                          const FsdpOptions& options, const std::string& label);

// How errors name a unit: "FSDP unit 'blocks.0.' (Block) rank 1/4".
std::string UnitLabel(const std::string& prefix, const std::string& module_name, int rank,
                      int world_size);

// Raises c10::Error (prefixed "FullyShardedDataParallel: ") for options no unit can run with.
void ValidateOptions(const FsdpOptions& options);

// All-gathers issued and not yet waited for, over every unit of one root
// (FsdpOptions::all_gathers_in_flight): their number and the units that issued them, oldest
// first (a unit once per IssueGathers call that issued anything).
struct GatherQueue {
  int in_flight = 0;
  std::deque<Unit*> units;
};

class Unit : public std::enable_shared_from_this<Unit> {
 public:
  // Makes the groups (collective when hybrid). `module_name` only labels errors.
  Unit(std::string module_name, std::shared_ptr<comm::Communicator> comm, FsdpOptions options);
  // Waits for the unit's in-flight all-gathers (the communicator may still write into its
  // memory) and detaches its gradient hooks; a root also waits for its pending reductions.
  ~Unit();
  Unit(const Unit&) = delete;
  Unit& operator=(const Unit&) = delete;

  // Lays out `params` (the unit's own, by name relative to its module, registration order; a
  // tensor listed twice is tied) into flat parameters, trainable and frozen apart (flat or
  // per-parameter layout, sharded over the shard group, mixed-precision and offload copies),
  // pointing the parameters at `full`; then broadcasts `buffers` from rank 0 and moves/casts
  // them as the options say. Raises c10::Error naming the parameter for a parameter a nested
  // unit owns, a non-floating-point one, or mixed dtypes/devices. The parameters stay pointed
  // at `full` (allocated) so that the caller can make their AccumulateGrad nodes for the full
  // shape; FinishSharding() frees it.
  void Shard(const std::vector<std::pair<std::string, at::Tensor>>& params,
             const std::vector<std::pair<std::string, at::Tensor>>& buffers);
  void FinishSharding();

  // Identity.
  std::string label() const;  // "FSDP unit 'blocks.0.' (Block) rank 1/4"
  const std::string& prefix() const { return prefix_; }
  void set_prefix(std::string prefix) { prefix_ = std::move(prefix); }
  const FsdpOptions& options() const { return options_; }
  const UnitGroups& groups() const { return groups_; }
  // Whether this unit keeps only a shard of its parameters. With a shard group of one rank
  // (world size 1, or HYBRID_SHARD groups of 1) there is nothing to shard: every strategy then
  // runs as kNoShard (no gathers, no frees; gradients all-reduced over the world), as PyTorch
  // FSDP does.
  bool sharded() const;
  // Whether forward frees the full parameters again (kFullShard, kHybridShard).
  bool reshards_after_forward() const;

  // Storage.
  std::vector<FlatParam>& flats() { return flats_; }
  const std::vector<FlatParam>& flats() const { return flats_; }
  std::vector<FlatParamInfo> info() const;

  // Nested units (owned by nested wrappers inside this unit's module), in registration order.
  struct Nested {
    std::string path;  // in this unit's module: "blocks.0"
    std::shared_ptr<Unit> unit;
  };
  const std::vector<Nested>& nested() const { return nested_; }
  // Adds a nested unit (once); raises if it uses another communicator. Its parameters join
  // owned_params(), which Shard checks against (tied weights across units).
  void AddNested(const std::string& path, std::shared_ptr<Unit> unit);
  // Every parameter this unit and its nested units own, with its name relative to this unit.
  const std::vector<std::pair<const c10::TensorImpl*, std::string>>& owned_params() const {
    return owned_params_;
  }

  // Gathering. IssueGathers starts the all-gathers of the flat parameters whose full value is
  // not there (first waiting for the oldest units' gathers while more than
  // all_gathers_in_flight would be in flight); WaitGathers completes them (per-parameter
  // layout: copies out the staging buffer). Reshard frees the full parameters of a sharded
  // unit; SetParamViews switches the per-parameter views (a no-op for the flat layout).
  int GathersNeeded() const;
  void IssueGathers();
  void WaitGathers();
  void Reshard();
  void SetParamViews(bool full);

  // Gradients. AccumulateGrad moves parameter `slot`'s fresh gradient into the flat gradient
  // (or leaves it in the attached views) and returns whether every slot of the flat parameter
  // has now reported; NeedsGradBuffer says whether that call is about to allocate a full
  // gradient (the coordinator first completes older reductions). AttachGradViews points the
  // parameters' .grad at the shard's .grad (FlatParam::grad_views). TakeGradient hands out the
  // pre-divided full gradient of a flat parameter for its reduction. AddReduced adds this
  // rank's reduced block (post-divided here) into the optimizer's gradients.
  bool NeedsGradBuffer(size_t flat, size_t slot) const;
  bool AccumulateGrad(size_t flat, size_t slot);
  void AttachGradViews(FlatParam& fp);
  at::Tensor TakeGradient(size_t flat);
  void AddReduced(size_t flat, const at::Tensor& recv, bool in_place);
  // Whether every flat parameter of this unit that needs a gradient has it complete (except
  // `flat`, which the caller is completing).
  bool GradientsCompleteBesides(size_t flat) const;
  // Local gradient statistics (local_grad_hook.h): AddLocalGradSqr adds the squared norm of
  // `grad`, a slot's incoming gradient of this backward, to the slot's sum; LocalGradSqrs
  // appends one entry per trainable tensor the optimizer steps (the shard, or per-parameter
  // each parameter) with this backward's sums.
  void AddLocalGradSqr(size_t flat, size_t slot, const at::Tensor& grad);
  void LocalGradSqrs(std::vector<LocalGradSqr>& out) const;
  void ResetBackward();  // per-backward bookkeeping back to its start
  // The optimizer steps next: unsharded low-precision copies must be refreshed.
  void MarkStale();

  // Deterministic mode (FsdpOptions::deterministic). The layout of the step's micro-batches over
  // the world (null otherwise). PushMicroBatchGrad adds this backward's full gradient of flat
  // parameter `flat` (zeros where no gradient came) to its tree as micro-batch `index`;
  // ReduceDeterministic reduces the step's partial sums over the tree (the shard group, then
  // the replicate group; or the world when unsharded), divides by the micro-batch count and
  // adds the result into the optimizer's gradients.
  const deterministic::MicroBatchLayout* det_layout() const {
    return det_layout_ ? &*det_layout_ : nullptr;
  }
  void PushMicroBatchGrad(size_t flat, int64_t index);
  void ReduceDeterministic(size_t flat);

  // Full parameters outside the training path (summon_full_params): each rank's slice of the
  // full parameters back into its shard (`writeback`), or the changes dropped.
  std::vector<at::Tensor> SnapshotShards(bool writeback) const;
  void EndSummon(bool writeback, const std::vector<at::Tensor>& snapshots, size_t& next_snapshot);
  // Local state dicts: copies `shard` into flat parameter `flat`'s shard.
  void LoadShard(size_t flat, const at::Tensor& shard);

  // The root this unit belongs to (null before the root's first forward) and the gather queue
  // it shares with the root's other units.
  const std::shared_ptr<Coordinator>& coordinator() const { return coordinator_; }
  void JoinRoot(std::shared_ptr<Coordinator> coordinator, std::shared_ptr<GatherQueue> gathers);

  // Where this unit is in the current step (the Coordinator's bookkeeping).
  struct Progress {
    int forward_index = -1;   // position in the recorded forward order
    int backward_index = -1;  // position in the recorded backward order
    bool forwarded = false;   // ran a forward whose backward is still to come
    bool pre_backward_done = false;
    bool summoned = false;    // inside summon_full_params
    bool in_forward = false;
  };
  Progress progress;

  // The root's observer of the local gradients (FullyShardedDataParallelImpl::
  // register_local_grad_hook); only the root's is called.
  LocalGradHook local_grad_hook;

 private:
  void LayoutFlat(FlatParam& fp, std::vector<ParamSlot>& slots);
  void InitBuffers(const std::vector<at::Tensor>& buffers);
  // The padded full gradient of this backward (zeros where a slot got none); empties full_grad.
  at::Tensor TakeFullGrad(FlatParam& fp);
  // Adds this rank's reduced block `recv` into the optimizer's gradients (the shard's .grad, or
  // per parameter their rows), on the shard's device.
  void AddToShardGrad(FlatParam& fp, const at::Tensor& recv);
  // Deterministic mode: the layout (checked: local) at construction; every group member's tree
  // nodes once the ranks agreed on the mode in Shard (collective: two small all-gathers when
  // HYBRID_SHARD has a replicate group, one when sharded).
  void InitDeterministic();
  void InitDeterministicGroups();
  // Per-parameter layout: the shard layout's world size and this rank's index in it.
  int dim0_world() const { return sharded() ? groups_.shard_size : 1; }
  int dim0_rank() const { return sharded() ? groups_.shard_rank : 0; }

  std::string module_name_;
  FsdpOptions options_;
  UnitGroups groups_;
  std::string prefix_;
  std::vector<FlatParam> flats_;
  std::vector<Nested> nested_;
  std::vector<std::pair<const c10::TensorImpl*, std::string>> owned_params_;
  std::shared_ptr<Coordinator> coordinator_;
  std::shared_ptr<GatherQueue> gathers_;
  std::optional<deterministic::MicroBatchLayout> det_layout_;
  std::vector<std::vector<deterministic::Node>> det_world_nodes_;      // by world rank
  std::vector<std::vector<deterministic::Node>> det_shard_nodes_;      // by shard rank
  std::vector<std::vector<deterministic::Node>> det_replicate_nodes_;  // by replicate rank
};

}  // namespace fairscale::fsdp::internal
