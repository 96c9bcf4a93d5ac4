// The start-state check of FsdpOptions::sync_module_states (//fsdp, internal): every rank must
// start from the same parameters.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "fsdp/internal/flat_param.h"

namespace fairscale::fsdp::internal {

// A 64-bit hash of `t`'s shape and dtype and one of its bytes (in row-major order, whatever its
// strides or device), the same in every process.
struct TensorHash {
  uint64_t shape = 0;
  uint64_t values = 0;
};
TensorHash HashTensor(const at::Tensor& t);

// Compares `slots`' parameters across the ranks of `world` by hash (one all-gather). A shape
// difference raises c10::Error on every rank; a value difference raises too unless
// `broadcast`, which then copies rank 0's values into every rank's parameters. Errors name the
// first differing parameter and two ranks that disagree, prefixed with `label`. Collective.
// `micro_batches` > 0: this rank runs deterministic mode with that many micro-batches per step
// (FsdpOptions::micro_batches); the ranks must agree on it (checked with the counts).
void CheckOrBroadcastParams(comm::Communicator& world, const std::vector<const ParamSlot*>& slots,
                            bool broadcast, const std::string& label, int64_t micro_batches = 0);

}  // namespace fairscale::fsdp::internal
