#include "adascale/sdp_adapter.h"

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "adascale/group_sums.h"
#include "base/torch_error.h"

namespace fairscale::adascale {

struct AdaScaleSdp::State {
  AdaScale* ada = nullptr;
  std::optional<GroupSums> sums;

  void OnBackward(const std::vector<oss::LocalGradSqr>& report) {
    if (ada == nullptr) return;  // the adapter is gone
    ada->accumulate_local_grad_sqr(sums->Sum(report));
  }
};

AdaScaleSdp::AdaScaleSdp(oss::ShardedDataParallel sdp, AdaScale& ada)
    : sdp_(std::move(sdp)), state_(std::make_shared<State>()) {
  oss::OSS& optimizer = sdp_->optimizer();
  const auto& model_comm = optimizer.communicator();
  const std::string label = absl::StrCat("adascale::AdaScaleSdp rank ", model_comm->rank(), "/",
                                         model_comm->size());
  auto invalid = [&](const std::string& message) {
    base::ThrowIfError(absl::InvalidArgumentError(message), label);
  };
  const auto& comm = ada.communicator();
  if (comm->size() != model_comm->size() || comm->rank() != model_comm->rank()) {
    invalid(absl::StrCat("AdaScale's communicator is rank ", comm->rank(), "/", comm->size(),
                         ", the model's ", model_comm->rank(), "/", model_comm->size(),
                         "; both must span the same ranks"));
  }
  if (&ada.optimizer() != static_cast<torch::optim::Optimizer*>(&optimizer)) {
    invalid("AdaScale does not wrap the model's oss::OSS optimizer (sdp->optimizer()): construct "
            "it as AdaScale(*oss, comm, ...) with the OSS the ShardedDataParallel was built with");
  }
  if (sdp_->options().deterministic()) {
    invalid("the model runs in deterministic mode, which divides the gradient sum by "
            "micro_batches instead of averaging it over the ranks; not supported");
  }
  if (sdp_->has_local_grad_hook()) {
    invalid("the model has a local gradient hook already (an AdaScaleSdp attached before?); "
            "one adapter per model");
  }
  if (model_comm->size() > 1 && !ada.sharded_gradients()) {
    invalid("after a ShardedDataParallel reduction each rank holds only the gradients it owns: "
            "construct AdaScale with AdaScaleOptions().sharded_gradients(true) (options_for)");
  }
  if (ada.gradient_replicas() != 1) {
    invalid(absl::StrCat("each gradient has one owner, AdaScale's gradient_replicas is ",
                         ada.gradient_replicas(), ": use gradient_replicas(1) (options_for)"));
  }
  // Every tensor of the OSS's groups is a parameter of the model's optimizer: a frozen one has
  // no gradient and is reported with 0 or not at all, which is its contribution.
  state_->sums.emplace(ada.optimizer(), GroupSums::Check(), label);
  state_->ada = &ada;
  std::shared_ptr<State> state = state_;
  sdp_->register_local_grad_hook(
      [state](const std::vector<oss::LocalGradSqr>& report) { state->OnBackward(report); });
}

AdaScaleOptions AdaScaleSdp::options_for(const oss::ShardedDataParallel&,
                                         AdaScaleOptions options) {
  return options.sharded_gradients(true).gradient_replicas(1);
}

AdaScaleSdp::~AdaScaleSdp() {
  state_->ada = nullptr;
  try {
    if (sdp_->has_local_grad_hook()) sdp_->remove_local_grad_hook();
  } catch (const c10::Error&) {
    // Destroyed inside backward: the hook stays (and does nothing) until the model goes.
  }
}

}  // namespace fairscale::adascale
