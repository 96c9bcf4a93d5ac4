// The skip declarations every rank all-gathers at Pipe::Create (//pipe, internal): one Skippable
// layer's stash and pop names, and their byte encoding. Bytes from other ranks: the decoder
// trusts nothing in them (fuzzed by //pipe/fuzz:wire_fuzz_test), then the checks of
// verify_skippables and the routes of the skips across virtual stages. No torch::nn, so that the
// fuzz target links c10 only; skip_layout.h builds the declarations from a model.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "pipe/skip_id.h"

namespace fairscale::pipe::internal {

// One Skippable layer's declaration.
struct LayerSkips {
  int64_t virtual_stage = 0;  // where it runs (0 without a pipe)
  int64_t position = 0;       // its index among the layers of its virtual stage
  std::string layer;          // its name in its Sequential
  std::vector<SkipId> stash;  // namespaced, in name order
  std::vector<SkipId> pop;
  bool operator==(const LayerSkips& o) const {
    return virtual_stage == o.virtual_stage && position == o.position && layer == o.layer &&
           stash == o.stash && pop == o.pop;
  }
};

// The longest encoding one rank may contribute (1 MiB: some 20,000 declared layers). Pipe
// refuses a longer one of its own (kInvalidArgument) and a longer claim from a peer (kDataLoss)
// before allocating for it.
inline constexpr int64_t kMaxDeclarationBytes = int64_t{1} << 20;

// Encoding: a sequence of fields, each "<decimal length>:<bytes>". Per layer: virtual stage,
// position, name, stash count, (namespace, name) per stash, pop count, (namespace, name) per pop;
// numbers in canonical decimal (no sign, no leading zero). Only canonical encodings decode, so
// whatever decodes re-encodes to the same bytes.
std::string EncodeDeclarations(const std::vector<LayerSkips>& layers);
// kDataLoss on a malformed encoding (or one over kMaxDeclarationBytes): a length or number that
// is not canonical decimal, a field past the end, a negative stage or position, an empty skip
// name, a count the remaining bytes cannot hold.
absl::StatusOr<std::vector<LayerSkips>> DecodeDeclarations(const std::string& encoded);

// verify_skippables over declarations in model order (sorted by virtual stage, then
// position): INVALID_ARGUMENT "one or more pairs of stash and pop do not match: * ...".
absl::Status VerifyDeclarations(const std::vector<LayerSkips>& layers);

// A verified skip: stashed on virtual stage `from`, popped on `to` (>= from).
struct SkipRoute {
  SkipId id;
  int64_t from = 0;
  int64_t to = 0;
};
std::vector<SkipRoute> RoutesOf(const std::vector<LayerSkips>& layers);

// The skips crossing the boundary between virtual stages c and c + 1 (from <= c < to), in id
// order: what stage c appends to its outputs and stage c + 1 finds at the end of its inputs.
std::vector<SkipId> InTransitAfter(const std::vector<SkipRoute>& routes, int64_t c);

}  // namespace fairscale::pipe::internal
