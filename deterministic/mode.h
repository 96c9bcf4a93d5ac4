// What every package's deterministic mode checks before work starts (//deterministic).
#pragma once

#include <cstdint>
#include <string>

#include "comm/communicator.h"

namespace fairscale::deterministic {

// Collective over `comm`: every rank passes whether it runs deterministic mode and its
// micro-batches per step (0 when not deterministic); raises c10::Error on every rank, naming
// the ranks that disagree and their settings, if they differ ("<what>: rank 1/4 runs
// deterministic mode with 24 micro-batches per step, rank 3 runs the default mode"), so that a
// job mixing modes fails at construction instead of silently training differently. One
// all-gather of 16 bytes per rank.
void CheckSameMode(comm::Communicator& comm, bool deterministic, int64_t micro_batches,
                   const std::string& what);

// "deterministic mode with 24 micro-batches per step" / "the default (non-deterministic) mode".
std::string DescribeMode(bool deterministic, int64_t micro_batches);

// Raises c10::Error unless LibTorch's CPU kernels run on one intra-op thread
// (at::set_num_threads(1)): their reductions (sums, norms, matmuls) split the work by thread
// count, so the same micro-batch would give other bits on a machine with other core counts.
void CheckThreads(const std::string& what);

}  // namespace fairscale::deterministic
