// Step directories: the marker reads back what was written and trusts nothing else (each bad
// field is kDataLoss naming the file and the field); retention keeps what it promises.
#include "train_state/step_dir.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "base/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/tmp.h"

namespace fairscale::train_state {
namespace {

using ::fairscale::base::testing::IsOkAndHolds;
using ::fairscale::base::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

Marker Example() {
  Marker m;
  m.step = 40;
  m.world_size = 2;
  m.items["model"] = {"fsdp_sharded",
                      {{"rank00000.shard", 10, 0xabc}, {"manifest.json", 3, 0xffffffffffffffffu}}};
  m.items["data"] = {"json", {{"state.json", 7, 1}}};
  m.metadata = {{"loss", 2.5}};
  return m;
}

TEST(MarkerTest, RoundTrips) {
  const Marker m = Example();
  ASSERT_OK_AND_ASSIGN(Marker back, MarkerFromJson(MarkerToJson(m), "x/COMPLETE"));
  EXPECT_EQ(back.step, 40);
  EXPECT_EQ(back.world_size, 2);
  ASSERT_EQ(back.items.size(), 2u);
  EXPECT_EQ(back.items["model"].kind, "fsdp_sharded");
  EXPECT_EQ(back.items["model"].files, m.items.at("model").files);
  EXPECT_EQ(back.metadata["loss"], 2.5);
}

TEST(MarkerTest, EveryBadFieldIsNamed) {
  const std::string good = MarkerToJson(Example());
  const std::string prefix = "corrupt checkpoint marker x/COMPLETE: ";
  auto with = [&](const std::string& from, const std::string& to) {
    std::string s = good;
    const size_t at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    s.replace(at, from.size(), to);
    return MarkerFromJson(s, "x/COMPLETE").status();
  };
  EXPECT_THAT(with("\"world_size\": 2", "\"world_size\": -1"),
              StatusIs(absl::StatusCode::kDataLoss,
                       prefix + "world_size: must be in [1, 1048576], got -1"));
  EXPECT_THAT(with("\"step\": 40", "\"step\": \"40\""),
              StatusIs(absl::StatusCode::kDataLoss,
                       prefix + "step: expected an integer, got string \"40\""));
  EXPECT_THAT(with("\"state.json\"", "\"../state.json\""),
              StatusIs(absl::StatusCode::kDataLoss,
                       prefix + "items.data.files[0].name: \"../state.json\" is not a plain "
                                "path inside the item's directory"));
  EXPECT_THAT(with("\"manifest.json\"", "\"rank00000.shard\""),
              StatusIs(absl::StatusCode::kDataLoss,
                       prefix + "items.model.files[1].name: \"rank00000.shard\" is listed twice"));
  EXPECT_THAT(with("\"fairscale.train_state.v1\"", "\"fairscale.train_state.v9\""),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("format: is \"fairscale.train_state.v9\"")));
  EXPECT_THAT(with("\"bytes\": 7", "\"bytes\": -7"),
              StatusIs(absl::StatusCode::kDataLoss,
                       prefix + "items.data.files[0].bytes: expected an unsigned integer, got "
                                "number -7"));
  EXPECT_THAT(MarkerFromJson(good.substr(0, good.size() / 2), "x/COMPLETE").status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("not valid JSON")));
}

TEST(StepDirTest, ListsNewestFirstAndVerifiesFiles) {
  const std::string root = fairscale::testing::TmpPath(absl::StrCat("steps_", getpid()));
  for (int64_t s : {5, 40, 12}) {
    ASSERT_EQ(::mkdir(root.c_str(), 0755) == 0 || errno == EEXIST, true);
    ASSERT_EQ(::mkdir(StepDir(root, s).c_str(), 0755), 0);
  }
  ::mkdir((root + "/step_x").c_str(), 0755);  // not a step directory
  const std::string dir = StepDir(root, 12);
  ASSERT_EQ(::mkdir((dir + "/data").c_str(), 0755), 0);
  ASSERT_OK(WriteFileAtomic(dir + "/data/state.json", "{\"a\":1}"));
  Marker m;
  m.step = 12;
  m.world_size = 1;
  ASSERT_OK_AND_ASSIGN(FileDigest d, DigestFile(dir + "/data", "state.json"));
  m.items["data"] = {"json", {d}};
  ASSERT_OK(WriteMarker(dir, m));
  std::vector<StepEntry> steps = ListSteps(root);
  ASSERT_EQ(steps.size(), 3u);
  EXPECT_EQ(steps[0].step, 40);
  EXPECT_FALSE(steps[0].complete);
  EXPECT_EQ(steps[1].step, 12);
  EXPECT_TRUE(steps[1].complete);
  ASSERT_OK_AND_ASSIGN(Marker back, ReadMarker(dir, 12));
  EXPECT_OK(VerifyFiles(dir, back));
  EXPECT_THAT(ReadMarker(dir, 13).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("step: is 12, the directory's is 13")));
  ASSERT_OK(WriteFileAtomic(dir + "/data/state.json", "{\"a\":2}"));
  EXPECT_THAT(VerifyFiles(dir, back),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("checkpoint file " + dir + "/data/state.json is corrupt: FNV-1a")));
  ASSERT_OK(WriteFileAtomic(dir + "/data/state.json", "{}"));
  EXPECT_THAT(VerifyFiles(dir, back),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("2 bytes, COMPLETE says 7")));
  std::remove((dir + "/data/state.json").c_str());
  EXPECT_THAT(VerifyFiles(dir, back), StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing")));
}

std::vector<int64_t> Deleted(const std::vector<StepEntry>& steps, int keep_last,
                             int64_t keep_every) {
  std::vector<int64_t> out;
  for (const StepEntry& e : StepsToDelete(steps, keep_last, keep_every)) out.push_back(e.step);
  return out;
}

TEST(RetentionTest, KeepsLastKEveryNthAndNewerIncompleteOnes) {
  // Newest first: 70 (incomplete: a save in flight), 60, 50 (incomplete: interrupted), 40, 30,
  // 20, 10.
  const std::vector<StepEntry> steps = {{70, "", false}, {60, "", true}, {50, "", false},
                                        {40, "", true},  {30, "", true}, {20, "", true},
                                        {10, "", true}};
  EXPECT_THAT(Deleted(steps, 2, 0), ElementsAre(50, 30, 20, 10));
  EXPECT_THAT(Deleted(steps, 2, 20), ElementsAre(50, 30, 10));
  EXPECT_THAT(Deleted(steps, 1, 0), ElementsAre(50, 40, 30, 20, 10));
  EXPECT_THAT(Deleted(steps, 10, 0), ElementsAre(50));
  // Nothing complete: nothing is deleted (the incomplete ones may be saves in flight).
  EXPECT_THAT(Deleted({{20, "", false}, {10, "", false}}, 1, 0), ElementsAre());
}

TEST(NamesTest, RelativePathsOfPlainNames) {
  EXPECT_OK(CheckRelativePath("stage1/rank00000.shard", "file"));
  EXPECT_OK(CheckRelativePath("a/b/c/d", "file"));
  for (const char* bad : {"", "/x", "x/", "a//b", "a/../b", "./a", "a/b/c/d/e"}) {
    EXPECT_THAT(CheckRelativePath(bad, "file"), StatusIs(absl::StatusCode::kInvalidArgument))
        << bad;
  }
}

TEST(NamesTest, PlainNamesOnly) {
  EXPECT_OK(CheckPlainName("model.v2_x-1", "item"));
  for (const char* bad : {"", ".", "..", "a/b", "a b", "\xff"}) {
    EXPECT_THAT(CheckPlainName(bad, "item"), StatusIs(absl::StatusCode::kInvalidArgument))
        << bad;
  }
  EXPECT_EQ(StepDirName(40), "step_00000040");
}

}  // namespace
}  // namespace fairscale::train_state
