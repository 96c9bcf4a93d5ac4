#include "offload/tier.h"

#include <algorithm>
#include <cstring>
#include <vector>

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
  // Not (n + chunk_elems - 1) / chunk_elems: that overflows for a chunk_elems near 2^63.
  return n == 0 ? 0 : (n - 1) / chunk_elems() + 1;
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

absl::Status CopyTensor(Tier& from, Tier& to, size_t i) {
  const TensorSpec& spec = from.specs().at(i);
  if (!(to.specs().at(i).dtype == spec.dtype) || to.specs().at(i).numel() != spec.numel()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot copy ", from.name(), " tensor ",
                                                   DescribeSpec(spec), " into ", to.name(),
                                                   " tensor ", DescribeSpec(to.specs().at(i))));
  }
  const int64_t elem = static_cast<int64_t>(c10::elementSize(spec.dtype));
  const int64_t n = spec.numel();
  std::vector<char> src(static_cast<size_t>(std::max<int64_t>(1, std::min(from.chunk_elems(), n) * elem)));
  if (from.chunk_elems() == to.chunk_elems()) {
    for (int64_t c = 0; c < from.num_chunks(i); ++c) {
      absl::Status s = from.ReadChunk(i, c, src.data());
      if (s.ok()) s = to.WriteChunk(i, c, src.data());
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
  std::vector<char> dst(static_cast<size_t>(std::max<int64_t>(1, std::min(to.chunk_elems(), n) * elem)));
  int64_t loaded = -1;  // the source chunk in `src`
  for (int64_t dc = 0; dc < to.num_chunks(i); ++dc) {
    const int64_t begin = to.chunk_begin(dc), end = begin + to.chunk_count(i, dc);
    for (int64_t pos = begin; pos < end;) {
      const int64_t sc = pos / from.chunk_elems();
      if (sc != loaded) {
        absl::Status s = from.ReadChunk(i, sc, src.data());
        if (!s.ok()) return s;
        loaded = sc;
      }
      const int64_t take = std::min(end, from.chunk_begin(sc) + from.chunk_count(i, sc)) - pos;
      std::memcpy(dst.data() + (pos - begin) * elem,
                  src.data() + (pos - from.chunk_begin(sc)) * elem, static_cast<size_t>(take * elem));
      pos += take;
    }
    absl::Status s = to.WriteChunk(i, dc, dst.data());
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace fairscale::offload
