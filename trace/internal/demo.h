// The trace demo job (//trace:trace_demo and its test): `ranks` threads over the inproc backend
// run a few fake training steps (forward with a prefetched all_gather, backward with an
// overlapped reduce_scatter, an exposed wait, optimizer, a loss all_reduce) through a
// TracingCommunicator, each writes RankTracePath(trace_path, rank), and rank 0 merges them into
// trace_path after a barrier.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace fairscale::trace::internal {

struct DemoOptions {
  int ranks = 4;
  int steps = 3;
  std::string trace_path = "/tmp/trace_demo.json";
  // Fake compute per phase, in multiply-adds over a 64 Ki-float vector (deterministic work, no
  // clocks).
  int compute_rounds = 40;
  absl::Duration timeout = absl::Seconds(60);
};

// Runs the demo; returns FormatProfileTable of the merged trace.
absl::StatusOr<std::string> RunDemo(const DemoOptions& options);

}  // namespace fairscale::trace::internal
