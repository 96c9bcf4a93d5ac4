// The bytes of a stage boundary's control messages (//pipe, internal; wire.h sends them): the
// 24-byte activation header and the layout message. Bytes from another rank: the decoders trust
// nothing in them (fuzzed by //pipe/fuzz:wire_fuzz_test). ATen's ScalarType only, no tensors,
// so that the fuzz target links no more than that.
//
//   header  int64[3] {kMagic, id, meta_len}     meta_len in [0, kMaxLayoutWords]
//   layout  int64[meta_len] {version 2, is_list 0|1, tensor count n, skips,
//                            then per tensor: dtype, requires_grad 0|1, ndim, sizes[ndim]}
#pragma once

#include <c10/core/ScalarType.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fairscale::pipe::internal {

struct TensorLayout {
  c10::ScalarType dtype = c10::ScalarType::Float;
  bool requires_grad = false;
  std::vector<int64_t> sizes;
  bool operator==(const TensorLayout& o) const {
    return dtype == o.dtype && requires_grad == o.requires_grad && sizes == o.sizes;
  }
};

struct BoundaryLayout {
  bool is_list = false;
  int64_t skips = 0;
  std::vector<TensorLayout> tensors;
  bool operator==(const BoundaryLayout& o) const {
    return is_list == o.is_list && skips == o.skips && tensors == o.tensors;
  }
};

inline constexpr int64_t kHeaderMagic = 0x50495045;  // "PIPE"
inline constexpr int64_t kHeaderWords = 3;
// Bounds of a layout message: its words (512 KiB; e.g. 4,096 tensors of 12 dimensions), and one
// tensor's dimensions. A sender refuses a layout over them (kInvalidArgument), a receiver a
// header or layout that claims more (kDataLoss), before allocating for it.
inline constexpr int64_t kMaxLayoutWords = int64_t{1} << 16;
inline constexpr int64_t kMaxDims = 64;

// The dtypes a boundary carries: those of the comm layer, and bool (which travels as u8).
bool IsWireDtype(c10::ScalarType dtype);

std::array<int64_t, kHeaderWords> EncodeHeader(int64_t id, int64_t meta_len);
// The header's meta_len. kDataLoss on a bad magic or a meta_len outside [0, kMaxLayoutWords];
// kInternal when it is intact but of another message than `id` (the stages disagree on the
// schedule: a bug, not corruption).
absl::StatusOr<int64_t> CheckHeader(const std::array<int64_t, kHeaderWords>& header, int64_t id);

// kInvalidArgument when the layout cannot travel: a dtype that is not IsWireDtype, more than
// kMaxDims dimensions, a negative size, a tensor of more than INT64_MAX bytes, skips outside
// [0, tensors] (a single tensor: exactly 1 + skips tensors), an encoding over kMaxLayoutWords.
absl::Status CheckLayout(const BoundaryLayout& layout);
std::vector<int64_t> EncodeLayout(const BoundaryLayout& layout);
// kDataLoss on a malformed encoding: anything EncodeLayout of a layout that passes CheckLayout
// would not write (so every layout that decodes passes CheckLayout and re-encodes to `encoded`).
absl::StatusOr<BoundaryLayout> DecodeLayout(const std::vector<int64_t>& encoded);
// "f32[4, 8] requires_grad, i64[4]" (then " + 2 skips" when there are skip tensors).
std::string DescribeLayout(const BoundaryLayout& layout);

}  // namespace fairscale::pipe::internal
