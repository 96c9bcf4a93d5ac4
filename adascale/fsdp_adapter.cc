#include "adascale/fsdp_adapter.h"

#include <cmath>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "adascale/group_sums.h"
#include "base/torch_error.h"

namespace fairscale::adascale {

struct AdaScaleFsdp::State {
  AdaScale* ada = nullptr;
  std::string label;
  std::set<const c10::TensorImpl*> trainable;  // the tensors the model's optimizer may step
  std::optional<GroupSums> sums;

  // A param group's tensor the model lacks would never be reported.
  absl::Status CheckTrainable(size_t g, size_t i, const at::Tensor& t) const {
    if (trainable.count(t.unsafeGetTensorImpl()) != 0) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        "param group ", g, " tensor ", i, " (shape [", absl::StrJoin(t.sizes(), ", "),
        "]) is not a trainable tensor of the FSDP model (not in its parameters(): an "
        "ignored module's parameter, a frozen one, or another model's), so its local "
        "gradient is never reported; step it with another optimizer"));
  }

  void OnBackward(const std::vector<fsdp::LocalGradSqr>& report) {
    if (ada == nullptr) return;  // the adapter is gone
    ada->accumulate_local_grad_sqr(sums->Sum(report));
  }
};

AdaScaleFsdp::AdaScaleFsdp(fsdp::FullyShardedDataParallel model, AdaScale& ada)
    : model_(std::move(model)), state_(std::make_shared<State>()) {
  State& s = *state_;
  s.ada = &ada;
  s.label = absl::StrCat("adascale::AdaScaleFsdp rank ", model_->rank(), "/",
                         model_->world_size());
  auto invalid = [&](const std::string& message) {
    base::ThrowIfError(absl::InvalidArgumentError(message), s.label);
  };
  const auto& comm = ada.communicator();
  if (comm->size() != model_->world_size() || comm->rank() != model_->rank()) {
    invalid(absl::StrCat("AdaScale's communicator is rank ", comm->rank(), "/", comm->size(),
                         ", the model's ", model_->rank(), "/", model_->world_size(),
                         "; both must span the same ranks"));
  }
  if (model_->has_local_grad_hook()) {
    invalid("the model has a local gradient hook already (an AdaScaleFsdp attached before?); "
            "one adapter per model");
  }
  const int world = model_->world_size();
  const std::vector<fsdp::FullyShardedDataParallelImpl*> units = model_->fsdp_units();
  const bool sharded = units.front()->is_sharded();
  const int replicas = units.front()->replicate_world_size();
  for (fsdp::FullyShardedDataParallelImpl* u : units) {
    const std::string unit = absl::StrCat("unit '", u->prefix(), "'");
    if (u->replicate_world_size() != replicas) {
      invalid(absl::StrCat(unit, " has ", u->replicate_world_size(),
                           " replicas of each shard, the root ", replicas,
                           "; every unit must shard alike"));
    }
    if (u->options().deterministic()) {
      invalid(unit + " runs in deterministic mode, which divides the gradient sum by "
                     "micro_batches instead of averaging it over the ranks; not supported");
    }
    const double pre = u->options().gradient_predivide_factor();
    const double post = u->options().gradient_postdivide_factor();
    const double product = post > 0 ? (pre > 0 ? pre : 1.0) * post : world;
    if (std::abs(product - world) > 1e-9 * world) {
      invalid(absl::StrCat(unit, ": gradient_predivide_factor * gradient_postdivide_factor = ",
                           product, ", not the world size ", world,
                           ": the shards would not hold the mean gradient AdaScale assumes"));
    }
    if (u->is_sharded() != sharded) {
      invalid(unit + (u->is_sharded() ? " is" : " is not") + " sharded but the root " +
              (sharded ? "is" : "is not") + "; every unit must shard alike");
    }
    const auto info = u->flat_param_info();
    const auto shards = u->flat_shards();
    for (size_t f = 0; f < info.size(); ++f) {
      if (!info[f].requires_grad) continue;
      if (info[f].per_parameter) {
        for (const at::Tensor& p : shards[f].params) s.trainable.insert(p.unsafeGetTensorImpl());
      } else {
        s.trainable.insert(shards[f].shard.unsafeGetTensorImpl());
      }
    }
  }
  if (world > 1 && ada.sharded_gradients() != sharded) {
    invalid(sharded ? "the model is sharded (each rank's .grad is its shard of the mean "
                      "gradient): construct AdaScale with AdaScaleOptions().sharded_gradients(true)"
                    : "the model is not sharded (every rank's .grad is the whole mean gradient): "
                      "construct AdaScale with AdaScaleOptions().sharded_gradients(false)");
  }
  if (sharded && ada.gradient_replicas() != replicas) {
    invalid(absl::StrCat(
        "each shard of the model is held by ", replicas, " rank(s) (",
        fsdp::ShardingStrategyName(units.front()->options().sharding_strategy()),
        ", replicate_world_size()), AdaScale's gradient_replicas is ", ada.gradient_replicas(),
        ": construct AdaScale with AdaScaleOptions().gradient_replicas(", replicas,
        ") so that the shards' squares summed over the ranks count each shard once"));
  }
  s.sums.emplace(
      ada.optimizer(),
      [&s](size_t g, size_t i, const at::Tensor& t) { return s.CheckTrainable(g, i, t); },
      s.label);
  std::shared_ptr<State> state = state_;
  model_->register_local_grad_hook(
      [state](const std::vector<fsdp::LocalGradSqr>& report) { state->OnBackward(report); });
}

AdaScaleOptions AdaScaleFsdp::options_for(const fsdp::FullyShardedDataParallel& model,
                                          AdaScaleOptions options) {
  const bool sharded = model->is_sharded();
  return options.sharded_gradients(sharded).gradient_replicas(
      sharded ? model->replicate_world_size() : 1);
}

AdaScaleFsdp::~AdaScaleFsdp() {
  state_->ada = nullptr;
  try {
    if (model_->has_local_grad_hook()) model_->remove_local_grad_hook();
  } catch (const c10::Error&) {
    // Destroyed inside forward/backward: the hook stays (and does nothing) until the model goes.
  }
}

}  // namespace fairscale::adascale
