// The sharded checkpoint's rank file (shard_file.h): a written file reads back record by record;
// a file whose leading magic, footer or size is wrong is DATA_LOSS naming the file and what.
#include "fsdp/internal/shard_file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/atomic_file.h"
#include "base/fnv1a.h"
#include "base/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/tmp.h"

namespace fairscale::fsdp::internal {
namespace {

using ::fairscale::base::testing::StatusIs;
using ::testing::HasSubstr;

class ShardFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = fairscale::testing::TmpPath(
        absl::StrCat("shard_file_", getpid(), "_",
                     ::testing::UnitTest::GetInstance()->current_test_info()->name(), ".shard"));
    ASSERT_OK_AND_ASSIGN(auto w, ShardFileWriter::Open(path_, 1, 2));
    const std::vector<float> data = {1.5f, -2.f, 3.25f};
    ASSERT_OK(w->Add("p/w", "Float", {3}, 0, 3, data.data(), sizeof(float) * data.size()));
    ASSERT_OK_AND_ASSIGN(summary_, w->Finish());
  }
  void Patch(int64_t offset, const std::string& bytes) {
    ASSERT_OK_AND_ASSIGN(std::string file, base::ReadFile(path_));
    file.replace(static_cast<size_t>(offset), bytes.size(), bytes);
    ASSERT_OK(base::WriteFileAtomic(path_, file));
  }
  std::string path_;
  ShardFileWriter::Summary summary_;
};

TEST_F(ShardFileTest, ReadsBack) {
  ASSERT_OK_AND_ASSIGN(auto r, ShardFileReader::Open(path_, summary_.bytes, summary_.header_fnv1a));
  EXPECT_EQ(r->info().rank, 1);
  EXPECT_EQ(r->info().world_size, 2);
  ASSERT_EQ(r->info().records.size(), 1u);
  ASSERT_OK_AND_ASSIGN(std::string got, r->Read(0));
  EXPECT_EQ(got.size(), 12u);
}

TEST_F(ShardFileTest, WrongLeadingMagicNamesTheFile) {
  Patch(0, "NOTSHARD");
  EXPECT_THAT(ShardFileReader::Open(path_, summary_.bytes, summary_.header_fnv1a).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("checkpoint file '" + path_ +
                                 "': its first 8 bytes are not the magic \"FSDPSHD1\" (not a "
                                 "shard file, or overwritten)")));
}

TEST_F(ShardFileTest, WrongTrailingMagicAndSizeNameTheFile) {
  Patch(summary_.bytes - 8, "XXXXXXXX");
  EXPECT_THAT(ShardFileReader::Open(path_, summary_.bytes, summary_.header_fnv1a).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("checkpoint file '" + path_ + "' has no valid footer")));
  EXPECT_THAT(ShardFileReader::Open(path_, summary_.bytes + 1, summary_.header_fnv1a).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("the manifest says " + std::to_string(summary_.bytes + 1))));
}

// ---- a checkpoint directory: the manifest against the rank files -------------------------

struct Rec {
  std::string key, dtype;
  std::vector<int64_t> shape;
  int64_t begin, end;
};

class CheckpointDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fairscale::testing::TmpPath(absl::StrCat(
        "ckdir_", getpid(), "_", ::testing::UnitTest::GetInstance()->current_test_info()->name()));
    ASSERT_EQ(::mkdir(dir_.c_str(), 0755), 0);
    m_.world_size = 2;
    m_.units = {""};
    m_.params = {{"w", {2, 3}, "Float", ""}, {"w2", {2, 3}, "Float", "w"}};
    m_.buffers = {{"buf", {2}, "Double", ""}};
    m_.has_optimizer = true;
    m_.optimizer_kind = "adam";
    m_.optimizer_state["w"] = {3, {"exp_avg"}};
    ranks_ = {{{"p/w", "Float", {2, 3}, 0, 4}, {"o/w/exp_avg", "Float", {2, 3}, 0, 4},
               {"b/buf", "Double", {2}, 0, 2}},
              {{"p/w", "Float", {2, 3}, 4, 6}, {"o/w/exp_avg", "Float", {2, 3}, 4, 6}}};
  }
  // Writes ranks_ as real rank files and m_ (with their true sizes and checksums) as manifest.
  void Write() {
    m_.files.clear();
    for (size_t r = 0; r < ranks_.size(); ++r) {
      const std::string path = dir_ + "/" + RankFileName(static_cast<int>(r));
      ASSERT_OK_AND_ASSIGN(auto w, ShardFileWriter::Open(path, static_cast<int>(r),
                                                         static_cast<int>(ranks_.size())));
      for (const Rec& rec : ranks_[r]) {
        const std::string data(static_cast<size_t>((rec.end - rec.begin) * DtypeSize(rec.dtype)),
                               static_cast<char>(r + 1));
        ASSERT_OK(w->Add(rec.key, rec.dtype, rec.shape, rec.begin, rec.end, data.data(),
                         static_cast<int64_t>(data.size())));
      }
      ASSERT_OK_AND_ASSIGN(auto summary, w->Finish());
      m_.files.push_back({RankFileName(static_cast<int>(r)), summary.bytes, summary.fnv1a,
                          summary.header_fnv1a});
    }
    ASSERT_OK(base::WriteFileAtomic(dir_ + "/manifest.json", ManifestToJson(m_)));
  }
  // Rewrites the manifest's text with `edit` applied.
  void EditManifest(const std::string& from, const std::string& to) {
    ASSERT_OK_AND_ASSIGN(std::string json, base::ReadFile(dir_ + "/manifest.json"));
    const size_t at = json.find(from);
    ASSERT_NE(at, std::string::npos) << from << " not in " << json;
    json.replace(at, from.size(), to);
    ASSERT_OK(base::WriteFileAtomic(dir_ + "/manifest.json", json));
  }
  std::string dir_;
  Manifest m_;
  std::vector<std::vector<Rec>> ranks_;
};

TEST_F(CheckpointDirTest, OpensAndIndexesEachTensorsRecordsInOrder) {
  Write();
  ASSERT_OK_AND_ASSIGN(CheckpointFiles c, OpenCheckpointFiles(dir_, /*verify_whole_files=*/true));
  ASSERT_EQ(c.files.size(), 2u);
  using P = std::pair<size_t, size_t>;
  EXPECT_EQ(c.index["p/w"], (std::vector<P>{{0, 0}, {1, 0}}));
  EXPECT_EQ(c.index["o/w/exp_avg"], (std::vector<P>{{0, 1}, {1, 1}}));
  EXPECT_EQ(c.index["b/buf"], (std::vector<P>{{0, 2}}));
}

TEST_F(CheckpointDirTest, ARangeHeldTwiceIsDataLossNamingBothFiles) {
  // Rank 1 holds [0, 2) again and not [4, 6): the count of elements still adds up to 6.
  ranks_[1][0] = {"p/w", "Float", {2, 3}, 0, 2};
  Write();
  EXPECT_THAT(OpenCheckpointFiles(dir_, false).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       "checkpoint file '" + dir_ + "/rank00001.shard': tensor 'p/w' elements "
                       "[0, 2) are also in '" + dir_ + "/rank00000.shard'"));
}

TEST_F(CheckpointDirTest, MissingElementsAreDataLossNamingTheRange) {
  ranks_[1].erase(ranks_[1].begin());  // p/w [4, 6) nowhere
  Write();
  EXPECT_THAT(OpenCheckpointFiles(dir_, false).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       "tensor 'p/w' elements [4, 6) are in no checkpoint file (manifest '" +
                           dir_ + "/manifest.json')"));
}

TEST_F(CheckpointDirTest, RecordsMustBeOfListedTensorsWithTheirShapeAndBytes) {
  ranks_[1].push_back({"p/ghost", "Float", {1}, 0, 1});
  Write();
  EXPECT_THAT(OpenCheckpointFiles(dir_, false).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("rank00001.shard': record 'p/ghost' is of a tensor the "
                                 "manifest does not list")));
  ranks_[1].pop_back();
  ranks_[1][0].shape = {6};
  Write();
  EXPECT_THAT(OpenCheckpointFiles(dir_, false).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("record 'p/w' has shape [6] and dtype 'Float', the manifest "
                                 "says [2, 3] and 'Float'")));
}

TEST_F(CheckpointDirTest, ManifestFieldsAreCheckedAndNamed) {
  Write();
  const std::string m = "manifest '" + dir_ + "/manifest.json': ";
  EditManifest("\"name\": \"rank00001.shard\"", "\"name\": \"../rank00001.shard\"");
  EXPECT_THAT(OpenCheckpointFiles(dir_, false).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       m + "files[1].name: is '../rank00001.shard', rank 1's file is "
                           "'rank00001.shard'"));
  Write();
  EditManifest("\"world_size\": 2", "\"world_size\": -2");
  EXPECT_THAT(OpenCheckpointFiles(dir_, false).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       m + "world_size: must be in [1, 1048576], got -2"));
  Write();
  EditManifest("\"world_size\": 2", "\"world_size\": \"2\"");
  EXPECT_THAT(OpenCheckpointFiles(dir_, false).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       m + "world_size: expected an integer, got string \"2\""));
  Write();
  EditManifest("\"name\": \"w2\"", "\"name\": \"w\"");
  EXPECT_THAT(OpenCheckpointFiles(dir_, false).status(),
              StatusIs(absl::StatusCode::kDataLoss, m + "params[1].name: 'w' appears twice"));
  Write();
  EditManifest("\"alias_of\": \"w\"", "\"alias_of\": \"w2\"");
  EXPECT_THAT(OpenCheckpointFiles(dir_, false).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       m + "params[1].alias_of: 'w2' is not an earlier untied parameter"));
}

TEST_F(ShardFileTest, RecordFieldsOutsideTheFileAreDataLossNamingTheField) {
  // A header whose record claims more bytes than the file has, with offset + nbytes past int64.
  ASSERT_OK_AND_ASSIGN(auto w, ShardFileWriter::Open(path_, 0, 1));
  const std::vector<float> data = {1.f};
  ASSERT_OK(w->Add("p/w", "Float", {1}, 0, 1, data.data(), 4));
  ASSERT_OK_AND_ASSIGN(summary_, w->Finish());
  ASSERT_OK_AND_ASSIGN(std::string file, base::ReadFile(path_));
  const std::string from = "\"nbytes\":4";
  const size_t at = file.find(from);
  ASSERT_NE(at, std::string::npos);
  // Same length, so only the header's checksum changes: recompute it into the footer.
  file.replace(at, from.size(), "\"nbytes\":9");
  ASSERT_OK(base::WriteFileAtomic(path_, file));
  uint64_t len = 0;
  std::memcpy(&len, file.data() + file.size() - 24, 8);
  const uint64_t fnv = base::Fnv1a64(file.data() + file.size() - 24 - len, len);
  Patch(static_cast<int64_t>(file.size()) - 16, std::string(reinterpret_cast<const char*>(&fnv), 8));
  EXPECT_THAT(ShardFileReader::Open(path_, summary_.bytes, fnv).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       "checkpoint file '" + path_ + "': header field records[0].nbytes: must "
                       "be in [0, 4], got 9"));
}

}  // namespace
}  // namespace fairscale::fsdp::internal
