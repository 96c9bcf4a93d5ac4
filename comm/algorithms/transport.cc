#include "comm/algorithms/transport.h"

#include "absl/strings/str_cat.h"

namespace fairscale::comm {

std::string DescribeTag(uint64_t tag) {
  const auto type = static_cast<OpType>(tag & 0xff);
  const uint64_t seq = tag >> 8;
  if (type == OpType::kSend) return absl::StrCat("send/recv #", seq);
  return absl::StrCat(OpTypeName(type), " #", seq);
}

}  // namespace fairscale::comm
