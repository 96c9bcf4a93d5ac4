#include "comm/work.h"

#include <chrono>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace fairscale::comm {
namespace internal {
struct WorkState {
  explicit WorkState(std::string d) : description(std::move(d)) {}
  const std::string description;
  mutable absl::Mutex mu;
  // Set by the first Complete(); `done` only after that call has run the OnDone callbacks, so
  // Wait() returns after them.
  bool completing ABSL_GUARDED_BY(mu) = false;
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);
  // OnDone callbacks waiting for completion; moved out and run by Complete().
  std::vector<std::function<void(const absl::Status&)>> on_done ABSL_GUARDED_BY(mu);
  // OnWait observers; called after each blocking Wait().
  std::vector<std::function<void(absl::Duration, const absl::Status&)>> on_wait ABSL_GUARDED_BY(mu);
};
}  // namespace internal

namespace {
std::shared_ptr<internal::WorkState> DoneState(absl::Status status) {
  auto state = std::make_shared<internal::WorkState>("");
  absl::MutexLock lock(&state->mu);
  state->completing = true;
  state->done = true;
  state->status = std::move(status);
  return state;
}
}  // namespace

Work::Work() : state_(DoneState(absl::OkStatus())) {}

Work Work::Done(absl::Status status) { return Work(DoneState(std::move(status))); }

std::pair<Work, WorkCompleter> Work::Pending(std::string description) {
  auto state = std::make_shared<internal::WorkState>(std::move(description));
  return {Work(state), WorkCompleter(state)};
}

bool Work::IsDone() const {
  absl::MutexLock lock(&state_->mu);
  return state_->done;
}

absl::Status Work::Wait(absl::Duration timeout) const {
  internal::WorkState& s = *state_;
  std::vector<std::function<void(absl::Duration, const absl::Status&)>> observers;
  std::chrono::steady_clock::time_point start;
  absl::Status result;
  {
    absl::MutexLock lock(&s.mu);
    if (s.done) return s.status;
    observers = s.on_wait;
    if (!observers.empty()) start = std::chrono::steady_clock::now();
    auto done = [&s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) { return s.done; };
    if (timeout == absl::InfiniteDuration()) {
      s.mu.Await(absl::Condition(&done));
      result = s.status;
    } else if (!s.mu.AwaitWithTimeout(absl::Condition(&done), timeout)) {
      result = absl::DeadlineExceededError(
          absl::StrCat(s.description, s.description.empty() ? "" : ": ",
                       "Work::Wait gave up after ", absl::FormatDuration(timeout),
                       "; the operation is still running"));
    } else {
      result = s.status;
    }
  }
  if (!observers.empty()) {
    const absl::Duration waited = absl::FromChrono(std::chrono::steady_clock::now() - start);
    for (const auto& observer : observers) observer(waited, result);
  }
  return result;
}

void Work::OnWait(
    std::function<void(absl::Duration waited, const absl::Status& status)> observer) const {
  if (observer == nullptr) return;
  absl::MutexLock lock(&state_->mu);
  state_->on_wait.push_back(std::move(observer));
}

void Work::OnDone(std::function<void(const absl::Status&)> callback) const {
  if (callback == nullptr) return;
  absl::Status status;
  {
    absl::MutexLock lock(&state_->mu);
    if (!state_->completing) {
      state_->on_done.push_back(std::move(callback));
      return;
    }
    status = state_->status;
  }
  callback(status);
}

void WorkCompleter::Complete(absl::Status status) const {
  if (state_ == nullptr) return;
  std::vector<std::function<void(const absl::Status&)>> callbacks;
  {
    absl::MutexLock lock(&state_->mu);
    if (state_->completing) return;
    state_->completing = true;
    state_->status = std::move(status);
    callbacks.swap(state_->on_done);
    if (callbacks.empty()) {
      state_->done = true;
      return;
    }
    status = state_->status;
  }
  for (const auto& callback : callbacks) callback(status);
  absl::MutexLock lock(&state_->mu);
  state_->done = true;
}

absl::Status WaitAll(const Work* works, size_t n, absl::Duration timeout) {
  absl::Time deadline = timeout == absl::InfiniteDuration() ? absl::InfiniteFuture()
                                                             : absl::Now() + timeout;
  absl::Status first;
  for (size_t i = 0; i < n; ++i) {
    absl::Duration left = deadline == absl::InfiniteFuture() ? absl::InfiniteDuration()
                                                              : deadline - absl::Now();
    if (left < absl::ZeroDuration()) left = absl::ZeroDuration();
    absl::Status s = works[i].Wait(left);
    if (first.ok() && !s.ok()) first = s;
  }
  return first;
}

}  // namespace fairscale::comm
