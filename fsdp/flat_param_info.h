// FlatParamInfo: the layout of one FSDP unit's flat parameter as the public API reports it
// (FullyShardedDataParallelImpl::flat_param_info(), LocalStateDict), for checkpoints, tests and
// debugging (//fsdp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fairscale::fsdp {

// The layout of one flat parameter, for checkpoints, tests and debugging.
struct FlatParamInfo {
  struct Entry {
    std::string name;  // relative to the root's wrapped module: "blocks.0.fc.weight"
    std::vector<std::string> aliases;  // tied names of the same tensor
    std::vector<int64_t> shape;
    int64_t offset = 0;  // in the unsharded flat parameter
    int64_t numel = 0;
    // per_parameter: this parameter's rows in every rank's shard start at shard_offset there,
    // rank_numel elements (ceil(rows / world) rows) per rank: rank q holds its flattened
    // elements [q * rank_numel, min(numel, (q + 1) * rank_numel)).
    int64_t shard_offset = 0;
    int64_t rank_numel = 0;
  };
  std::string name;  // registered name: "flat_param" (trainable) or "flat_param_frozen"
  bool requires_grad = false;
  // FsdpOptions::flatten_parameters(false): each rank's shard is the concatenation of its rows
  // of every parameter (see Entry::shard_offset), not a contiguous range of the flat parameter.
  bool per_parameter = false;
  int64_t numel = 0;         // sum of the entries
  // Sharded over the shard group (the whole world, or the HYBRID_SHARD sub-group):
  int64_t padded_numel = 0;  // shard group size * shard_numel (unsharded: numel)
  int64_t shard_numel = 0;
  int64_t shard_offset = 0;  // where this rank's shard starts in the padded flat parameter
  std::vector<Entry> params;
};

}  // namespace fairscale::fsdp
