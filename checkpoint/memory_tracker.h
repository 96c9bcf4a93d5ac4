// Per-module memory tracer (//checkpoint:memory_tracker), after FairScale's experimental
// LayerwiseMemoryTracker: exact CPU tensor bytes per module in forward and backward, counted by
// base::TrackingCpuAllocator, and a suggestion of which modules to checkpoint for a budget.
//
//   base::TrackingCpuAllocator* alloc = base::TrackingCpuAllocator::Install();  // before the model
//   checkpoint::MemoryTracker tracker(alloc);
//   for (size_t i = 0; i < blocks.size(); ++i)
//     x = tracker.forward("block" + std::to_string(i), *blocks[i], x,
//                         [&](const at::Tensor& in) { return blocks[i](in); });
//   loss(x).backward();
//   std::cout << tracker.table() << tracker.suggestion_table(/*budget_bytes=*/64 << 20);
//
// Definitions (bytes; "live" is the allocator's live tensor bytes):
//   activation  live after the module's forward - live before it: what the forward keeps for the
//               backward, its output included.
//   output      bytes of the module's output tensor.
//   fwd peak    peak during the forward - live before it (transient buffers included).
//   bwd peak    peak during the module's backward (from its output's gradient to its input's,
//               or to the next traced module's backward) - live when that backward started.
// Modules are assumed to run in sequence (the output of one is the input of the next), as in a
// transformer's stack of blocks. Not thread-safe: one tracker per model and thread.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/tracking_allocator.h"

namespace fairscale::checkpoint {

struct ModuleMemory {
  std::string name;
  int64_t param_bytes = 0;
  int64_t activation_bytes = 0;
  int64_t output_bytes = 0;
  int64_t fwd_peak_bytes = 0;
  int64_t bwd_peak_bytes = -1;  // -1 until its backward has run
};

// The plan suggest_checkpoints() returns.
struct CheckpointPlan {
  std::vector<std::string> checkpointed;  // in forward order
  // Estimated activation bytes kept between forward and backward plus the largest recompute.
  int64_t estimated_bytes = 0;
  int64_t plain_bytes = 0;  // the same without checkpointing: the sum of the activations
  bool fits = false;        // estimated_bytes <= budget
};

class MemoryTracker {
 public:
  // `allocator` must be installed (base::TrackingCpuAllocator::Install()).
  explicit MemoryTracker(base::TrackingCpuAllocator* allocator);

  // Runs fn(input) as the module `name` (module gives the parameter count) and records it.
  at::Tensor forward(const std::string& name, const torch::nn::Module& module,
                     const at::Tensor& input,
                     const std::function<at::Tensor(const at::Tensor&)>& fn);

  // The records, in forward order (call after backward for the bwd column).
  std::vector<ModuleMemory> records() const;
  void clear();

  // Table: module | params | activation | output | fwd peak | bwd peak (bytes in MiB).
  std::string table() const;

  // Greedy: checkpoint the modules that save the most (activation - output: a checkpointed
  // module keeps only its input, which is the previous module's output, counted there) until the
  // estimate (kept bytes + the largest checkpointed module's activation, recomputed during
  // backward) fits `budget_bytes`.
  CheckpointPlan suggest_checkpoints(int64_t budget_bytes) const;
  // The plan as a table: module | activation | saving | checkpoint? | estimate after.
  std::string suggestion_table(int64_t budget_bytes) const;

 private:
  struct State;
  base::TrackingCpuAllocator* allocator_;
  std::shared_ptr<State> state_;  // shared with the backward hooks
};

}  // namespace fairscale::checkpoint
