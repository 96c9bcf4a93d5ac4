#include "amp/autocast.h"

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>

namespace fairscale::amp {
namespace {

bool IsEnabled(c10::DeviceType device_type) {
  return device_type == c10::kCPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
}

void SetEnabled(c10::DeviceType device_type, bool enabled) {
  if (device_type == c10::kCPU) {
    at::autocast::set_cpu_enabled(enabled);
  } else {
    at::autocast::set_enabled(enabled);
  }
}

c10::ScalarType GetDtype(c10::DeviceType device_type) {
  return device_type == c10::kCPU ? at::autocast::get_autocast_cpu_dtype()
                                  : at::autocast::get_autocast_gpu_dtype();
}

void SetDtype(c10::DeviceType device_type, c10::ScalarType dtype) {
  if (device_type == c10::kCPU) {
    at::autocast::set_autocast_cpu_dtype(dtype);
  } else {
    at::autocast::set_autocast_gpu_dtype(dtype);
  }
}

}  // namespace

Autocast::Autocast(c10::DeviceType device_type, c10::ScalarType dtype, bool enabled,
                   bool cache_enabled)
    : device_type_(device_type) {
  TORCH_CHECK(device_type == c10::kCPU || device_type == c10::kCUDA,
              "amp::Autocast: device type must be CPU or CUDA, got ", device_type);
  if (device_type == c10::kCPU) {
    TORCH_CHECK(dtype == c10::kBFloat16,
                "amp::Autocast: CPU autocast supports only BFloat16 in LibTorch 1.13, got ", dtype);
  } else {
    TORCH_CHECK(dtype == c10::kHalf || dtype == c10::kBFloat16,
                "amp::Autocast: CUDA autocast supports Half and BFloat16, got ", dtype);
  }
  prev_enabled_ = IsEnabled(device_type);
  prev_dtype_ = GetDtype(device_type);
  prev_cache_enabled_ = at::autocast::is_autocast_cache_enabled();
  SetEnabled(device_type, enabled);
  SetDtype(device_type, dtype);
  at::autocast::set_autocast_cache_enabled(cache_enabled);
  at::autocast::increment_nesting();
}

Autocast::~Autocast() {
  // As torch.autocast.__exit__: the outermost guard drops the cached casts of the weights.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  SetEnabled(device_type_, prev_enabled_);
  SetDtype(device_type_, prev_dtype_);
  at::autocast::set_autocast_cache_enabled(prev_cache_enabled_);
}

}  // namespace fairscale::amp
