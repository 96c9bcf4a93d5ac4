#include "base/torch_error.h"

#include <c10/util/Exception.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::base {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// The message without c10's backtrace, or "no exception".
std::string MessageOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "no exception";
}

TEST(TorchErrorTest, OkDoesNotThrow) {
  EXPECT_NO_THROW(ThrowIfError(absl::OkStatus(), "ctx"));
  EXPECT_EQ(ValueOrThrow(absl::StatusOr<int>(7), "ctx"), 7);
}

TEST(TorchErrorTest, ErrorIsContextCodeAndMessage) {
  EXPECT_EQ(MessageOf([] { ThrowIfError(absl::InvalidArgumentError("bad shape"), "op rank 1/2"); }),
            "op rank 1/2: INVALID_ARGUMENT: bad shape");
  EXPECT_EQ(MessageOf([] { ValueOrThrow(absl::StatusOr<int>(absl::DataLossError("torn")), "ld"); }),
            "ld: DATA_LOSS: torn");
  EXPECT_EQ(MessageOf([] { ThrowIfError(absl::UnavailableError("peer 3 died"), ""); }),
            "UNAVAILABLE: peer 3 died");
  // What the user-API tests match on: gmock's ThrowsMessage over what().
  EXPECT_THAT([] { ThrowIfError(absl::DeadlineExceededError("slow"), "wait"); },
              ThrowsMessage<c10::Error>(HasSubstr("wait: DEADLINE_EXCEEDED: slow")));
}

TEST(TorchErrorTest, ValueOrThrowMovesTheValue) {
  absl::StatusOr<std::unique_ptr<int>> p = std::make_unique<int>(5);
  std::unique_ptr<int> q = ValueOrThrow(std::move(p), "ctx");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(*q, 5);
}

}  // namespace
}  // namespace fairscale::base
