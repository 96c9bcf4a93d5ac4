#include "comm/ucx/ucx_wire.h"

#include <algorithm>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "comm/algorithms/transport.h"

namespace fairscale::comm::ucx_internal {

absl::Status CheckReceived(int peer, uint64_t expected_tag, size_t expected_bytes, size_t length,
                           uint64_t sender_tag) {
  if (length == expected_bytes && (sender_tag & kLowMask) == (expected_tag & kLowMask)) {
    return absl::OkStatus();
  }
  // The sender's op as far as its 48 bits tell (the sequence number's high bits are ours).
  const uint64_t theirs = (expected_tag & ~kLowMask) | (sender_tag & kLowMask);
  return absl::InvalidArgumentError(absl::StrCat(
      "message mismatch with peer ", peer, ": it sent ", DescribeTag(theirs), " (", length,
      " bytes), this rank expected ", DescribeTag(expected_tag), " (", expected_bytes, " bytes)"));
}

absl::Status TruncatedError(int peer, uint64_t expected_tag, size_t expected_bytes) {
  return absl::InvalidArgumentError(
      absl::StrCat("message mismatch with peer ", peer, ": it sent more than the ",
                   expected_bytes, " bytes this rank expected for ", DescribeTag(expected_tag)));
}

std::string EncodeControlNotice(const absl::Status& reason) {
  std::string notice(1, reason.ok() ? kBye : kFailed);
  if (!reason.ok()) {
    absl::StrAppend(&notice, absl::StatusCodeToString(reason.code()), ": ",
                    reason.message().substr(0, kControlBytes - 64));
  }
  return notice;
}

ControlNotice DecodeControlNotice(absl::string_view buffer, size_t length) {
  const absl::string_view message = buffer.substr(0, std::min(length, buffer.size()));
  ControlNotice notice;
  if (!message.empty() && message[0] == kBye) {
    notice.bye = true;
  } else if (message.empty()) {
    notice.reason = "(no reason given)";
  } else {
    notice.reason = std::string(message.substr(1));
  }
  return notice;
}

std::string FormatAddressRecord(const AddressRecord& record) {
  return absl::StrCat(absl::BytesToHexString(record.worker_address), " ",
                      record.boot_id.empty() ? "-" : record.boot_id, " ", record.pid, " ",
                      record.start_time);
}

absl::StatusOr<AddressRecord> ParseAddressRecord(absl::string_view text) {
  const std::vector<absl::string_view> parts = absl::StrSplit(text, ' ');
  if (parts.size() != 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected 4 space-separated fields, found ", parts.size()));
  }
  const absl::string_view hex = parts[0];
  if (hex.empty() || hex.size() % 2 != 0 || hex.size() > 2 * kMaxWorkerAddressBytes ||
      !std::all_of(hex.begin(), hex.end(), [](char c) { return absl::ascii_isxdigit(c); })) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the worker address is not an even number of hex digits (", hex.size(),
        " characters; at most ", 2 * kMaxWorkerAddressBytes, ")"));
  }
  AddressRecord record;
  record.worker_address = absl::HexStringToBytes(hex);
  if (parts[1].empty()) return absl::InvalidArgumentError("the boot id is empty");
  record.boot_id = parts[1] == "-" ? "" : std::string(parts[1]);
  if (!absl::SimpleAtoi(parts[2], &record.pid) || record.pid <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the pid '", absl::CEscape(parts[2]), "' is not a positive number"));
  }
  if (!absl::SimpleAtoi(parts[3], &record.start_time)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the start time '", absl::CEscape(parts[3]), "' is not a number"));
  }
  return record;
}

ProcessInfo ParseProcessStat(absl::string_view stat) {
  ProcessInfo info;
  const size_t paren = stat.rfind(')');  // the command name may contain spaces and parens
  if (paren == absl::string_view::npos) return info;
  const std::vector<absl::string_view> fields =
      absl::StrSplit(stat.substr(paren + 1), ' ', absl::SkipEmpty());
  // After the name: state is field 3 of stat(5), starttime field 22.
  if (fields.size() < 20 || fields[0].empty()) return info;
  if (!absl::SimpleAtoi(fields[19], &info.start_time)) return info;
  info.state = fields[0][0];
  return info;
}

}  // namespace fairscale::comm::ucx_internal
