// Chrome trace files (//trace): writing one rank's events, reading them back, merging the
// per-rank files of a job into one file that chrome://tracing and Perfetto (ui.perfetto.dev ->
// "Open trace file") show with one track group per rank.
//
// Format: the JSON Object Format of the Trace Event Format,
//   {"traceEvents": [ {"name", "cat", "ph", "ts", "pid", "tid", "args"[, "dur"][, "s"]}, ... ],
//    "displayTimeUnit": "ms"}
// ts and dur in microseconds (fractional: nanosecond resolution). Phases: "X" complete, "i"
// instant (scope "t"), "C" counter, "M" metadata (process_name, process_sort_index, thread_name,
// thread_sort_index; ts 0). Every event has name, cat, ph, ts, pid, tid.
//
// A job traces like this: each rank writes RankTracePath(path, rank), all ranks meet at a
// barrier, then one rank (or the launcher) merges:
//   MergeChromeTraces({RankTracePath(path, 0), ..., RankTracePath(path, n - 1)}, path)
// Files are written atomically (a temporary file in the same directory, then rename), so a
// reader never sees half a trace.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "trace/recorder.h"

namespace fairscale::trace {

// "<path>.rank<rank>": where rank `rank` writes its part of the trace `path`.
std::string RankTracePath(const std::string& path, int rank);

// The JSON text of `events` (the format above).
std::string ToChromeTraceJson(const std::vector<Event>& events);

// Writes `events` to `path` atomically. kInvalidArgument for a negative duration; kInternal
// naming the file for an I/O error.
absl::Status WriteChromeTrace(const std::string& path, const std::vector<Event>& events);

// Reads a file in the format above (one rank's or a merged one). kNotFound if it does not exist;
// kDataLoss naming the file and event index if it is not valid JSON or an event lacks a required
// field.
absl::StatusOr<std::vector<Event>> ReadChromeTrace(const std::string& path);

// Concatenates the events of `inputs` (written by WriteChromeTrace) into `output`, atomically.
// Each input's events are copied unchanged; the timestamps are already comparable when the ranks
// ran on one host (one CLOCK_MONOTONIC) or aligned their clocks (AlignClocks). Errors name the
// input: kNotFound, kDataLoss (corrupt), kInvalidArgument when two inputs hold the same pid
// (rank). Inputs are left in place.
absl::Status MergeChromeTraces(const std::vector<std::string>& inputs, const std::string& output);

}  // namespace fairscale::trace
