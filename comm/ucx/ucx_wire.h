// What the ucx transport reads from its peers, and the pure functions that decode it (internal
// to //comm/ucx; target :ucx_wire, which has no UCX dependency, so //comm/ucx/fuzz fuzzes the
// decoders without a UCX context):
// * the ucp tag layout of data, control and handshake messages;
// * a completed data receive: the sender's tag and the length UCX reports, checked against the
//   posted receive (CheckReceived);
// * control messages, Shutdown's notices to every peer: "B" (bye) or "F<code>: <reason>"
//   (EncodeControlNotice / DecodeControlNotice);
// * the address record each rank publishes in the store,
//   "<worker address hex> <boot id> <pid> <start time>" (FormatAddressRecord /
//   ParseAddressRecord);
// * /proc/<pid>/stat of a watched peer process, whose command name the peer chooses
//   (ParseProcessStat).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fairscale::comm::ucx_internal {

// ucp tags: (sender rank << 48) | (op tag & 0xffff'ffff'ffff) for data; bit 63 set for control
// messages.
inline constexpr int kRankShift = 48;
inline constexpr uint64_t kLowMask = (uint64_t{1} << kRankShift) - 1;
inline constexpr uint64_t kControlBit = uint64_t{1} << 63;
inline constexpr uint64_t kRankMask = ~kLowMask;  // control bit + sender rank
inline constexpr int kMaxRanks = 1 << 15;

inline uint64_t DataTag(int sender, uint64_t tag) {
  return (static_cast<uint64_t>(sender) << kRankShift) | (tag & kLowMask);
}
inline uint64_t ControlTag(int sender) {
  return kControlBit | (static_cast<uint64_t>(sender) << kRankShift);
}
// The connection handshake of Init (never matched by the control receives: low bit set).
inline uint64_t HelloTag(int sender) { return ControlTag(sender) | 1; }

// A data receive from `peer` that UCX completed with UCS_OK: OK when the message is the one the
// receive expected (`length` == `expected_bytes`, the low 48 bits of the tags equal), otherwise
// kInvalidArgument "message mismatch with peer <peer>: it sent <op> (<n> bytes), this rank
// expected <op> (<m> bytes)".
absl::Status CheckReceived(int peer, uint64_t expected_tag, size_t expected_bytes, size_t length,
                           uint64_t sender_tag);
// The same receive completed with UCS_ERR_MESSAGE_TRUNCATED (UCX wrote only `expected_bytes`).
absl::Status TruncatedError(int peer, uint64_t expected_tag, size_t expected_bytes);

// Control messages carry at most this many bytes; the receive buffer has exactly this size.
inline constexpr size_t kControlBytes = 1024;
inline constexpr char kBye = 'B';
inline constexpr char kFailed = 'F';

struct ControlNotice {
  bool bye = false;    // the peer shut down cleanly
  std::string reason;  // otherwise: why it failed (at most kControlBytes - 1 bytes)
};
// Shutdown's notice for `reason` (OK: bye); at most kControlBytes bytes.
std::string EncodeControlNotice(const absl::Status& reason);
// `buffer` is the control receive's buffer; `length` is what UCX reported, which exceeds the
// buffer when the message was truncated. Only min(length, buffer.size()) bytes are read. Anything
// but a bye is a failure; an empty one says "(no reason given)".
ControlNotice DecodeControlNotice(absl::string_view buffer, size_t length);

// The record a rank publishes under "ucx/address/<rank>".
inline constexpr size_t kMaxWorkerAddressBytes = 64 << 10;
struct AddressRecord {
  std::string worker_address;  // ucp_worker_get_address's bytes
  std::string boot_id;         // this boot's id; empty when unknown (written "-")
  int pid = 0;
  uint64_t start_time = 0;  // of process `pid`, clock ticks since boot
};
std::string FormatAddressRecord(const AddressRecord& record);
// kInvalidArgument saying what is wrong unless `record` has exactly four space-separated
// fields: non-empty hex of even length (at most 2 * kMaxWorkerAddressBytes digits), a boot id,
// a pid > 0 and a start time.
absl::StatusOr<AddressRecord> ParseAddressRecord(absl::string_view record);

// State and start time (clock ticks since boot) of a process, from its /proc/<pid>/stat line;
// state 0 when the line is not one (the process does not exist).
struct ProcessInfo {
  char state = 0;
  uint64_t start_time = 0;
};
ProcessInfo ParseProcessStat(absl::string_view stat);

}  // namespace fairscale::comm::ucx_internal
