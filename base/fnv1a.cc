#include "base/fnv1a.h"

namespace fairscale::base {

uint64_t Fnv1a64(const void* data, size_t n, uint64_t h) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ULL;  // FNV prime
  return h;
}

}  // namespace fairscale::base
