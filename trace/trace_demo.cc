// trace_demo: a few fake training steps on N rank threads over the inproc backend, traced.
//   ./bazelw run //trace:trace_demo -- --ranks=4 --steps=3 --trace=/tmp/trace_demo.json
// writes the merged Chrome trace (open it at ui.perfetto.dev -> "Open trace file") and prints
// the profile table (compute vs communication vs idle per rank).
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "base/flags.h"
#include "trace/internal/demo.h"

ABSL_FLAG(int, ranks, 4, "number of ranks (threads over the inproc backend)");
ABSL_FLAG(int, steps, 3, "fake training steps");
ABSL_FLAG(std::string, trace, "/tmp/trace_demo.json", "merged Chrome trace to write");
ABSL_FLAG(int, compute_rounds, 40, "fake compute per phase (passes over a 64 KiB vector)");

constexpr char kUsage[] =
    "a few fake training steps on --ranks threads over the inproc backend, traced:\n"
    "writes the merged Chrome trace (--trace; open it in ui.perfetto.dev) and prints the\n"
    "compute / communication / idle table per rank.\n"
    "\n"
    "  trace_demo --ranks=4 --steps=3 --trace=/tmp/trace_demo.json\n"
    "\n"
    "Environment read: none.";

int main(int argc, char** argv) {
  fairscale::base::ParseCommandLine(argc, argv, kUsage);
  fairscale::trace::internal::DemoOptions options;
  options.ranks = absl::GetFlag(FLAGS_ranks);
  options.steps = absl::GetFlag(FLAGS_steps);
  options.trace_path = absl::GetFlag(FLAGS_trace);
  options.compute_rounds = absl::GetFlag(FLAGS_compute_rounds);
  absl::StatusOr<std::string> table = fairscale::trace::internal::RunDemo(options);
  if (!table.ok()) {
    std::fprintf(stderr, "trace_demo: %s\n", table.status().ToString().c_str());
    return 1;
  }
  std::printf("%s\ntrace: %s (open at https://ui.perfetto.dev -> Open trace file)\n",
              table->c_str(), options.trace_path.c_str());
  return 0;
}
