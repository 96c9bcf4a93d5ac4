#include "examples/gpt/checkpoint_dir.h"

#include <unistd.h>

#include <filesystem>
#include <functional>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/tmp.h"

namespace fairscale::examples::gpt {
namespace {

namespace fs = std::filesystem;
using ::fairscale::base::testing::StatusIs;
using ::testing::HasSubstr;

class CheckpointDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fairscale::testing::TmpPath(absl::StrCat(
        "ckpt_", getpid(), "_", ::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  // A step directory with `world` rank files of distinct contents, complete or not.
  std::string MakeStep(int64_t step, int world, bool complete) {
    const std::string dir = StepDir(root_, step);
    fs::create_directories(dir);
    for (int r = 0; r < world; ++r) {
      std::ofstream(RankFile(dir, r)) << "rank " << r << " of step " << step << std::string(1000, 'x');
    }
    if (complete) {
      EXPECT_OK(WriteComplete(dir, step, world, {{"width", 8}}));
    }
    return dir;
  }
  std::string root_;
};

TEST_F(CheckpointDirTest, Names) {
  EXPECT_EQ(StepDir("/c", 40), "/c/step_00000040");
  EXPECT_EQ(RankFile("/c/step_00000040", 3), "/c/step_00000040/rank3.pt");
  EXPECT_EQ(ShardFileName(3), "rank00003.shard");
}

// The fsdp mode's sharded step directory: COMPLETE lists the shards and the manifest (not one
// file per rank) with the format and the trainer's state; a file changed later is caught.
TEST_F(CheckpointDirTest, ShardedFormatListsShardsAndManifest) {
  const std::string dir = StepDir(root_, 8);
  fs::create_directories(dir);
  const std::vector<std::string> files = {ShardFileName(0), ShardFileName(1), kShardManifestName};
  for (const std::string& f : files) std::ofstream(dir + "/" + f) << f << std::string(100, 'x');
  ASSERT_OK(WriteComplete(dir, 8, 2, kFormatFsdpSharded, files, {{"width", 8}},
                          {{"full_param_fnv1a64", "0123456789abcdef"}}));
  ASSERT_OK_AND_ASSIGN(auto latest, FindLatestComplete(root_));
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->format, kFormatFsdpSharded);
  EXPECT_EQ(latest->world_size, 2);
  EXPECT_EQ(latest->trainer_state["full_param_fnv1a64"], "0123456789abcdef");
  ASSERT_EQ(latest->files.size(), 3u);
  EXPECT_EQ(latest->files[2].name, "manifest.json");
  EXPECT_OK(VerifyCheckpoint(*latest));
  std::ofstream(dir + "/manifest.json", std::ios::app) << "!";
  EXPECT_THAT(VerifyCheckpoint(*latest),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr(dir + "/manifest.json is corrupt")));
  // A marker without "format" (written before it existed) reads as the per-rank format.
  const std::string old_dir = MakeStep(4, 1, true);
  fs::remove_all(dir);
  ASSERT_OK_AND_ASSIGN(std::string text, ReadFile(old_dir + "/COMPLETE"));
  nlohmann::json j = nlohmann::json::parse(text);
  j.erase("format");
  j.erase("trainer_state");
  ASSERT_OK(WriteFileAtomic(old_dir + "/COMPLETE", j.dump()));
  ASSERT_OK_AND_ASSIGN(latest, FindLatestComplete(root_));
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->format, kFormatRankFiles);
  EXPECT_TRUE(latest->trainer_state.empty());
  EXPECT_OK(VerifyCheckpoint(*latest));
}

TEST_F(CheckpointDirTest, NoDirectoryMeansNoCheckpoint) {
  ASSERT_OK_AND_ASSIGN(auto latest, FindLatestComplete(root_ + "/absent"));
  EXPECT_FALSE(latest.has_value());
}

TEST_F(CheckpointDirTest, FindsTheNewestCompleteAndSkipsIncomplete) {
  MakeStep(10, 2, true);
  MakeStep(20, 2, true);
  MakeStep(30, 2, false);  // killed during the save: no COMPLETE
  ASSERT_OK_AND_ASSIGN(auto latest, FindLatestComplete(root_));
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->step, 20);
  EXPECT_EQ(latest->world_size, 2);
  EXPECT_EQ(latest->dir, StepDir(root_, 20));
  EXPECT_EQ(latest->config["width"], 8);
  ASSERT_EQ(latest->files.size(), 2u);
  EXPECT_EQ(latest->files[1].name, "rank1.pt");
  EXPECT_OK(VerifyCheckpoint(*latest));
}

TEST_F(CheckpointDirTest, FlippedByteIsCorruptionNamingTheFile) {
  const std::string dir = MakeStep(10, 2, true);
  {
    std::fstream f(RankFile(dir, 1), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(500);
    f.put('y');
  }
  ASSERT_OK_AND_ASSIGN(auto latest, FindLatestComplete(root_));
  EXPECT_THAT(VerifyCheckpoint(*latest),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr(RankFile(dir, 1) + " is corrupt: FNV-1a checksum")));
}

TEST_F(CheckpointDirTest, TruncatedAndMissingFilesAreNamed) {
  const std::string dir = MakeStep(10, 2, true);
  fs::resize_file(RankFile(dir, 0), 100);
  ASSERT_OK_AND_ASSIGN(auto latest, FindLatestComplete(root_));
  EXPECT_THAT(VerifyCheckpoint(*latest),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr(RankFile(dir, 0) + " is corrupt: 100 bytes")));
  fs::remove(RankFile(dir, 0));
  EXPECT_THAT(VerifyCheckpoint(*latest),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(RankFile(dir, 0) + " is missing")));
}

TEST_F(CheckpointDirTest, GarbledCompleteIsDataLossNamingIt) {
  const std::string dir = MakeStep(10, 1, true);
  std::ofstream(dir + "/COMPLETE") << "{\"step\": 10, \"world_";
  EXPECT_THAT(FindLatestComplete(root_).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr(dir + "/COMPLETE")));
}

// Nothing in COMPLETE is trusted: each corruption is DATA_LOSS naming the marker and the field.
TEST_F(CheckpointDirTest, CorruptMarkerFieldsAreNamed) {
  const std::string dir = StepDir(root_, 10);
  const std::string marker = dir + "/COMPLETE";
  struct Case {
    std::function<void(nlohmann::json&)> edit;
    std::string message;  // after "corrupt checkpoint marker <dir>/COMPLETE: "
  };
  const std::vector<Case> cases = {
      {[](nlohmann::json& j) { j["world_size"] = -2; },
       "world_size: must be in [1, 1048576], got -2"},
      {[](nlohmann::json& j) { j["world_size"] = "2"; },
       "world_size: expected an integer, got string \"2\""},
      {[](nlohmann::json& j) { j["step"] = 10.5; },
       "step: expected an integer, got number 10.5"},
      {[](nlohmann::json& j) { j["files"][1]["name"] = "rank0.pt"; },
       "files[1].name: \"rank0.pt\" is listed twice"},
      {[](nlohmann::json& j) { j["files"].erase(1); },
       "files: rank1.pt is not listed (format rank_files at world_size 2 has rank0.pt .. "
       "rank1.pt)"},
      {[](nlohmann::json& j) { j["files"][1].erase("name"); }, "files[1].name: missing"},
      {[](nlohmann::json& j) { j["files"][1]["name"] = "rank7.pt"; },
       "files[1].name: \"rank7.pt\" is not a file of this checkpoint (format rank_files at "
       "world_size 2 has rank0.pt .. rank1.pt)"},
      {[](nlohmann::json& j) { j["files"][1]["name"] = "../step_00000020/rank1.pt"; },
       "files[1].name: \"../step_00000020/rank1.pt\" leaves the step directory"},
      {[](nlohmann::json& j) { j["files"][0]["name"] = "/etc/passwd"; },
       "files[0].name: \"/etc/passwd\" is an absolute path (names are relative to the step "
       "directory)"},
      {[](nlohmann::json& j) { j["files"][0]["name"] = "./rank0.pt"; },
       "files[0].name: \"./rank0.pt\" is not a plain relative path (empty or '.' component)"},
      {[](nlohmann::json& j) { j["files"][0]["bytes"] = -1; },
       "files[0].bytes: expected an unsigned integer, got number -1"},
      {[](nlohmann::json& j) { j["files"][0]["fnv1a64"] = "xyz"; },
       "files[0].fnv1a64: expected up to 16 hex digits, got \"xyz\""},
      {[](nlohmann::json& j) { j["config"]["batch"] = "16"; },
       "config.batch: expected an integer, got string \"16\""},
      {[](nlohmann::json& j) { j["config"]["lr"] = nullptr; },
       "config.lr: expected a number, got null null"},
      {[](nlohmann::json& j) { j["config"] = nlohmann::json::array(); },
       "config: expected an object, got array []"},
      {[](nlohmann::json& j) { j["trainer_state"]["full_param_fnv1a64"] = 12; },
       "trainer_state.full_param_fnv1a64: expected a string, got number 12"},
      {[](nlohmann::json& j) { j["trainer_state"]["grad_scaler"] = {{"scale", "big"}}; },
       "trainer_state.grad_scaler.scale: expected a number, got string \"big\""},
      {[](nlohmann::json& j) { j["trainer_state"] = "x"; },
       "trainer_state: expected an object, got string \"x\""},
      {[](nlohmann::json& j) { j.erase("files"); }, "files: missing"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    fs::remove_all(dir);
    MakeStep(10, 2, true);
    ASSERT_OK_AND_ASSIGN(std::string text, ReadFile(marker));
    nlohmann::json j = nlohmann::json::parse(text);
    c.edit(j);
    ASSERT_OK(WriteFileAtomic(marker, j.dump()));
    const absl::Status st = FindLatestComplete(root_).status();
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kDataLoss,
                             HasSubstr("corrupt checkpoint marker " + marker + ": " + c.message)));
    // Older checkpoints are found through the same checks (WithOlderCheckpointHint).
    EXPECT_THAT(WithOlderCheckpointHint(st, root_).message(),
                HasSubstr("no older intact checkpoint is under " + root_));
  }
}

// A well-formed marker of the sharded format: the names and count come from the world size.
TEST_F(CheckpointDirTest, ShardedMarkerMustListEveryShardAndTheManifest) {
  const std::string dir = StepDir(root_, 8);
  fs::create_directories(dir);
  const std::vector<std::string> files = {ShardFileName(0), ShardFileName(1), kShardManifestName};
  for (const std::string& f : files) std::ofstream(dir + "/" + f) << f;
  ASSERT_OK(WriteComplete(dir, 8, 2, kFormatFsdpSharded, files, {{"width", 8}}, {}));
  ASSERT_OK_AND_ASSIGN(std::string text, ReadFile(dir + "/COMPLETE"));
  nlohmann::json j = nlohmann::json::parse(text);
  j["world_size"] = 3;
  ASSERT_OK(WriteFileAtomic(dir + "/COMPLETE", j.dump()));
  EXPECT_THAT(FindLatestComplete(root_).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr(dir + "/COMPLETE: files: rank00002.shard is not listed (format "
                                       "fsdp_sharded at world_size 3 has rank00000.shard .. "
                                       "manifest.json)")));
}

TEST_F(CheckpointDirTest, WriteCompleteNeedsEveryRankFile) {
  const std::string dir = MakeStep(10, 1, false);
  EXPECT_THAT(WriteComplete(dir, 10, 2, {}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("rank1.pt is missing")));
  EXPECT_FALSE(fs::exists(dir + "/COMPLETE"));
}

TEST_F(CheckpointDirTest, PruneKeepsTheNewestAndDropsInterruptedSaves) {
  MakeStep(10, 1, true);
  MakeStep(15, 1, false);  // interrupted, older than a complete one: garbage
  MakeStep(20, 1, true);
  MakeStep(30, 1, true);
  MakeStep(40, 1, false);  // may be a save in progress: kept
  ASSERT_OK(PruneCheckpoints(root_, 2));
  EXPECT_FALSE(fs::exists(StepDir(root_, 10)));
  EXPECT_FALSE(fs::exists(StepDir(root_, 15)));
  EXPECT_TRUE(fs::exists(StepDir(root_, 20) + "/COMPLETE"));
  EXPECT_TRUE(fs::exists(StepDir(root_, 30) + "/COMPLETE"));
  EXPECT_TRUE(fs::exists(StepDir(root_, 40)));
  EXPECT_THAT(PruneCheckpoints(root_, 0), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(CheckpointDirTest, RemoveCheckpointsAfter) {
  MakeStep(10, 1, true);
  MakeStep(20, 1, true);
  MakeStep(30, 1, false);
  ASSERT_OK(RemoveCheckpointsAfter(root_, 10));
  EXPECT_TRUE(fs::exists(StepDir(root_, 10)));
  EXPECT_FALSE(fs::exists(StepDir(root_, 20)));
  EXPECT_FALSE(fs::exists(StepDir(root_, 30)));
}

TEST_F(CheckpointDirTest, WriteFileAtomicReplacesWholeFiles) {
  const std::string path = root_ + "/f.txt";
  ASSERT_OK(WriteFileAtomic(path, "first"));
  ASSERT_OK(WriteFileAtomic(path, "2nd"));
  ASSERT_OK_AND_ASSIGN(std::string got, ReadFile(path));
  EXPECT_EQ(got, "2nd");
  int entries = 0;
  for (const auto& e : fs::directory_iterator(root_)) ++entries, (void)e;
  EXPECT_EQ(entries, 1);  // no temporary left behind
  EXPECT_THAT(WriteFileAtomic(root_ + "/no/such/dir/f", "x"),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("cannot create")));
}

}  // namespace
}  // namespace fairscale::examples::gpt
