// 64-bit FNV-1a (//base:fnv1a): the repository's one checksum for files it writes itself (the
// offload tier's per-chunk checksums; the GPT job's checkpoint digests can use it too). It is
// there to catch torn, truncated and overwritten data, not adversaries.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fairscale::base {

inline constexpr uint64_t kFnv1a64Basis = 0xcbf29ce484222325ULL;

// FNV-1a of `n` bytes, continuing from `h` (start: kFnv1a64Basis), so data can be hashed in pieces.
uint64_t Fnv1a64(const void* data, size_t n, uint64_t h = kFnv1a64Basis);

}  // namespace fairscale::base
