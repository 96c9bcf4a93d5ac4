// One background I/O thread with a FIFO queue (//offload:io_worker): the offloaders read the
// next chunk / slice and write back the previous one here while the caller computes. Tasks run
// in submission order, which is what makes a three-slot staging ring safe without more locking.
#pragma once

#include <deque>
#include <functional>
#include <future>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace fairscale::offload::internal {

class IoWorker {
 public:
  IoWorker() : thread_([this] { Run(); }) {}
  ~IoWorker() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }
  IoWorker(const IoWorker&) = delete;
  IoWorker& operator=(const IoWorker&) = delete;

  std::future<absl::Status> Submit(std::function<absl::Status()> task) {
    std::packaged_task<absl::Status()> t(std::move(task));
    std::future<absl::Status> f = t.get_future();
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(t));
    return f;
  }

 private:
  void Run() {
    for (;;) {
      std::packaged_task<absl::Status()> t;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &IoWorker::HasWorkOrStop));
        if (queue_.empty()) return;  // stop_ and drained
        t = std::move(queue_.front());
        queue_.pop_front();
      }
      t();
    }
  }
  bool HasWorkOrStop() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); }

  absl::Mutex mu_;
  std::deque<std::packaged_task<absl::Status()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace fairscale::offload::internal
