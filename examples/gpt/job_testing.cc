#include "examples/gpt/job_testing.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/registry.h"
#include "comm/testing/rank_runner.h"
#include "gtest/gtest.h"
#include "testing/tmp.h"

namespace fairscale::examples::gpt {

std::string MetricsPath(const std::string& name) {
  return fairscale::testing::TmpPath(absl::StrCat("job_", name, ".jsonl"));
}

JobOutput RunJob(TrainConfig config, int world, const std::string& name) {
  config.metrics_path = MetricsPath(name);
  std::vector<absl::Status> st = comm::testing::RunProcesses(
      world,
      [&](int) -> absl::Status {
        FS_ASSIGN_OR_RETURN(std::shared_ptr<comm::Communicator> comm,
                            comm::CreateCommunicator(
                                "tcp", comm::testing::RankConfig(absl::Seconds(30))));
        return TrainRank(config, comm).status();
      },
      absl::Seconds(90));
  if (comm::testing::IsRankProcess()) return {};
  for (int r = 0; r < world; ++r) EXPECT_OK(st[r]) << name << " rank " << r;
  JobOutput out;
  std::ifstream in(config.metrics_path);
  std::string line;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (j["type"] == "train") out.losses.push_back(j["loss"].get<double>());
    if (j["type"] == "final") out.final_record = j;
    if (j["type"] == "checkpoint") out.checkpoints.push_back(j);
    if (j["type"] == "resume") out.resumes.push_back(j);
  }
  const int64_t last = config.stop_after > 0 ? config.stop_after : config.steps;
  EXPECT_EQ(out.losses.size(), static_cast<size_t>(last)) << name;
  return out;
}

double ExpectSameLosses(const JobOutput& got, const JobOutput& ref, const std::string& what) {
  EXPECT_EQ(got.losses.size(), ref.losses.size()) << what;
  double max_diff = 0;
  for (size_t i = 0; i < std::min(got.losses.size(), ref.losses.size()); ++i) {
    EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5) << what << ", step " << i + 1;
    max_diff = std::max(max_diff, std::abs(got.losses[i] - ref.losses[i]));
  }
  return max_diff;
}

}  // namespace fairscale::examples::gpt
