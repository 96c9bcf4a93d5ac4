// The static layout of a model's skip connections across (virtual) stages (//pipe, internal):
// which Skippable layers stash and pop which names (DeclarationsOf, here), the checks of
// verify_skippables, and for each virtual stage the skips it receives from the previous one and
// sends to the next (skip_declarations.h, which has no torch::nn).
//
// Pipe gathers every rank's declarations at construction (each rank holds only its own layers
// under CreateForStage), so every rank verifies and routes the same global layout.
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <vector>

#include "pipe/internal/skip_declarations.h"
#include "pipe/skip.h"

namespace fairscale::pipe::internal {

// The Skippable children of `layers` (which run as virtual stage `virtual_stage`).
std::vector<LayerSkips> DeclarationsOf(const torch::nn::Sequential& layers,
                                       int64_t virtual_stage);

}  // namespace fairscale::pipe::internal
