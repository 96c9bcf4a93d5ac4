// The sharded checkpoint's rank file (shard_file.h): a written file reads back record by record;
// a file whose leading magic, footer or size is wrong is DATA_LOSS naming the file and what.
#include "fsdp/internal/shard_file.h"

#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
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
    ASSERT_OK_AND_ASSIGN(std::string file, ReadWholeFile(path_));
    file.replace(static_cast<size_t>(offset), bytes.size(), bytes);
    ASSERT_OK(WriteFileAtomically(path_, file));
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

}  // namespace
}  // namespace fairscale::fsdp::internal
