// The static layout of a model's skip connections across (virtual) stages (//pipe, internal):
// which Skippable layers stash and pop which names, the checks of verify_skippables, and for
// each virtual stage the skips it receives from the previous one and sends to the next.
//
// Pipe gathers every rank's declarations at construction (each rank holds only its own layers
// under CreateForStage), so every rank verifies and routes the same global layout.
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "pipe/skip.h"

namespace fairscale::pipe::internal {

// One Skippable layer's declaration.
struct LayerSkips {
  int64_t virtual_stage = 0;  // where it runs (0 without a pipe)
  int64_t position = 0;       // its index among the layers of its virtual stage
  std::string layer;          // its name in its Sequential
  std::vector<SkipId> stash;  // namespaced, in name order
  std::vector<SkipId> pop;
};

// The Skippable children of `layers` (which run as virtual stage `virtual_stage`).
std::vector<LayerSkips> DeclarationsOf(const torch::nn::Sequential& layers,
                                       int64_t virtual_stage);

// A byte string for the all-gather, and back (kDataLoss on a malformed one).
std::string EncodeDeclarations(const std::vector<LayerSkips>& layers);
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
