// Fuzz target (libFuzzer's LLVMFuzzerTestOneInput) of the bytes //pipe receives from other ranks
// and trusts nothing in: a stage boundary's 24-byte activation header (CheckHeader) and layout
// message (DecodeLayout), both in pipe/internal/boundary_layout.h, and the skip declarations
// every rank all-gathers at Pipe::Create (DecodeDeclarations, pipe/internal/skip_declarations.h).
// Input layout: fuzz_input.h. For every input:
// * no crash, no sanitizer report, no exception out of the decoders;
// * a header is accepted iff its magic is right and its layout length lies in
//   [0, kMaxLayoutWords] (else kDataLoss "malformed activation header"), and then is of the
//   expected message (else kInternal);
// * a layout either fails with kDataLoss "malformed activation layout" or decodes to one that
//   passes CheckLayout (wire dtypes, <= kMaxDims dimensions, sizes >= 0, every tensor's bytes fit
//   int64, skips in range) and re-encodes (EncodeLayout) to exactly the words received;
// * declarations either fail with kDataLoss "malformed skip declarations" or decode to layers
//   with stage and position >= 0 and non-empty skip names, which re-encode (EncodeDeclarations)
//   to exactly the bytes received; in model order, VerifyDeclarations accepts them or says
//   kInvalidArgument "one or more pairs of stash and pop do not match", and accepted ones route
//   (RoutesOf) every stashed id once, forward, with InTransitAfter in id order.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <set>
#include <utility>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "base/fuzz_check.h"
#include "pipe/fuzz/fuzz_input.h"
#include "pipe/internal/boundary_layout.h"
#include "pipe/internal/skip_declarations.h"

namespace {

namespace fz = fairscale::pipe::fuzz;
namespace pi = fairscale::pipe::internal;

void CheckError(const absl::Status& s, absl::StatusCode code, const char* prefix) {
  if (s.code() != code || !absl::StartsWith(s.message(), prefix)) {
    std::fprintf(stderr, "unexpected status (should be %s starting '%s'): %s\n",
                 absl::StatusCodeToString(code).c_str(), prefix, s.ToString().c_str());
    FS_FUZZ_CHECK(false);
  }
}

int64_t Word(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return static_cast<int64_t>(v);
}

void FuzzHeader(const std::array<int64_t, pi::kHeaderWords>& h, bool other_id) {
  const int64_t id = other_id ? (h[1] ^ 1) : h[1];
  absl::StatusOr<int64_t> len = pi::CheckHeader(h, id);
  const bool intact = h[0] == pi::kHeaderMagic && h[2] >= 0 && h[2] <= pi::kMaxLayoutWords;
  if (!intact) return CheckError(len.status(), absl::StatusCode::kDataLoss,
                                 "malformed activation header");
  if (other_id) return CheckError(len.status(), absl::StatusCode::kInternal, "expected the header");
  FS_FUZZ_CHECK(len.ok() && *len == h[2]);
  FS_FUZZ_CHECK(pi::EncodeHeader(h[1], *len) == h);
}

void FuzzLayout(const std::vector<int64_t>& words) {
  absl::StatusOr<pi::BoundaryLayout> layout = pi::DecodeLayout(words);
  if (!layout.ok()) {
    return CheckError(layout.status(), absl::StatusCode::kDataLoss, "malformed activation layout");
  }
  FS_FUZZ_CHECK(pi::CheckLayout(*layout).ok());
  // The bounds a receiver relies on before allocating (CheckLayout states them; checked here
  // again, independently).
  FS_FUZZ_CHECK(static_cast<int64_t>(words.size()) <= pi::kMaxLayoutWords);
  FS_FUZZ_CHECK(layout->skips >= 0 &&
                layout->skips <= static_cast<int64_t>(layout->tensors.size()));
  FS_FUZZ_CHECK(layout->is_list ||
                static_cast<int64_t>(layout->tensors.size()) == 1 + layout->skips);
  for (const pi::TensorLayout& t : layout->tensors) {
    FS_FUZZ_CHECK(pi::IsWireDtype(t.dtype));
    FS_FUZZ_CHECK(static_cast<int64_t>(t.sizes.size()) <= pi::kMaxDims);
    int64_t bytes = static_cast<int64_t>(c10::elementSize(t.dtype));
    for (int64_t d : t.sizes) {
      FS_FUZZ_CHECK(d >= 0);
      FS_FUZZ_CHECK(!__builtin_mul_overflow(bytes, d, &bytes));
    }
  }
  FS_FUZZ_CHECK(pi::EncodeLayout(*layout) == words);
  FS_FUZZ_CHECK(!pi::DescribeLayout(*layout).empty() || layout->tensors.empty());
}

void FuzzDeclarations(const std::string& bytes) {
  absl::StatusOr<std::vector<pi::LayerSkips>> layers = pi::DecodeDeclarations(bytes);
  if (!layers.ok()) {
    return CheckError(layers.status(), absl::StatusCode::kDataLoss, "malformed skip declarations");
  }
  FS_FUZZ_CHECK(static_cast<int64_t>(bytes.size()) <= pi::kMaxDeclarationBytes);
  size_t ids = 0;
  for (const pi::LayerSkips& l : *layers) {
    FS_FUZZ_CHECK(l.virtual_stage >= 0 && l.position >= 0);
    for (const auto* list : {&l.stash, &l.pop}) {
      for (const fairscale::pipe::SkipId& id : *list) {
        FS_FUZZ_CHECK(!id.name.empty());
        ++ids;
      }
    }
  }
  // Every layer took at least 14 bytes ("1:0" x 4, "0:") and every id 5 ("0:", "1:x"): nothing
  // was made out of a count alone.
  FS_FUZZ_CHECK(layers->size() * 14 + ids * 5 <= bytes.size());
  FS_FUZZ_CHECK(pi::EncodeDeclarations(*layers) == bytes);

  // What Pipe::Create does with every rank's declarations: sort into model order, verify, route.
  std::vector<pi::LayerSkips> all = *layers;
  std::sort(all.begin(), all.end(), [](const pi::LayerSkips& a, const pi::LayerSkips& b) {
    return std::make_pair(a.virtual_stage, a.position) < std::make_pair(b.virtual_stage, b.position);
  });
  const absl::Status verified = pi::VerifyDeclarations(all);
  if (!verified.ok()) {
    return CheckError(verified, absl::StatusCode::kInvalidArgument,
                      "one or more pairs of stash and pop do not match: * ");
  }
  const std::vector<pi::SkipRoute> routes = pi::RoutesOf(all);
  // Every stashed id is popped exactly once, later: one route per stashed id.
  std::set<fairscale::pipe::SkipId> stashed;
  for (const pi::LayerSkips& l : all) stashed.insert(l.stash.begin(), l.stash.end());
  FS_FUZZ_CHECK(routes.size() == stashed.size());
  for (size_t i = 0; i < routes.size(); ++i) {
    FS_FUZZ_CHECK(routes[i].from <= routes[i].to);
    if (i > 0) FS_FUZZ_CHECK(routes[i - 1].id < routes[i].id);
    // What crosses the boundaries around its ends, in id order.
    for (int64_t c : {routes[i].from - 1, routes[i].from, routes[i].to - 1, routes[i].to}) {
      const std::vector<fairscale::pipe::SkipId> transit = pi::InTransitAfter(routes, c);
      FS_FUZZ_CHECK(std::is_sorted(transit.begin(), transit.end()));
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t control = data[0];
  ++data;
  --size;
  try {
    if (control & fz::kModeDeclarations) {
      FuzzDeclarations(std::string(reinterpret_cast<const char*>(data), size));
      return 0;
    }
    if (size < 8 * pi::kHeaderWords) return 0;
    std::array<int64_t, pi::kHeaderWords> h;
    for (int64_t i = 0; i < pi::kHeaderWords; ++i) h[i] = Word(data + 8 * i);
    FuzzHeader(h, (control & fz::kOtherId) != 0);
    // The layout words, decoded whatever the header said (so that mutations of the header do
    // not hide the layout from the fuzzer).
    std::vector<int64_t> words;
    for (size_t off = 8 * pi::kHeaderWords; off + 8 <= size; off += 8) words.push_back(Word(data + off));
    FuzzLayout(words);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "exception out of a decoder: %s\n", e.what());
    FS_FUZZ_CHECK(false);
  }
  return 0;
}
