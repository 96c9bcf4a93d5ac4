// HeartbeatMonitor: finds a rank that stopped living (SIGSTOP, a frozen VM or cgroup, a process
// wedged in the kernel) within seconds, independently of how long a legitimate operation may
// take (//comm/algorithms:transport_communicator uses it; internal to comm).
//
// Every rank of a communicator bumps its counter "hb/<rank>" in the communicator's store every
// `interval` from a thread of its own. While an operation of this rank has been running for
// more than stall_timeout / 2, the monitor also reads the other ranks' counters at every beat; a
// rank whose counter did not move for stall_timeout / 2 of that sampling is reported once through
// `on_stall` (so 1-1.5 stall_timeouts after the operation started waiting; TransportCommunicator
// uses algo::EffectiveStallTimeout, at most half the operation timeout). A slow but live rank
// keeps beating (its monitor thread runs whatever its training thread does), so a long
// collective is never mistaken for a dead peer; a rank stuck in its own code while its process
// lives is left to the operation's timeout.
//
// The store calls run on a thread of their own: when the store stops answering (its host
// unreachable, packets silently dropped: a call then hangs rather than fails) while an operation
// of this rank is overdue by stall_timeout, the monitor cannot vouch for any peer and reports
// that, naming the store, instead of leaving the operation to its own (possibly long) timeout.
//
// Cost: one store Add per rank per interval, plus size - 1 reads per interval while an operation
// is overdue. Store errors are logged, rate-limited: the first failure at once, then one line per
// `store_warning_every` with the count of failed beats so far, and one line when the store
// answers again. They are fatal only as above, while an operation waits: the data path does not
// depend on the store after setup.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "comm/store/store.h"

namespace fairscale::comm {

class HeartbeatMonitor {
 public:
  struct Options {
    absl::Duration interval = absl::Seconds(1);
    absl::Duration stall_timeout = absl::Seconds(10);
    // While the store keeps failing, how often that is logged again (after the first failure).
    absl::Duration store_warning_every = absl::Minutes(1);
    // Where each rank is (the transport's PeerAddress), named beside a silent rank when given
    // (size entries; empty ones are left out).
    std::vector<std::string> peer_addresses;
  };
  using StallCallback = std::function<void(const absl::Status&)>;

  // Starts the monitor's threads. `on_stall` runs on one, at most once, with kUnavailable naming
  // the silent rank(s) or the silent store; it must be quick and thread-safe
  // (TransportCommunicator cancels its transport).
  HeartbeatMonitor(std::shared_ptr<Store> store, int rank, int size, Options options,
                   StallCallback on_stall);
  // Disarms the callback and stops the thread without waiting for a store call in flight (a
  // store whose host is frozen must not hold up the communicator's destruction).
  ~HeartbeatMonitor();
  HeartbeatMonitor(const HeartbeatMonitor&) = delete;
  HeartbeatMonitor& operator=(const HeartbeatMonitor&) = delete;

  // Brackets each operation of this rank (any thread).
  void OperationStarted();
  void OperationFinished();

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace fairscale::comm
