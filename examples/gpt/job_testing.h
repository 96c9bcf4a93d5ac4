// Running the GPT job's ranks in a test (testonly, //examples/gpt:job_testing): TrainRank at N
// ranks as real processes over tcp, and what rank 0 recorded in its metrics file. Used by the
// trainer and deterministic-mode tests.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "examples/gpt/trainer.h"

namespace fairscale::examples::gpt {

struct JobOutput {
  std::vector<double> losses;   // by step
  nlohmann::json final_record;  // null unless the run reached config.steps
  std::vector<nlohmann::json> checkpoints;  // the "checkpoint" records
  std::vector<nlohmann::json> resumes;      // the "resume" records
};

// <TEST_TMPDIR>/job_<name>.jsonl: where RunJob(..., name) has rank 0 write its metrics.
std::string MetricsPath(const std::string& name);

// Runs TrainRank at `world` ranks (processes over tcp, comm timeout 30 s, the whole run at most
// 90 s) and returns what rank 0 recorded in the metrics file MetricsPath(name) (a resumed run
// continues the file of its first part when given the same name); EXPECTs every rank OK and one
// loss per step run. Empty in the rank processes (see RunProcesses' rules for several calls in
// one test). Must be called from a gtest test body.
JobOutput RunJob(TrainConfig config, int world, const std::string& name);

// EXPECTs every step's loss of `got` within 1e-5 of `ref`'s (as many steps); returns the largest
// difference.
double ExpectSameLosses(const JobOutput& got, const JobOutput& ref, const std::string& what);

}  // namespace fairscale::examples::gpt
