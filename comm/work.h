// Work: the handle every asynchronous comm operation returns (//comm:interface).
//
// An operation is queued when its Communicator method returns; its Work completes exactly once,
// with OK or the error that ended it. Wait() blocks the caller; IsDone() polls. Work is a cheap,
// copyable handle (shared state), safe to use from any thread.
//
// Waiting never hangs: every operation carries its own timeout (CommConfig::timeout or
// OpOptions::timeout), after which the backend fails it with kDeadlineExceeded. Wait(d) returns
// kDeadlineExceeded after d even if the operation is still running (it keeps running; wait again).
//
// Backends create a pending Work with Work::Pending() and complete it through the returned
// WorkCompleter. Observers (tracing, //trace) learn the completion time through OnDone() instead
// of polling.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace fairscale::comm {

namespace internal {
struct WorkState;
}

class WorkCompleter;

class [[nodiscard]] Work {
 public:
  // A Work that is already done with OK.
  Work();

  // A Work that is already done with `status` (used for argument errors).
  static Work Done(absl::Status status);

  // A pending Work and the completer that finishes it. `description` ("all_reduce #12 rank 2/4
  // [tcp]") prefixes the message of a Wait() that times out.
  static std::pair<Work, WorkCompleter> Pending(std::string description);

  bool IsDone() const;

  // Blocks until the operation completes or `timeout` passes. Returns the operation's status, or
  // kDeadlineExceeded if it is still running after `timeout`.
  absl::Status Wait(absl::Duration timeout = absl::InfiniteDuration()) const;

  // Runs `callback(status)` once, when the operation completes: at once on the calling thread if
  // it is already done, else on the thread that completes it (a backend thread), outside every
  // lock of the Work, in the order the callbacks were added. The Work counts as done only after
  // they return: once Wait() returns or IsDone() is true, every callback added before completion
  // has run (so an observer's record of the operation is complete by then). Hence a callback
  // must not Wait() on its own Work (IsDone() is still false inside it). Keep callbacks short and
  // non-blocking: they delay the backend thread and the waiters. A Work that never completes
  // (impossible for a healthy backend, see the timeout rule above) never runs its callbacks.
  void OnDone(std::function<void(const absl::Status&)> callback) const;

  // Calls `observer(waited, status)` on the waiting thread after every Wait() that blocked (the
  // Work was not done when Wait was called), with the time it blocked (steady clock) and what it
  // returned, including kDeadlineExceeded. Waits on an already-done Work are not reported. For
  // observers that attribute waiting time (//trace); keep it short.
  void OnWait(std::function<void(absl::Duration waited, const absl::Status& status)> observer) const;

 private:
  explicit Work(std::shared_ptr<internal::WorkState> state) : state_(std::move(state)) {}
  std::shared_ptr<internal::WorkState> state_;
};

// The producer side of a Work. Complete() may be called once; later calls are ignored (the
// first status wins, so an Abort racing a normal completion is harmless).
class WorkCompleter {
 public:
  WorkCompleter() = default;
  void Complete(absl::Status status) const;
  bool valid() const { return state_ != nullptr; }

 private:
  friend class Work;
  explicit WorkCompleter(std::shared_ptr<internal::WorkState> state) : state_(std::move(state)) {}
  std::shared_ptr<internal::WorkState> state_;
};

// Waits for every work (each with the same overall timeout) and returns the first error.
absl::Status WaitAll(const Work* works, size_t n,
                     absl::Duration timeout = absl::InfiniteDuration());

}  // namespace fairscale::comm
