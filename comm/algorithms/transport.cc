#include "comm/algorithms/transport.h"

#include "absl/strings/str_cat.h"

namespace fairscale::comm {

std::string DescribeTag(uint64_t tag) {
  const auto type = static_cast<OpType>(tag & 0xff);
  const uint64_t seq = tag >> 32;
  std::string out = type == OpType::kSend ? absl::StrCat("send/recv #", seq)
                                          : absl::StrCat(OpTypeName(type), " #", seq);
  const uint32_t sig = static_cast<uint32_t>(tag >> 8) & 0xffffff;
  if (sig != 0) absl::StrAppend(&out, " (", DescribeSignature(sig), ")");
  return out;
}

}  // namespace fairscale::comm
