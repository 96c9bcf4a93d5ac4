#include "pipe/internal/boundary_layout.h"

#include <algorithm>
#include <cstddef>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fairscale::pipe::internal {
namespace {

constexpr int64_t kLayoutVersion = 2;  // 2: the skip count after the tensor count
constexpr int64_t kPrefixWords = 4;    // version, is_list, n, skips
constexpr int64_t kTensorWords = 3;    // dtype, requires_grad, ndim (then the sizes)

// Why `layout` cannot travel ("" if it can). `words`: its encoding's length.
std::string Problem(const BoundaryLayout& layout, int64_t* words) {
  const int64_t n = static_cast<int64_t>(layout.tensors.size());
  if (layout.skips < 0 || layout.skips > n || (!layout.is_list && n != 1 + layout.skips)) {
    return absl::StrCat(layout.is_list ? "a list of " : "a single tensor as ", n,
                        " tensors with ", layout.skips, " skips");
  }
  *words = kPrefixWords;
  for (int64_t i = 0; i < n; ++i) {
    const TensorLayout& t = layout.tensors[i];
    if (!IsWireDtype(t.dtype)) {
      return absl::StrCat("tensor ", i, ": dtype ", static_cast<int>(t.dtype),
                          " does not cross a boundary");
    }
    const int64_t ndim = static_cast<int64_t>(t.sizes.size());
    if (ndim > kMaxDims) return absl::StrCat("tensor ", i, ": ", ndim, " dimensions");
    int64_t bytes = static_cast<int64_t>(c10::elementSize(t.dtype));
    for (int64_t d : t.sizes) {
      if (d < 0) return absl::StrCat("tensor ", i, ": size ", d);
      if (__builtin_mul_overflow(bytes, d, &bytes)) {
        return absl::StrCat("tensor ", i, ": sizes [", absl::StrJoin(t.sizes, ", "),
                            "] hold more than 2^63 bytes");
      }
    }
    *words += kTensorWords + ndim;
    if (*words > kMaxLayoutWords) {
      return absl::StrCat("more than ", kMaxLayoutWords, " words from tensor ", i);
    }
  }
  return "";
}

}  // namespace

bool IsWireDtype(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float:
    case c10::ScalarType::Double:
    case c10::ScalarType::Half:
    case c10::ScalarType::BFloat16:
    case c10::ScalarType::Char:
    case c10::ScalarType::Byte:
    case c10::ScalarType::Int:
    case c10::ScalarType::Long:
    case c10::ScalarType::Bool:
      return true;
    default:
      return false;
  }
}

std::array<int64_t, kHeaderWords> EncodeHeader(int64_t id, int64_t meta_len) {
  return {kHeaderMagic, id, meta_len};
}

absl::StatusOr<int64_t> CheckHeader(const std::array<int64_t, kHeaderWords>& h, int64_t id) {
  if (h[0] != kHeaderMagic || h[2] < 0 || h[2] > kMaxLayoutWords) {
    return absl::DataLossError(absl::StrCat("malformed activation header {", h[0], ", ", h[1], ", ",
                                            h[2], "} (expected magic ", kHeaderMagic,
                                            " and a layout of 0 to ", kMaxLayoutWords, " words)"));
  }
  if (h[1] != id) {
    return absl::InternalError(absl::StrCat("expected the header of message ", id, ", got {",
                                            h[0], ", ", h[1], ", ", h[2], "}"));
  }
  return h[2];
}

absl::Status CheckLayout(const BoundaryLayout& layout) {
  int64_t words = 0;
  const std::string problem = Problem(layout, &words);
  if (problem.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("activation layout ", problem));
}

std::vector<int64_t> EncodeLayout(const BoundaryLayout& layout) {
  std::vector<int64_t> out = {kLayoutVersion, layout.is_list ? 1 : 0,
                              static_cast<int64_t>(layout.tensors.size()), layout.skips};
  for (const TensorLayout& t : layout.tensors) {
    out.push_back(static_cast<int64_t>(t.dtype));
    out.push_back(t.requires_grad ? 1 : 0);
    out.push_back(static_cast<int64_t>(t.sizes.size()));
    out.insert(out.end(), t.sizes.begin(), t.sizes.end());
  }
  return out;
}

absl::StatusOr<BoundaryLayout> DecodeLayout(const std::vector<int64_t>& in) {
  auto bad = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat("malformed activation layout (", in.size(),
                                            " words): ", what));
  };
  if (static_cast<int64_t>(in.size()) > kMaxLayoutWords) return bad("too long");
  size_t pos = 0;
  auto left = [&] { return static_cast<int64_t>(in.size() - pos); };
  auto next = [&](int64_t* v) {
    if (pos >= in.size()) return false;
    *v = in[pos++];
    return true;
  };
  auto flag = [](int64_t v) { return v == 0 || v == 1; };
  int64_t version = 0, is_list = 0, n = 0, skips = 0;
  if (!next(&version)) return bad("truncated prefix");
  if (version != kLayoutVersion) return bad(absl::StrCat("version ", version));
  if (!next(&is_list) || !next(&n) || !next(&skips)) return bad("truncated prefix");
  if (!flag(is_list)) return bad(absl::StrCat("is_list ", is_list));
  // Every tensor takes at least kTensorWords words: bound n before anything is kept for it.
  if (n < 0 || n > left() / kTensorWords) {
    return bad(absl::StrCat(n, " tensors in ", left(), " words"));
  }
  BoundaryLayout layout;
  layout.is_list = is_list != 0;
  layout.skips = skips;
  for (int64_t i = 0; i < n; ++i) {
    int64_t dtype = 0, requires_grad = 0, ndim = 0;
    if (!next(&dtype) || !next(&requires_grad) || !next(&ndim)) return bad("truncated tensor");
    if (dtype < 0 || dtype >= static_cast<int64_t>(c10::ScalarType::NumOptions) ||
        !flag(requires_grad) || ndim < 0 || ndim > kMaxDims || ndim > left()) {
      return bad(absl::StrCat("tensor ", i, " dtype ", dtype, " requires_grad ", requires_grad,
                              " ndim ", ndim));
    }
    TensorLayout t;
    t.dtype = static_cast<c10::ScalarType>(dtype);
    t.requires_grad = requires_grad != 0;
    t.sizes.assign(in.begin() + static_cast<std::ptrdiff_t>(pos),
                   in.begin() + static_cast<std::ptrdiff_t>(pos + ndim));
    pos += static_cast<size_t>(ndim);
    layout.tensors.push_back(std::move(t));
  }
  if (pos != in.size()) return bad("trailing words");
  int64_t words = 0;
  const std::string problem = Problem(layout, &words);
  if (!problem.empty()) return bad(problem);
  return layout;
}

std::string DescribeLayout(const BoundaryLayout& layout) {
  std::vector<std::string> parts;
  for (const TensorLayout& t : layout.tensors) {
    parts.push_back(absl::StrCat(c10::toString(t.dtype), "[", absl::StrJoin(t.sizes, ", "), "]",
                                 t.requires_grad ? " requires_grad" : ""));
  }
  const int64_t skips =
      std::min<int64_t>(std::max<int64_t>(layout.skips, 0), static_cast<int64_t>(parts.size()));
  const auto boundary = parts.begin() + static_cast<int64_t>(parts.size()) - skips;
  std::string out = absl::StrCat(layout.is_list ? "list(" : "",
                                 absl::StrJoin(parts.begin(), boundary, ", "),
                                 layout.is_list ? ")" : "");
  if (skips > 0) {
    absl::StrAppend(&out, " + ", skips, " skips (", absl::StrJoin(boundary, parts.end(), ", "),
                    ")");
  }
  return out;
}

}  // namespace fairscale::pipe::internal
