// The GPT job's metrics file (//examples/gpt:metrics_file, no LibTorch): one JSON object per
// line, written by rank 0 (trainer.cc) and read back on resume, by the tests and by jq.
//
// JSON has no NaN or infinity, and nlohmann writes them as `null`, which reads back as no number
// at all. Every floating-point field therefore goes through MetricNumber(): the number when
// finite, else the string "NaN", "Infinity" or "-Infinity" (Python's json spelling, so
// float(...) and pandas read it), and ReadMetricNumber() reads any of these back (and `null`,
// as files written before this read it, as NaN).
//
// A resume keeps the records up to the checkpoint's step (ReadMetricsForResume) and trusts none
// of them: a line that is not a JSON object with an integer "step", or whose "loss" is not a
// number in one of those forms, is skipped with a warning naming "<file>:<line>".
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"

namespace fairscale::examples::gpt {

nlohmann::json MetricNumber(double v);
// nullopt when `v` is none of: a number, "NaN", "Infinity", "-Infinity", null (= NaN).
std::optional<double> ReadMetricNumber(const nlohmann::json& v);

struct KeptMetrics {
  std::vector<nlohmann::json> records;  // the kept records, in order
  std::string text;                     // their lines, each ending in '\n'
  std::vector<std::string> warnings;    // "<path>:<line>: skipped ...", one per skipped line
};

// The records of the metrics file `path` with step <= keep_through_step, minus the "final" and
// "sample" records (a resumed run writes its own). A missing file keeps nothing and warns not.
KeptMetrics ReadMetricsForResume(const std::string& path, int64_t keep_through_step);

// Appends `record` to the metrics file `path` as one line, with one write(2) on an O_APPEND
// descriptor (created if missing; `truncate`: emptied first), so that several processes writing
// the file over time (the fault-tolerant job's writer moves to another replica group when its
// group dies) never interleave inside a line. kUnavailable naming the file and the OS error.
absl::Status AppendMetricsRecord(const std::string& path, const nlohmann::json& record,
                                 bool truncate = false);

}  // namespace fairscale::examples::gpt
