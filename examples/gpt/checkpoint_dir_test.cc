#include "examples/gpt/checkpoint_dir.h"

#include <unistd.h>

#include <filesystem>
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
