// Pieces shared by the ucx transport's setup (ucx_setup.cc: Create, Init, Handshake) and its data
// path (ucx_transport.cc): the tag layout, the control messages, process liveness checks, error
// formatting and the progress loops' backoff. Internal to //comm/ucx:ucx_transport.
#pragma once

#include <sched.h>
#include <time.h>
#include <ucp/api/ucp.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace fairscale::comm::ucx_internal {


constexpr int kRankShift = 48;
constexpr uint64_t kLowMask = (uint64_t{1} << kRankShift) - 1;
constexpr uint64_t kControlBit = uint64_t{1} << 63;
constexpr uint64_t kRankMask = ~kLowMask;  // control bit + sender rank
constexpr int kMaxRanks = 1 << 15;
constexpr size_t kControlBytes = 1024;
constexpr char kBye = 'B';
constexpr char kFailed = 'F';
// Bounds of Shutdown: the failure notices and a clean flush of every endpoint.
constexpr absl::Duration kNoticeBudget = absl::Milliseconds(200);
constexpr absl::Duration kFlushBudget = absl::Seconds(2);
constexpr absl::Duration kForceBudget = absl::Seconds(2);

inline uint64_t DataTag(int sender, uint64_t tag) {
  return (static_cast<uint64_t>(sender) << kRankShift) | (tag & kLowMask);
}
inline uint64_t ControlTag(int sender) {
  return kControlBit | (static_cast<uint64_t>(sender) << kRankShift);
}
// The connection handshake of Init (never matched by the control receives: low bit set).
inline uint64_t HelloTag(int sender) { return ControlTag(sender) | 1; }

// This boot's id: two processes share /proc (and shared memory) only when it matches.
inline std::string BootId() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

// State and start time (clock ticks since boot) of a process, from /proc/<pid>/stat; state 0 when
// the process does not exist.
struct ProcessInfo {
  char state = 0;
  uint64_t start_time = 0;
};
inline ProcessInfo ReadProcess(int pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat;
  std::getline(in, stat);
  ProcessInfo info;
  const size_t paren = stat.rfind(')');  // the command name may contain spaces and parens
  if (paren == std::string::npos) return info;
  std::vector<absl::string_view> fields =
      absl::StrSplit(absl::string_view(stat).substr(paren + 1), ' ', absl::SkipEmpty());
  // After the name: state is field 3 of stat(5), starttime field 22.
  if (fields.size() < 20 || fields[0].empty()) return info;
  if (!absl::SimpleAtoi(fields[19], &info.start_time)) return info;
  info.state = fields[0][0];
  return info;
}

inline std::string UcsError(ucs_status_t status) { return ucs_status_string(status); }

inline absl::Status UcxError(absl::string_view what, ucs_status_t status) {
  return absl::InternalError(absl::StrCat("[ucx] ", what, ": ", UcsError(status)));
}

// Installs (once per process) a UCX log handler that drops two expected messages (ucx_setup.cc).
void InstallLogFilter();

// Backoff of the progress loops: spin (a reply often arrives within microseconds), then yield,
// then nap 20 us per round. (Napping from the start, 50 us after 128 spins, was tried: it tripled
// small-message latency over shared memory on the loaded 2-core VM and won nothing measurable.)
class Backoff {
 public:
  void Reset() { idle_ = 0; }
  void Idle() {
    ++idle_;
    if (idle_ < 256) return;
    if (idle_ < 4096) {
      sched_yield();
      return;
    }
    const timespec nap{0, 20'000};  // 20 us
    nanosleep(&nap, nullptr);
  }

 private:
  int idle_ = 0;
};

}  // namespace fairscale::comm::ucx_internal
