// GoogleTest matchers for absl::Status / absl::StatusOr (Abseil 20220623 has none).
//
//   EXPECT_THAT(s, IsOk());
//   EXPECT_THAT(s, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("peer 3")));
//   ASSERT_OK(s);  ASSERT_OK_AND_ASSIGN(auto v, MakeV());
#pragma once

#include <ostream>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::base::testing {
namespace internal {
inline const absl::Status& GetStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& s) {
  return s.status();
}
}  // namespace internal

MATCHER(IsOk, "is OK") {
  const absl::Status& s = internal::GetStatus(arg);
  if (!s.ok()) *result_listener << "status is " << s;
  return s.ok();
}

// A StatusOr<T> that is OK and whose value matches `value_matcher`.
MATCHER_P(IsOkAndHolds, value_matcher, "is OK and holds a matching value") {
  if (!arg.ok()) {
    *result_listener << "status is " << arg.status();
    return false;
  }
  return ::testing::ExplainMatchResult(value_matcher, *arg, result_listener);
}

MATCHER_P2(StatusIs, code, message_matcher,
           std::string("has code ") + absl::StatusCodeToString(code)) {
  const absl::Status& s = internal::GetStatus(arg);
  *result_listener << "status is " << s;
  if (s.code() != code) return false;
  return ::testing::ExplainMatchResult(message_matcher, std::string(s.message()),
                                       result_listener);
}
}  // namespace fairscale::base::testing

namespace fairscale::base::testing {
// StatusIs(code) with any message.
inline auto StatusIs(absl::StatusCode code) { return StatusIs(code, ::testing::_); }
}  // namespace fairscale::base::testing

#define FS_TESTING_CONCAT_INNER_(x, y) x##y
#define FS_TESTING_CONCAT_(x, y) FS_TESTING_CONCAT_INNER_(x, y)

#define ASSERT_OK(expr) ASSERT_THAT((expr), ::fairscale::base::testing::IsOk())
#define EXPECT_OK(expr) EXPECT_THAT((expr), ::fairscale::base::testing::IsOk())
#define ASSERT_OK_AND_ASSIGN(lhs, rexpr) \
  ASSERT_OK_AND_ASSIGN_IMPL_(FS_TESTING_CONCAT_(fs_sor_, __LINE__), lhs, rexpr)
#define ASSERT_OK_AND_ASSIGN_IMPL_(sor, lhs, rexpr)            \
  auto sor = (rexpr);                                          \
  ASSERT_THAT(sor.status(), ::fairscale::base::testing::IsOk()); \
  lhs = std::move(sor).value()
