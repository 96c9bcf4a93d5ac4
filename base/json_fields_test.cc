// JsonFields: each accessor accepts exactly its type and range, and every refusal is kDataLoss
// "<prefix><field>: <what>" (values that nlohmann would convert with undefined behaviour, like
// 1e300 as an integer, are refused).
#include "base/json_fields.h"

#include <nlohmann/json.hpp>

#include "base/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::base {
namespace {

using ::fairscale::base::testing::IsOkAndHolds;
using ::fairscale::base::testing::StatusIs;
using ::testing::ElementsAre;

nlohmann::json J(const char* text) { return nlohmann::json::parse(text); }

TEST(JsonFieldsTest, IntAcceptsIntegersInRangeOnly) {
  const JsonFields f("file 'x': ");
  EXPECT_THAT(f.Int(J("7"), "a", 0, 10), IsOkAndHolds(7));
  EXPECT_THAT(f.Int(J("-3"), "a"), IsOkAndHolds(-3));
  EXPECT_THAT(f.Int(J("11"), "a", 0, 10),
              StatusIs(absl::StatusCode::kDataLoss, "file 'x': a: must be in [0, 10], got 11"));
  EXPECT_THAT(f.Int(J("1e300"), "a.b"),
              StatusIs(absl::StatusCode::kDataLoss,
                       "file 'x': a.b: expected an integer, got number 1e+300"));
  EXPECT_THAT(f.Int(J("1.0"), "a"), StatusIs(absl::StatusCode::kDataLoss,
                                             "file 'x': a: expected an integer, got number 1.0"));
  EXPECT_THAT(f.Int(J("18446744073709551615"), "a"),
              StatusIs(absl::StatusCode::kDataLoss, ::testing::HasSubstr("a: must be in")));
  EXPECT_THAT(f.Int(J("\"12\""), "a"),
              StatusIs(absl::StatusCode::kDataLoss,
                       "file 'x': a: expected an integer, got string \"12\""));
}

TEST(JsonFieldsTest, NeedNamesMissingFieldsAndNonObjects) {
  const JsonFields f("m: ");
  const nlohmann::json obj = J(R"({"k": 1})");
  ASSERT_OK_AND_ASSIGN(const nlohmann::json* v, f.Need(obj, "k", "k"));
  EXPECT_EQ(*v, 1);
  EXPECT_THAT(f.Need(J(R"({"k": 1})"), "q", "q"),
              StatusIs(absl::StatusCode::kDataLoss, "m: q: missing"));
  EXPECT_THAT(f.Need(J("[1]"), "q", "files[0]"),
              StatusIs(absl::StatusCode::kDataLoss,
                       "m: files[0]: expected an object holding it, got array [1]"));
}

TEST(JsonFieldsTest, HexStringsAndShapes) {
  const JsonFields f("m: ");
  EXPECT_THAT(f.Hex64(J(R"("00ff")"), "h"), IsOkAndHolds(255u));
  EXPECT_THAT(f.Hex64(J(R"("ffffffffffffffff")"), "h"), IsOkAndHolds(~uint64_t{0}));
  EXPECT_THAT(f.Hex64(J(R"("1ffffffffffffffff")"), "h"),
              StatusIs(absl::StatusCode::kDataLoss, ::testing::HasSubstr("up to 16 hex digits")));
  EXPECT_THAT(f.Hex64(J(R"("-1")"), "h"), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(f.Hex64(J("12"), "h"), StatusIs(absl::StatusCode::kDataLoss,
                                              "m: h: expected a string, got number 12"));
  int64_t numel = 0;
  EXPECT_THAT(f.Shape(J("[2, 3, 4]"), "s", &numel), IsOkAndHolds(ElementsAre(2, 3, 4)));
  EXPECT_EQ(numel, 24);
  EXPECT_THAT(f.Shape(J("[]"), "s", &numel), IsOkAndHolds(ElementsAre()));
  EXPECT_EQ(numel, 1);
  EXPECT_THAT(f.Shape(J("[2, -1]"), "s"),
              StatusIs(absl::StatusCode::kDataLoss,
                       "m: s[1]: must be in [0, 9223372036854775807], got -1"));
  EXPECT_THAT(f.Shape(J("[4294967296, 4294967296]"), "s"),
              StatusIs(absl::StatusCode::kDataLoss,
                       "m: s: has more elements than fit in int64"));
  EXPECT_THAT(f.Strings(J(R"(["a", 1])"), "n"),
              StatusIs(absl::StatusCode::kDataLoss, "m: n[1]: expected a string, got number 1"));
  EXPECT_THAT(f.Number(J("true"), "x"),
              StatusIs(absl::StatusCode::kDataLoss, "m: x: expected a number, got boolean true"));
}

}  // namespace
}  // namespace fairscale::base
