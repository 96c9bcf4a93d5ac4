// TrackingCpuAllocator (//base:tracking_allocator): a CPU allocator that counts tensor memory
// exactly. Installed with c10::SetAllocator(kCPU, ...) it serves every CPU tensor allocation of the
// process through c10's own alloc_cpu/free_cpu and counts live and peak bytes, so benchmarks
// (//fsdp/bench, //checkpoint/bench) and the memory tracer (//checkpoint:memory_tracker) report
// peak tensor memory instead of estimating it from RSS (which also counts freed-but-cached heap
// pages, code and communication buffers).
#pragma once

#include <c10/core/Allocator.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace fairscale::base {

class TrackingCpuAllocator final : public c10::Allocator {
 public:
  // Installs the (process-wide, never destroyed) tracker as the CPU allocator; call once, before
  // any tensor whose memory should be counted is created. Tensors allocated earlier are freed by
  // their own deleter and never counted.
  static TrackingCpuAllocator* Install();

  c10::DataPtr allocate(size_t n) const override;
  // The raw interface works too: data and context are the same pointer.
  c10::DeleterFnPtr raw_deleter() const override { return &Free; }

  int64_t live_bytes() const { return live_.load(); }
  int64_t peak_bytes() const { return peak_.load(); }
  // Starts a new peak from the bytes live now.
  void reset_peak() { peak_.store(live_.load()); }
  // Raises the peak to at least `bytes` (restores an outer peak after a nested reset_peak()).
  void raise_peak(int64_t bytes) {
    int64_t peak = peak_.load();
    while (bytes > peak && !peak_.compare_exchange_weak(peak, bytes)) {
    }
  }

 private:
  static void Free(void* data);

  // alloc_cpu does not tell the size back at free time, so live allocations are kept here.
  mutable absl::Mutex mu_;
  mutable std::unordered_map<void*, size_t> sizes_ ABSL_GUARDED_BY(mu_);
  mutable std::atomic<int64_t> live_{0};
  mutable std::atomic<int64_t> peak_{0};
};

}  // namespace fairscale::base
