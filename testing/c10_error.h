// The c10::Error a call raises, for tests of the user-facing APIs (fsdp, oss, amp, ...), whose
// errors are c10::Errors carrying the message (testonly).
//
//   EXPECT_THAT(ErrorOf([&] { scaler.step(opt); }), HasSubstr("rank 1/2"));
//   FS_RETURN_IF_ERROR(ExpectError([&] { load(dir); }, {"shard 3", "missing"}));  // rank bodies
//   return CatchErrors([&] { pipe->train_step(x, y, loss); return absl::OkStatus(); });
#pragma once

#include <c10/util/Exception.h>

#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace fairscale::testing {

// The message (without backtrace) of the c10::Error `f` raises, or "" if it raises none. Other
// exceptions propagate.
inline std::string ErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

// OK if `f` raises a c10::Error whose message contains every one of `needles`; kInternal saying
// which is missing (or that nothing was raised) otherwise.
inline absl::Status ExpectError(const std::function<void()>& f,
                                const std::vector<std::string>& needles) {
  bool raised = false;
  std::string message;
  try {
    f();
  } catch (const c10::Error& e) {
    raised = true;
    message = e.what_without_backtrace();
  }
  if (!raised) return absl::InternalError("no error");
  for (const std::string& n : needles) {
    if (message.find(n) == std::string::npos) {
      return absl::InternalError(absl::StrCat("error lacks '", n, "': ", message));
    }
  }
  return absl::OkStatus();
}

// body()'s status, or kInternal carrying the message of the exception it raises (a c10::Error's
// without the backtrace: "<function>: <CODE>: <message>" for our user APIs), so that a rank body
// can report a user API's errors through its Status.
inline absl::Status CatchErrors(const std::function<absl::Status()>& body) {
  try {
    return body();
  } catch (const c10::Error& e) {
    return absl::InternalError(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return absl::InternalError(e.what());
  }
}

}  // namespace fairscale::testing
