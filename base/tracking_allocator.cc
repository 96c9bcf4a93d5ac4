#include "base/tracking_allocator.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

namespace fairscale::base {
namespace {
TrackingCpuAllocator* g_tracker = nullptr;
}  // namespace

TrackingCpuAllocator* TrackingCpuAllocator::Install() {
  if (g_tracker == nullptr) {
    g_tracker = new TrackingCpuAllocator();  // leaked: tensors may be freed during exit
    // Priority above the default allocator's registration, so nothing registered later at the
    // default priority replaces it.
    c10::SetAllocator(c10::DeviceType::CPU, g_tracker, /*priority=*/10);
  }
  return g_tracker;
}

c10::DataPtr TrackingCpuAllocator::allocate(size_t n) const {
  void* data = c10::alloc_cpu(n);
  if (data != nullptr) {
    {
      absl::MutexLock lock(&mu_);
      sizes_[data] = n;
    }
    const int64_t live = live_.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    int64_t peak = peak_.load();
    while (live > peak && !peak_.compare_exchange_weak(peak, live)) {
    }
  }
  return c10::DataPtr(data, data, &Free, c10::Device(c10::DeviceType::CPU));
}

void TrackingCpuAllocator::Free(void* data) {
  if (data == nullptr) return;
  size_t n = 0;
  {
    absl::MutexLock lock(&g_tracker->mu_);
    auto it = g_tracker->sizes_.find(data);
    if (it != g_tracker->sizes_.end()) {
      n = it->second;
      g_tracker->sizes_.erase(it);
    }
  }
  g_tracker->live_.fetch_sub(static_cast<int64_t>(n));
  c10::free_cpu(data);
}

}  // namespace fairscale::base
