// GroupSums: the part the AdaScale adapters (fsdp_adapter.h, sdp_adapter.h) share: maps each
// tensor of AdaScale's param groups to its group and sums a backward's per-tensor local squared
// norms (a LocalGradSqr report of fsdp or oss) into the per-group vector that
// AdaScale::accumulate_local_grad_sqr takes. Private to //adascale's adapters.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstddef>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace fairscale::adascale {

class GroupSums {
 public:
  // Returns an error for a param group's tensor the report will never list (raised, prefixed by
  // the label, by the constructor and whenever groups were added).
  using Check =
      std::function<absl::Status(size_t group, size_t index, const at::Tensor& tensor)>;

  // Maps `optimizer`'s groups now; `optimizer` must outlive this object. `check` may be empty.
  GroupSums(const torch::optim::Optimizer& optimizer, Check check, std::string label);

  // Per param group, the sum of the entries' sum_sqr over the tensors it holds (tensors no group
  // holds are left out); re-maps first when groups were added to the optimizer.
  template <typename Entry>
  std::vector<double> Sum(const std::vector<Entry>& report) {
    if (optimizer_.param_groups().size() != groups_) Map();
    std::vector<double> per_group(groups_, 0.0);
    for (const Entry& e : report) {
      auto it = group_of_.find(e.param.unsafeGetTensorImpl());
      if (it != group_of_.end()) per_group[it->second] += e.sum_sqr;
    }
    return per_group;
  }

 private:
  void Map();

  const torch::optim::Optimizer& optimizer_;
  Check check_;
  std::string label_;
  std::map<const c10::TensorImpl*, size_t> group_of_;
  size_t groups_ = 0;
};

}  // namespace fairscale::adascale
