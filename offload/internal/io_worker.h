// One background I/O thread with a FIFO queue (//offload:io_worker): the offloaders read the
// next chunk / slice and write back the previous one here while the caller computes. Tasks run
// in submission order, which is what makes a three-slot staging ring safe without more locking.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

#include "absl/status/status.h"

namespace fairscale::offload::internal {

class IoWorker {
 public:
  IoWorker() : thread_([this] { Run(); }) {}
  ~IoWorker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  IoWorker(const IoWorker&) = delete;
  IoWorker& operator=(const IoWorker&) = delete;

  std::future<absl::Status> Submit(std::function<absl::Status()> task) {
    std::packaged_task<absl::Status()> t(std::move(task));
    std::future<absl::Status> f = t.get_future();
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(t));
    }
    cv_.notify_one();
    return f;
  }

 private:
  void Run() {
    for (;;) {
      std::packaged_task<absl::Status()> t;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and drained
        t = std::move(queue_.front());
        queue_.pop_front();
      }
      t();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<absl::Status()>> queue_;  // guarded by mu_
  bool stop_ = false;                                      // guarded by mu_
  std::thread thread_;
};

}  // namespace fairscale::offload::internal
