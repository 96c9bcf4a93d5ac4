// Pieces shared by the ucx transport's setup (ucx_setup.cc: Create, Init, Handshake) and its data
// path (ucx_transport.cc): process liveness checks, error formatting and the progress loops'
// backoff. Internal to //comm/ucx:ucx_transport.
#pragma once

#include <sched.h>
#include <time.h>
#include <ucp/api/ucp.h>

#include <cstdint>
#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/ucx/ucx_wire.h"

namespace fairscale::comm::ucx_internal {

// The tag layout, control messages and decoders of peer bytes are in ucx_wire.h.

// Bounds of Shutdown: the failure notices and a clean flush of every endpoint.
constexpr absl::Duration kNoticeBudget = absl::Milliseconds(200);
constexpr absl::Duration kFlushBudget = absl::Seconds(2);
constexpr absl::Duration kForceBudget = absl::Seconds(2);

// This boot's id: two processes share /proc (and shared memory) only when it matches.
inline std::string BootId() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

// State and start time of a process (ParseProcessStat); state 0 when it does not exist.
inline ProcessInfo ReadProcess(int pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat;
  std::getline(in, stat);
  return ParseProcessStat(stat);
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
