#include "offload/tier.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fairscale::offload {

int64_t TensorSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string DescribeSpec(const TensorSpec& spec) {
  return absl::StrCat("'", spec.name, "': ", c10::toString(spec.dtype), "[",
                      absl::StrJoin(spec.shape, ", "), "]");
}

int64_t Tier::num_chunks(size_t tensor) const {
  const int64_t n = specs().at(tensor).numel();
  return (n + chunk_elems() - 1) / chunk_elems();
}

int64_t Tier::chunk_count(size_t tensor, int64_t chunk) const {
  const int64_t n = specs().at(tensor).numel();
  return std::min(chunk_elems(), n - chunk_begin(chunk));
}

absl::Status Tier::ReadTensor(size_t tensor, void* dst) {
  const int64_t elem = static_cast<int64_t>(c10::elementSize(specs().at(tensor).dtype));
  for (int64_t c = 0; c < num_chunks(tensor); ++c) {
    absl::Status s = ReadChunk(tensor, c, static_cast<char*>(dst) + chunk_begin(c) * elem);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status Tier::WriteTensor(size_t tensor, const void* src) {
  const int64_t elem = static_cast<int64_t>(c10::elementSize(specs().at(tensor).dtype));
  for (int64_t c = 0; c < num_chunks(tensor); ++c) {
    absl::Status s =
        WriteChunk(tensor, c, static_cast<const char*>(src) + chunk_begin(c) * elem);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace fairscale::offload
