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
  at::Tensor shard;  // the registered flat parameter (this rank's shard)
  bool sharded = false;
};

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
