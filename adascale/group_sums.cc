#include "adascale/group_sums.h"

#include <utility>

#include "base/torch_error.h"

namespace fairscale::adascale {

GroupSums::GroupSums(const torch::optim::Optimizer& optimizer, Check check, std::string label)
    : optimizer_(optimizer), check_(std::move(check)), label_(std::move(label)) {
  Map();
}

void GroupSums::Map() {
  std::map<const c10::TensorImpl*, size_t> group_of;
  const auto& param_groups = optimizer_.param_groups();
  for (size_t g = 0; g < param_groups.size(); ++g) {
    const auto& params = param_groups[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      if (check_) base::ThrowIfError(check_(g, i, params[i]), label_);
      group_of.emplace(params[i].unsafeGetTensorImpl(), g);
    }
  }
  group_of_ = std::move(group_of);
  groups_ = param_groups.size();
}

}  // namespace fairscale::adascale
