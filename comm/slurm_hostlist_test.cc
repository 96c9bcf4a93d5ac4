#include "comm/slurm_hostlist.h"

#include <string>
#include <vector>

#include "base/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::comm {
namespace {

using ::fairscale::base::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(SlurmHostList, Expands) {
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> a, ExpandSlurmHostList("node[01-04,07]"));
  EXPECT_THAT(a, ElementsAre("node01", "node02", "node03", "node04", "node07"));
  ASSERT_OK_AND_ASSIGN(a, ExpandSlurmHostList("a[1-2],b3"));
  EXPECT_THAT(a, ElementsAre("a1", "a2", "b3"));
  ASSERT_OK_AND_ASSIGN(a, ExpandSlurmHostList("gpu-[9-11]x"));
  EXPECT_THAT(a, ElementsAre("gpu-9x", "gpu-10x", "gpu-11x"));
  ASSERT_OK_AND_ASSIGN(a, ExpandSlurmHostList("n[098-101]"));
  EXPECT_THAT(a, ElementsAre("n098", "n099", "n100", "n101"));
  ASSERT_OK_AND_ASSIGN(a, ExpandSlurmHostList("r[1-2]-n[1,3]"));
  EXPECT_THAT(a, ElementsAre("r1-n1", "r1-n3", "r2-n1", "r2-n3"));
  ASSERT_OK_AND_ASSIGN(a, ExpandSlurmHostList("localhost"));
  EXPECT_THAT(a, ElementsAre("localhost"));
  ASSERT_OK_AND_ASSIGN(a, ExpandSlurmHostList("h.example.org,x_1,[5]"));
  EXPECT_THAT(a, ElementsAre("h.example.org", "x_1", "5"));
}

// The first host, or the error's message.
std::string First(absl::string_view list) {
  absl::StatusOr<std::string> first = FirstSlurmHost(list);
  return first.ok() ? *first : first.status().ToString();
}

TEST(SlurmHostList, First) {
  EXPECT_EQ(First("node[01-04,07]"), "node01");
  EXPECT_EQ(First("a[1-2],b3"), "a1");
  EXPECT_EQ(First("gpu-[9-11]x"), "gpu-9x");
  EXPECT_EQ(First("c[0007-9],d"), "c0007");
  // The first host without expanding a huge list.
  EXPECT_EQ(First("n[0-999999999999]"), "n0");
}

TEST(SlurmHostList, BadLists) {
  for (const char* bad : {"", ",", "a,,b", "a,", "node[", "node[1-", "node[1-2", "node]",
                          "node[]", "node[a]", "node[3-1]", "node[1-2]]", "node[[1]]",
                          "no de", "node[1,]", "node[,1]", "node[1--2]", "n[1-2:2]",
                          "n[1234567890123456789]", "host\n"}) {
    EXPECT_THAT(ExpandSlurmHostList(bad).status(), StatusIs(absl::StatusCode::kInvalidArgument))
        << "'" << bad << "'";
    EXPECT_THAT(FirstSlurmHost(bad).status(), StatusIs(absl::StatusCode::kInvalidArgument))
        << "'" << bad << "'";
  }
  EXPECT_THAT(FirstSlurmHost("node[3-1]").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("a range whose end is below its start at offset 7 of host list "
                                 "'node[3-1]'")));
  EXPECT_THAT(FirstSlurmHost("node[1-2").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unclosed '['")));
}

TEST(SlurmHostList, Bounded) {
  EXPECT_THAT(ExpandSlurmHostList("n[1-100]", 99).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("more than 99 hosts")));
  EXPECT_THAT(ExpandSlurmHostList("n[0-999999999999999999][0-999999999999999999]").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("more than 65536 hosts")));
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> a, ExpandSlurmHostList("n[1-100]", 100));
  EXPECT_EQ(a.size(), 100u);
  EXPECT_THAT(FirstSlurmHost(std::string(kMaxHostListBytes + 1, 'a')).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bytes, more than")));
}

}  // namespace
}  // namespace fairscale::comm
