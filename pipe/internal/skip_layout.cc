#include "pipe/internal/skip_layout.h"

namespace fairscale::pipe::internal {

std::vector<LayerSkips> DeclarationsOf(const torch::nn::Sequential& layers,
                                       int64_t virtual_stage) {
  std::vector<LayerSkips> out;
  const auto children = layers->named_children();
  for (size_t l = 0; l < children.size(); ++l) {
    const auto* skippable = dynamic_cast<const Skippable*>(children[l].value().get());
    if (skippable == nullptr) continue;
    out.push_back({virtual_stage, static_cast<int64_t>(l), children[l].key(),
                   skippable->stashable(), skippable->poppable()});
  }
  return out;
}

}  // namespace fairscale::pipe::internal
