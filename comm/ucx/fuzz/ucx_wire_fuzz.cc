// Fuzz target for the decoders of what the ucx transport reads from its peers (comm/ucx/ucx_wire.h):
// the tag and length of a completed receive, control messages, the address record from the
// store and /proc/<pid>/stat lines. No UCX context is involved. Built two ways:
// //comm/ucx/fuzz:ucx_wire_fuzz_test (gcc; seeds plus deterministic mutations on every test run,
// //base:fuzz_replay_main) and run_libfuzzer.sh (clang, -fsanitize=fuzzer,address,undefined).
//
// Input: byte 0 picks the decoder (mod 4), the rest is its input:
//   0  CheckReceived / TruncatedError: peer (2 bytes), expected tag, sender tag (8 each),
//      expected bytes, reported length (4 each). OK exactly when the length and the low 48 tag
//      bits agree; otherwise kInvalidArgument naming the peer.
//   1  DecodeControlNotice: reported length (2 bytes; may exceed the buffer, as when UCX
//      truncates), then the bytes UCX wrote into the kControlBytes buffer. Only
//      min(length, buffer) bytes are read (the buffer is an exact-size heap block, so ASan sees
//      any read past it); a bye is exactly a leading 'B'; the reason is the rest. Also:
//      EncodeControlNotice of a status with this message fits the buffer and decodes back.
//   2  ParseAddressRecord: OK or kInvalidArgument; an accepted record has a positive pid and a
//      bounded, non-empty address, and formats to a canonical record that parses back to it.
//   3  ParseProcessStat: any bytes; a state is found only after a ')'.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/fuzz_check.h"
#include "comm/ucx/ucx_wire.h"

namespace {

namespace ux = fairscale::comm::ucx_internal;

template <typename T>
T Take(absl::string_view& in) {
  T v{};
  const size_t n = std::min(sizeof(T), in.size());
  std::memcpy(&v, in.data(), n);
  in.remove_prefix(n);
  return v;
}

void FuzzReceived(absl::string_view in) {
  const int peer = Take<uint16_t>(in) % ux::kMaxRanks;
  const uint64_t expected_tag = Take<uint64_t>(in);
  const uint64_t sender_tag = Take<uint64_t>(in);
  const size_t expected_bytes = Take<uint32_t>(in);
  const size_t length = Take<uint32_t>(in);
  const absl::Status s =
      ux::CheckReceived(peer, expected_tag, expected_bytes, length, sender_tag);
  const bool match =
      length == expected_bytes && ((expected_tag ^ sender_tag) & ux::kLowMask) == 0;
  FS_FUZZ_CHECK(s.ok() == match);
  const std::string who = absl::StrCat("message mismatch with peer ", peer, ": ");
  if (!s.ok()) {
    FS_FUZZ_CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    FS_FUZZ_CHECK(absl::StartsWith(s.message(), who));
  }
  const absl::Status t = ux::TruncatedError(peer, expected_tag, expected_bytes);
  FS_FUZZ_CHECK(t.code() == absl::StatusCode::kInvalidArgument);
  FS_FUZZ_CHECK(absl::StartsWith(t.message(), who));
  // The tags this rank builds keep the fields apart.
  FS_FUZZ_CHECK((ux::DataTag(peer, sender_tag) >> ux::kRankShift) == static_cast<uint64_t>(peer));
  FS_FUZZ_CHECK((ux::DataTag(peer, sender_tag) & ux::kControlBit) == 0);
  FS_FUZZ_CHECK((ux::HelloTag(peer) & ux::kRankMask) == ux::ControlTag(peer));
}

void FuzzControl(absl::string_view in) {
  const size_t length = Take<uint16_t>(in);
  // What UCX wrote: at most the buffer; an exact-size heap block so ASan catches over-reads.
  const size_t written = std::min(in.size(), ux::kControlBytes);
  std::unique_ptr<char[]> buffer(new char[ux::kControlBytes]);
  std::memset(buffer.get(), 0, ux::kControlBytes);
  std::memcpy(buffer.get(), in.data(), written);
  const absl::string_view view(buffer.get(), ux::kControlBytes);
  const ux::ControlNotice n = ux::DecodeControlNotice(view, length);
  const size_t used = std::min(length, ux::kControlBytes);
  FS_FUZZ_CHECK(n.bye == (used >= 1 && view[0] == ux::kBye));
  if (!n.bye) {
    FS_FUZZ_CHECK(n.reason == (used == 0 ? "(no reason given)" : view.substr(1, used - 1)));
    FS_FUZZ_CHECK(n.reason.size() < ux::kControlBytes);
  }
  // Encoding: a status carrying these bytes as its message.
  const auto code = static_cast<absl::StatusCode>(1 + length % 16);
  const absl::Status reason(code, in);
  const std::string notice = ux::EncodeControlNotice(reason);
  FS_FUZZ_CHECK(!notice.empty() && notice.size() <= ux::kControlBytes);
  const ux::ControlNotice back = ux::DecodeControlNotice(notice, notice.size());
  FS_FUZZ_CHECK(!back.bye);
  FS_FUZZ_CHECK(absl::StartsWith(back.reason, absl::StrCat(absl::StatusCodeToString(code), ": ")));
  FS_FUZZ_CHECK(absl::StartsWith(in, back.reason.substr(back.reason.find(": ") + 2)));
  FS_FUZZ_CHECK(ux::DecodeControlNotice(ux::EncodeControlNotice(absl::OkStatus()), 1).bye);
}

void FuzzAddressRecord(absl::string_view in) {
  const absl::StatusOr<ux::AddressRecord> r = ux::ParseAddressRecord(in);
  if (!r.ok()) {
    FS_FUZZ_CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
    FS_FUZZ_CHECK(!r.status().message().empty());
    return;
  }
  FS_FUZZ_CHECK(r->pid > 0);
  FS_FUZZ_CHECK(!r->worker_address.empty());
  FS_FUZZ_CHECK(r->worker_address.size() <= ux::kMaxWorkerAddressBytes);
  FS_FUZZ_CHECK(r->boot_id.find(' ') == std::string::npos);
  const std::string canonical = ux::FormatAddressRecord(*r);
  const absl::StatusOr<ux::AddressRecord> again = ux::ParseAddressRecord(canonical);
  FS_FUZZ_CHECK(again.ok());
  FS_FUZZ_CHECK(again->worker_address == r->worker_address && again->boot_id == r->boot_id &&
                again->pid == r->pid && again->start_time == r->start_time);
  FS_FUZZ_CHECK(ux::FormatAddressRecord(*again) == canonical);
}

void FuzzProcessStat(absl::string_view in) {
  const ux::ProcessInfo info = ux::ParseProcessStat(in);
  if (info.state != 0) FS_FUZZ_CHECK(in.find(')') != absl::string_view::npos);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const absl::string_view in(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 4) {
    case 0: FuzzReceived(in); break;
    case 1: FuzzControl(in); break;
    case 2: FuzzAddressRecord(in); break;
    case 3: FuzzProcessStat(in); break;
  }
  return 0;
}
