#include "base/torch_error.h"

#include <c10/util/Exception.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace fairscale::base::internal {

void ThrowStatus(const absl::Status& status, absl::string_view context) {
  std::string message = context.empty() ? status.ToString()
                                        : absl::StrCat(context, ": ", status.ToString());
  // C10_THROW_ERROR, not TORCH_CHECK: a build with STRIP_ERROR_MESSAGES would drop TORCH_CHECK's
  // message, and the message is all the caller gets.
  C10_THROW_ERROR(Error, std::move(message));
}

}  // namespace fairscale::base::internal
