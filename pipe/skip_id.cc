#include "pipe/skip_id.h"

#include <c10/util/Exception.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace fairscale::pipe {

Namespace::Namespace(std::string name) : name_(std::move(name)) {
  TORCH_CHECK(!name_.empty(), "pipe::Namespace: the name must not be empty");
}

std::string DescribeSkip(const SkipId& id) {
  if (id.ns.is_default()) return absl::StrCat("'", id.name, "'");
  return absl::StrCat("'", id.name, "' (namespace '", id.ns.name(), "')");
}

}  // namespace fairscale::pipe
