#include "comm/algorithms/heartbeat.h"

#include <pthread.h>

#include <cstdint>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "base/logging.h"

namespace fairscale::comm {

struct HeartbeatMonitor::State {
  std::shared_ptr<Store> store;
  int rank = 0;
  int size = 1;
  Options options;

  absl::Mutex mu;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  StallCallback on_stall ABSL_GUARDED_BY(mu);
  absl::Time op_since ABSL_GUARDED_BY(mu) = absl::InfiniteFuture();
  // Written by the store thread: the peers' counters as last read (-1: not read) and when a
  // store call last completed. The monitor thread judges from them, so a store call that hangs
  // (its host unreachable, packets silently dropped) cannot silence the monitor.
  bool want_counters ABSL_GUARDED_BY(mu) = false;
  std::vector<int64_t> counters ABSL_GUARDED_BY(mu);
  absl::Time store_answered ABSL_GUARDED_BY(mu) = absl::Now();

  static std::string Key(int r) { return absl::StrCat("hb/", r); }

  void RunStore();
  void RunMonitor();
};

// The store thread: this rank's beat every interval and, while an operation is overdue, the
// other ranks' counters.
void HeartbeatMonitor::State::RunStore() {
  pthread_setname_np(pthread_self(), "fs-heartbeat-io");
  // Store failures since it last answered: the first is logged at once, then one line per
  // store_warning_every with the count, and one when the store answers again.
  int64_t failures = 0;
  absl::Time failing_since = absl::InfinitePast(), last_line = absl::InfinitePast();
  const std::string who = absl::StrCat("heartbeat of rank ", rank, "/", size);
  auto since = [&](absl::Time now) {
    return absl::FormatDuration(absl::Trunc(now - failing_since, absl::Milliseconds(100)));
  };
  auto warn = [&](const absl::Status& s) {
    const absl::Time now = absl::Now();
    if (failures++ == 0) {
      failing_since = last_line = now;
      FS_LOG(WARNING) << who << " through the store failed (retrying every "
                      << absl::FormatDuration(options.interval) << "): " << s;
    } else if (now - last_line >= options.store_warning_every) {
      last_line = now;
      FS_LOG(WARNING) << who << " through the store still failing after " << since(now) << " ("
                      << failures << " failed beats): " << s;
    }
  };
  auto answered = [&]() {
    if (failures == 0) return;
    FS_LOG(INFO) << who << ": the store answers again after " << since(absl::Now()) << " ("
                 << failures << " failed beats)";
    failures = 0;
  };
  std::vector<int64_t> read(size, -1);
  while (true) {
    bool want = false;
    {
      absl::MutexLock lock(&mu);
      auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return stopping; };
      mu.AwaitWithTimeout(absl::Condition(&stop), options.interval);
      if (stopping) return;
      want = want_counters;
    }
    bool ok = true;
    if (absl::StatusOr<int64_t> beat = store->Add(Key(rank), 1); !beat.ok()) {
      warn(beat.status());
      ok = false;
    }
    for (int p = 0; ok && want && p < size; ++p) {
      if (p == rank) continue;
      absl::StatusOr<int64_t> v = store->Add(Key(p), 0);
      if (!v.ok()) {
        warn(v.status());
        ok = false;
        break;
      }
      read[p] = *v;
    }
    if (ok) answered();
    absl::MutexLock lock(&mu);
    if (!ok) continue;
    store_answered = absl::Now();
    if (want) counters = read;
  }
}

void HeartbeatMonitor::State::RunMonitor() {
  pthread_setname_np(pthread_self(), "fs-heartbeat");
  const absl::Duration window = options.stall_timeout / 2;
  std::vector<int64_t> seen(size, -1);
  std::vector<absl::Time> moved(size, absl::InfinitePast());
  while (true) {
    absl::Time op_since, answered;
    std::vector<int64_t> now_counters;
    {
      absl::MutexLock lock(&mu);
      auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return stopping; };
      mu.AwaitWithTimeout(absl::Condition(&stop), options.interval);
      if (stopping) return;
      op_since = this->op_since;
      answered = store_answered;
      const absl::Time now = absl::Now();
      want_counters = op_since != absl::InfiniteFuture() && now - op_since >= window;
      if (!want_counters) counters.assign(size, -1);
      now_counters = counters;
    }
    const absl::Time now = absl::Now();
    if (op_since == absl::InfiniteFuture() || now - op_since < window) {
      seen.assign(size, -1);  // a fresh baseline for the next overdue operation
      continue;
    }
    absl::Status stalled;
    if (now - answered >= window && now - op_since >= options.stall_timeout) {
      // No store answer for half the stall timeout while the operation is overdue: this rank
      // cannot tell whether its peers live, and the network to the store's host is what failed.
      stalled = absl::UnavailableError(absl::StrCat(
          "the store has not answered this rank's heartbeat for ",
          absl::FormatDuration(absl::Trunc(now - answered, absl::Milliseconds(100))),
          " while this operation waited ",
          absl::FormatDuration(absl::Trunc(now - op_since, absl::Milliseconds(100))),
          " (the network to the store's host, rank 0's or the launcher's, is down or dropping "
          "packets; ranks beat every ",
          absl::FormatDuration(options.interval), ", algo.stall_timeout_ms=",
          absl::ToInt64Milliseconds(options.stall_timeout), ")"));
    } else {
      std::vector<int> silent;
      for (int p = 0; p < size; ++p) {
        if (p == rank || now_counters.empty() || now_counters[p] < 0) continue;
        if (now_counters[p] != seen[p]) {
          seen[p] = now_counters[p];
          moved[p] = now;
        } else if (now - moved[p] >= window) {
          silent.push_back(p);
        }
      }
      if (silent.empty()) continue;
      std::vector<std::string> named;
      for (int p : silent) {
        const bool known = static_cast<int>(options.peer_addresses.size()) == size &&
                           !options.peer_addresses[p].empty();
        named.push_back(known ? absl::StrCat(p, " (", options.peer_addresses[p], ")")
                              : absl::StrCat(p));
      }
      stalled = absl::UnavailableError(absl::StrCat(
          silent.size() == 1 ? "rank " : "ranks ", absl::StrJoin(named, ", "),
          silent.size() == 1 ? " shows" : " show", " no sign of life: no heartbeat for ",
          absl::FormatDuration(absl::Trunc(now - moved[silent.front()], absl::Milliseconds(100))),
          " while this operation waited ",
          absl::FormatDuration(absl::Trunc(now - op_since, absl::Milliseconds(100))),
          " (the process is stopped, frozen or gone; ranks beat every ",
          absl::FormatDuration(options.interval), ", algo.stall_timeout_ms=",
          absl::ToInt64Milliseconds(options.stall_timeout), ")"));
    }
    absl::MutexLock lock(&mu);
    // The operation may have ended while the counters were judged: then nobody waits.
    if (this->op_since != op_since) continue;
    if (on_stall) {
      StallCallback report = std::move(on_stall);
      on_stall = nullptr;
      report(stalled);
    }
  }
}

HeartbeatMonitor::HeartbeatMonitor(std::shared_ptr<Store> store, int rank, int size,
                                   Options options, StallCallback on_stall)
    : state_(std::make_shared<State>()) {
  state_->store = std::move(store);
  state_->rank = rank;
  state_->size = size;
  state_->options = options;
  {
    absl::MutexLock lock(&state_->mu);
    state_->on_stall = std::move(on_stall);
  }
  // Detached: they own what they touch (the shared State and the store), so the destructor need
  // not wait for a store call that a frozen store host would hold.
  std::thread([state = state_] { state->RunStore(); }).detach();
  std::thread([state = state_] { state->RunMonitor(); }).detach();
}

HeartbeatMonitor::~HeartbeatMonitor() {
  absl::MutexLock lock(&state_->mu);
  state_->stopping = true;
  state_->on_stall = nullptr;
}

void HeartbeatMonitor::OperationStarted() {
  absl::MutexLock lock(&state_->mu);
  state_->op_since = absl::Now();
}

void HeartbeatMonitor::OperationFinished() {
  absl::MutexLock lock(&state_->mu);
  state_->op_since = absl::InfiniteFuture();
}

}  // namespace fairscale::comm
