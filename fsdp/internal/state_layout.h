// The unwrapped module's view of a FullyShardedDataParallel model (//fsdp, internal), shared by
// the full state dict (state_dict.cc) and the sharded checkpoint (sharded_checkpoint.cc): where
// each original parameter lives in which flat parameter, the unwrapped parameter and buffer
// order, the one-flat-at-a-time all-gather, and the staging of new shards and optimizer states
// from a source of original-parameter ranges (validated completely before the model changes).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/state_dict.h"

namespace fairscale::fsdp::internal {

struct FlatRef {
  FullyShardedDataParallelImpl* unit = nullptr;
  FlatParamInfo info;
  at::Tensor shard;  // this rank's shard of the flat parameter (flat layout: the registered one)
  bool sharded = false;
  // The original parameter tensor of each entry; with info.per_parameter, what the optimizer
  // steps (this rank's rows).
  std::vector<at::Tensor> params;
};

// The range math of a flat parameter's shard in either layout (FlatParamInfo::per_parameter),
// written once for the state dicts and the checkpoints. fn(entry, entry_begin, shard_pos,
// length): `length` elements of the flattened entry from `entry_begin` sit in this rank's shard
// at `shard_pos`.
void ForEachShardPiece(const FlatRef& flat,
                       const std::function<void(size_t, int64_t, int64_t, int64_t)>& fn);
// The same for the part this rank writes to a sharded checkpoint: over all ranks, every element
// exactly once. Flat layout: an unsharded flat parameter split between the ranks, a sharded one
// split between the ranks holding the shard (HYBRID_SHARD's replicate group); per-parameter
// layout: written by rank 0 (unsharded) or by the first rank holding each shard.
void ForEachOwnedPiece(const FlatRef& flat, int rank, int world,
                       const std::function<void(size_t, int64_t, int64_t, int64_t)>& fn);
// Entry `e`'s full value out of GatherFlat's result, and into a padded full buffer (which
// holds, rank by rank, every rank's shard).
at::Tensor EntryFromGathered(const FlatRef& flat, size_t e, const at::Tensor& full);
void EntryToGathered(const FlatRef& flat, size_t e, const at::Tensor& value, at::Tensor& full);
// Where element `entry_begin` of entry `e` sits in this rank's shard (it must hold it).
int64_t ShardPosition(const FlatRef& flat, size_t e, int64_t entry_begin);

// The optimizer state of one flat parameter as shard-shaped tensors. Flat layout: the flat
// parameter's own state, shared by every entry. Per-parameter layout: each entry's own
// (parameters may differ in step and state tensors), laid out in shard-shaped tensors with zeros
// where an entry lacks one. Every rank finds the same entries with state.
struct FlatOptimState {
  std::vector<bool> has;        // per entry
  std::vector<int64_t> step;    // per entry
  std::vector<std::set<std::string>> names;  // per entry: its state tensors
  std::map<std::string, at::Tensor> tensors;  // by state tensor name, shard-shaped
};
FlatOptimState GetFlatOptimState(const FlatRef& flat, const torch::optim::Optimizer& optimizer);

struct ModelLayout {
  int rank = 0;
  int world = 1;
  std::vector<FlatRef> flats;            // every flat parameter, parents' units first
  std::vector<std::string> param_names;  // unwrapped named_parameters() order, aliases included
  // Name or alias -> (flat, entry).
  std::map<std::string, std::pair<size_t, size_t>> where;
  std::vector<std::pair<std::string, at::Tensor>> buffers;  // unwrapped named_buffers() order

  const FlatParamInfo::Entry& entry(const std::string& name) const {
    const auto& [f, e] = where.at(name);
    return flats[f].info.params[e];
  }
  at::ScalarType dtype(const std::string& name) const {
    return flats[where.at(name).first].shard.scalar_type();
  }
  // Primary names (aliases left out) in unwrapped order.
  std::vector<std::string> primary_names() const;
};

ModelLayout GetModelLayout(FullyShardedDataParallel& model);

// The full padded flat parameter (or optimizer state) assembled from every rank's `shard` of
// flat `f` (an all-gather over the unit's shard group into a new buffer; collective), or
// `shard` itself when unsharded.
at::Tensor GatherFlat(const ModelLayout& layout, size_t f, const at::Tensor& shard,
                      const std::string& context);

// Reads [begin, begin + dst.numel()) of the flattened tensor `key` into `dst`.
using RangeReader =
    std::function<absl::Status(const std::string& key, int64_t begin, at::Tensor dst)>;

// This rank's shards (parameters read through `params`, keys = parameter names) and buffers
// (read whole through `buffers`, keys = buffer names), as a LocalStateDict ready for
// load_local_state_dict. Nothing in the model changes.
absl::StatusOr<LocalStateDict> StageShards(const ModelLayout& layout, const RangeReader& params,
                                           const RangeReader& buffers);

// This rank's optimizer state for `optimizer` (which steps the model's shards), from `meta`
// (kind, groups, per-parameter steps and state tensor names; tensor values unused) and
// `read` (keys "<param name>/<state name>"). Validates the kind and the grouping.
struct StagedOptim {
  std::string kind;
  std::vector<std::pair<at::Tensor, std::unique_ptr<torch::optim::OptimizerParamState>>> states;
  std::vector<at::Tensor> stateless;  // shards whose state is dropped
  std::vector<std::map<std::string, double>> group_options;
};
absl::StatusOr<StagedOptim> StageOptim(const ModelLayout& layout,
                                       const torch::optim::Optimizer& optimizer,
                                       const FullOptimState& meta, const RangeReader& read);
void ApplyOptim(torch::optim::Optimizer& optimizer, StagedOptim staged);

// The optimizer's groups in the unwrapped layout (options, primary names in unwrapped order),
// kind included; state left empty.
absl::StatusOr<FullOptimState> OptimGroups(const ModelLayout& layout,
                                           const torch::optim::Optimizer& optimizer);

std::string ShapeString(at::IntArrayRef shape);

// Collective: every rank learns whether all ranks' `status` is OK. Raises `status` on a failed
// rank, and "rank(s) ... failed; nothing was changed" on the others.
void ThrowIfAnyFailed(const std::shared_ptr<comm::Communicator>& comm, const absl::Status& status,
                      const std::string& what);

}  // namespace fairscale::fsdp::internal
