#include "examples/gpt/checkpoints.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "base/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/tmp.h"
#include "train_state/step_dir.h"

namespace fairscale::examples::gpt {
namespace {

namespace fs = std::filesystem;
using ::fairscale::base::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Optional;

class CheckpointsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fairscale::testing::TmpPath(absl::StrCat(
        "gpt_ckpt_", getpid(), "_", ::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  // A step directory as the CheckpointManager writes it: one item ("model") with one file, and
  // COMPLETE with the job's metadata when `complete`.
  std::string MakeStep(int64_t step, bool complete) {
    const std::string dir = train_state::StepDir(root_, step);
    fs::create_directories(dir + "/model");
    std::ofstream(dir + "/model/rank00000.shard") << "step " << step << std::string(500, 'x');
    if (complete) {
      train_state::Marker m;
      m.step = step;
      m.world_size = 2;
      absl::StatusOr<train_state::FileDigest> d =
          train_state::DigestFile(dir + "/model", "rank00000.shard");
      EXPECT_OK(d.status());
      m.items["model"] = {"fsdp_sharded", {*d}};
      m.metadata = {{"config", {{"width", 8}, {"steps", 40}}},
                    {"full_param_fnv1a64", "00000000000000ab"}};
      EXPECT_OK(train_state::WriteMarker(dir, m));
    }
    return dir;
  }
  // A step directory in one of train_gpt's formats from before //train_state.
  std::string MakeLegacyStep(int64_t step, const nlohmann::json& complete) {
    const std::string dir = train_state::StepDir(root_, step);
    fs::create_directories(dir);
    std::ofstream(dir + "/rank0.pt") << "old";
    std::ofstream(dir + "/COMPLETE") << complete.dump();
    return dir;
  }
  std::string root_;
};

TEST_F(CheckpointsTest, NoDirectoryOrNoCompleteStepMeansNoCheckpoint) {
  for (const std::string& root : {root_ + "/missing", root_}) {
    if (root == root_) MakeStep(10, /*complete=*/false);
    absl::StatusOr<std::optional<LatestCheckpoint>> latest = FindLatestCheckpoint(root);
    ASSERT_OK(latest.status());
    EXPECT_FALSE(latest->has_value()) << root;
  }
  EXPECT_OK(RefuseToOverwriteCheckpoints(root_));
}

TEST_F(CheckpointsTest, FindsTheNewestCompleteWithItsMetadata) {
  MakeStep(10, true);
  const std::string dir20 = MakeStep(20, true);
  MakeStep(30, false);  // an interrupted save
  absl::StatusOr<std::optional<LatestCheckpoint>> latest = FindLatestCheckpoint(root_);
  ASSERT_OK(latest.status());
  ASSERT_TRUE(latest->has_value());
  EXPECT_EQ((*latest)->dir, dir20);
  EXPECT_EQ((*latest)->marker.step, 20);
  EXPECT_EQ(MarkerConfig((*latest)->marker)["width"], 8);
  EXPECT_THAT(MarkerFullParamHash((*latest)->marker), Optional(std::string("00000000000000ab")));
  train_state::Marker bare;
  EXPECT_TRUE(MarkerConfig(bare).is_null());
  EXPECT_EQ(MarkerFullParamHash(bare), std::nullopt);
  bare.metadata = {{"full_param_fnv1a64", 5}};  // wrong type: absent
  EXPECT_EQ(MarkerFullParamHash(bare), std::nullopt);
}

// Every format train_gpt wrote before //train_state is refused by name, never half-read.
TEST_F(CheckpointsTest, LegacyFormatsAreRefusedNamingTheFormat) {
  const nlohmann::json files = nlohmann::json::array({{{"name", "rank0.pt"}, {"bytes", 3},
                                                       {"fnv1a64", "0"}}});
  for (const std::string format : {"", "fsdp_sharded", "pipe_stages", "pipe_fsdp_sharded"}) {
    SCOPED_TRACE(format);
    fs::remove_all(root_);
    nlohmann::json c = {{"step", 6}, {"world_size", 4}, {"files", files}, {"config", {}}};
    if (!format.empty()) c["format"] = format;
    const std::string dir = MakeLegacyStep(6, c);
    EXPECT_THAT(FindLatestCheckpoint(root_),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         AllOf(HasSubstr(dir), HasSubstr(format.empty() ? "rank_files" : format),
                               HasSubstr("--overwrite_checkpoints"))));
  }
}

TEST_F(CheckpointsTest, GarbledMarkerIsDataLossNamingIt) {
  const std::string dir = MakeStep(10, true);
  std::ofstream(dir + "/COMPLETE") << "{\"format\": \"fairscale.train_state.v1\", \"step\": ";
  EXPECT_THAT(FindLatestCheckpoint(root_),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr(dir + "/COMPLETE")));
}

TEST_F(CheckpointsTest, RefusesToOverwriteCompleteCheckpoints) {
  MakeStep(10, true);
  const std::string newest = MakeStep(20, true);
  EXPECT_THAT(RefuseToOverwriteCheckpoints(root_),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("2 complete checkpoints"), HasSubstr(newest),
                             HasSubstr("--resume"), HasSubstr("--overwrite_checkpoints"))));
  ASSERT_OK(RemoveAllCheckpoints(root_));
  EXPECT_TRUE(train_state::ListSteps(root_).empty());
  EXPECT_OK(RefuseToOverwriteCheckpoints(root_));
}

TEST_F(CheckpointsTest, OlderIntactCheckpointHint) {
  const std::string old = MakeStep(10, true);
  const std::string newest = MakeStep(20, true);
  const absl::Status damaged = absl::DataLossError("checkpoint file X is corrupt");
  EXPECT_THAT(WithOlderCheckpointHint(damaged, root_),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("checkpoint file X is corrupt"),
                             HasSubstr("newest intact checkpoint before it is " + old),
                             HasSubstr("mv " + newest + " " + newest + ".damaged"))));
  // Once the damaged one is moved aside, it no longer counts as a step directory.
  fs::rename(newest, newest + ".damaged");
  absl::StatusOr<std::optional<LatestCheckpoint>> latest = FindLatestCheckpoint(root_);
  ASSERT_OK(latest.status());
  ASSERT_TRUE(latest->has_value());
  EXPECT_EQ((*latest)->dir, old);
  // No intact older one: say so. Other codes are not touched.
  fs::rename(newest + ".damaged", newest);
  std::ofstream(old + "/model/rank00000.shard", std::ios::app) << "more";
  EXPECT_THAT(WithOlderCheckpointHint(damaged, root_),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("no older intact checkpoint")));
  EXPECT_THAT(WithOlderCheckpointHint(absl::NotFoundError("x"), root_),
              StatusIs(absl::StatusCode::kNotFound, "x"));
}

TEST_F(CheckpointsTest, NoCompleteCheckpointErrorSaysWhatToDo) {
  EXPECT_THAT(NoCompleteCheckpointError(root_),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr(root_), HasSubstr("--resume=auto"))));
}

}  // namespace
}  // namespace fairscale::examples::gpt
