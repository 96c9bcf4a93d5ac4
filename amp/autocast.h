// Autocast: an RAII guard that turns on ATen's autocast (at::autocast) for one device type and
// dtype for its scope, like Python's `with torch.autocast(device_type, dtype):` (//amp). Inside
// the scope, ops on the autocast lists (linear, matmul, conv, ...) run in `dtype`, the others in
// float32; on exit the previous state (enabled flag, dtype, cache flag) is restored and the
// outermost guard clears the cast-weight cache.
//
//   {
//     amp::Autocast guard(at::kCPU, at::kBFloat16);
//     at::Tensor y = linear(x);            // bf16
//   }                                      // autocast as it was before
//
// Supported: CPU with bfloat16 (the only CPU autocast dtype of LibTorch 1.13), CUDA with float16
// or bfloat16. Autocast state is thread-local: the guard affects the thread that creates it and
// must be destroyed on that thread. Guards nest (an inner guard may also disable autocast with
// enabled = false).
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace fairscale::amp {

class Autocast {
 public:
  Autocast(c10::DeviceType device_type, c10::ScalarType dtype, bool enabled = true,
           bool cache_enabled = true);
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  c10::DeviceType device_type_;
  bool prev_enabled_;
  c10::ScalarType prev_dtype_;
  bool prev_cache_enabled_;
};

}  // namespace fairscale::amp
