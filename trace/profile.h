// Profile summary (//trace): where each rank's time went, computed from its trace events (a
// Recorder's, or a merged file's via ReadChromeTrace). The training job prints
// FormatProfileTable(Summarize(events)) for `--profile`.
//
// Definitions, per rank (pid); every quantity is a measure of a union of time intervals, so
// nested or concurrent spans never count twice:
//   wall      = from the earliest start to the latest end of the rank's complete ("X") events.
//   W         = union of the spans of category "wait": a thread of the rank blocked in
//               Work::Wait on a traced operation (TracingCommunicator records them).
//   compute   = |C \ W|, C = union of the spans of category "compute" (forward, backward,
//               optimizer, any thread of the rank): compute scopes minus the time blocked in
//               waits inside them (e.g. FSDP waiting for an all_gather inside "forward").
//   comm      = |M|, M = union of the spans of category "comm": each collective from the moment it
//               was issued to the moment it completed (queueing behind earlier operations
//               included). Time when at least one collective was in flight.
//   overlapped comm = |M ∩ (C \ W)|: communication hidden behind compute.
//   exposed comm    = |M \ (C \ W)|: communication in flight while the rank computed nothing, i.e.
//               it was blocked in a wait or had nothing else to do ("comm %" below). This is the
//               "time blocked in communication".
//   idle      = wall - compute - exposed comm: neither computing nor communicating (data loading,
//               untraced glue, a wait on something untraced, ...).
// compute + exposed comm + idle = wall. wait = |W| is reported too (a part of exposed comm when
// the waits are on traced collectives).
// Events of other categories (instants, counters, other spans) count only towards wall.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "trace/recorder.h"

namespace fairscale::trace {

// One collective kind on one rank (or summed over ranks in the table's footer).
struct CollectiveStat {
  std::string name;       // "all_gather", ...
  int64_t count = 0;
  int64_t total_ns = 0;   // sum of issue->completion spans (may exceed wall when ops overlap)
  int64_t bytes = 0;      // sum of the events' "bytes" argument
};

struct ProfileSummary {
  int rank = 0;
  int64_t wall_ns = 0;
  int64_t compute_ns = 0;          // |C \ W|
  int64_t wait_ns = 0;             // |W|
  int64_t comm_ns = 0;             // |M|
  int64_t comm_overlapped_ns = 0;  // |M ∩ (C \ W)|
  int64_t comm_exposed_ns = 0;     // |M \ (C \ W)|
  int64_t idle_ns = 0;             // wall - compute - exposed
  int64_t bytes = 0;               // sum of "bytes" over the comm events
  int64_t collectives = 0;         // number of comm events
  // Per collective name, largest total time first (ties: more bytes first, then name).
  std::vector<CollectiveStat> by_op;
};

// One summary per pid that has at least one complete event, in rank order.
std::vector<ProfileSummary> Summarize(const std::vector<Event>& events);

// Summarize(ReadChromeTrace(path)).
absl::StatusOr<std::vector<ProfileSummary>> SummarizeTraceFile(const std::string& path);

// An aligned text table, one row per rank:
//   rank  wall ms  compute %  comm %  overlap %  idle %  collectives  MiB
// (comm % = exposed comm / wall; overlap % = overlapped comm / wall), then the `top` collective
// kinds over all ranks by total time, with count, time and bytes.
std::string FormatProfileTable(const std::vector<ProfileSummary>& summaries, int top = 5);

}  // namespace fairscale::trace
