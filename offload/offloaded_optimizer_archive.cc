// OffloadedAdam::save / load in torch::optim::Adam's (AdamW's) archive layout. Kept apart from
// the streaming code: it needs the heavier serialization headers, and it is the one path that
// materialises the whole state in memory.
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/optim/serialize.h>

#include "absl/strings/str_cat.h"
#include "base/torch_error.h"
#include "offload/offloaded_optimizer.h"
#include "offload/tier.h"

namespace fairscale::offload {
namespace {

template <typename State>
std::unique_ptr<State> MakeState(int64_t step, at::Tensor exp_avg, at::Tensor exp_avg_sq) {
  auto st = std::make_unique<State>();
  st->step(step);
  st->exp_avg(std::move(exp_avg));
  st->exp_avg_sq(std::move(exp_avg_sq));
  return st;
}

}  // namespace

void OffloadedAdam::save(torch::serialize::OutputArchive& archive) const {
  // The base serializer reads state(): fill it for the call, keyed like torch::optim::Adam.
  auto& state = const_cast<OffloadedAdam*>(this)->state_;
  state.clear();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (steps_[i] == 0) continue;  // torch creates state at a parameter's first step
    const Param& q = params_[i];
    at::Tensor m = at::zeros(q.tensor.sizes(), at::kFloat);
    at::Tensor v = at::zeros(q.tensor.sizes(), at::kFloat);
    absl::Status s = tier_->ReadTensor(q.exp_avg, m.data_ptr());
    if (s.ok()) s = tier_->ReadTensor(q.exp_avg_sq, v.data_ptr());
    if (!s.ok()) state.clear();
    base::ThrowIfError(s, "OffloadedAdam::save");
    const std::string key = c10::guts::to_string(q.tensor.unsafeGetTensorImpl());
    if (decoupled_) {
      state[key] = MakeState<torch::optim::AdamWParamState>(steps_[i], m, v);
    } else {
      state[key] = MakeState<torch::optim::AdamParamState>(steps_[i], m, v);
    }
  }
  try {
    if (decoupled_) {
      torch::optim::serialize<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(archive,
                                                                                        *this);
    } else {
      torch::optim::serialize<torch::optim::AdamParamState, torch::optim::AdamOptions>(archive,
                                                                                      *this);
    }
  } catch (...) {
    state.clear();
    throw;
  }
  state.clear();
}

void OffloadedAdam::load(torch::serialize::InputArchive& archive) {
  state_.clear();
  if (decoupled_) {
    torch::optim::serialize<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(archive,
                                                                                      *this);
  } else {
    torch::optim::serialize<torch::optim::AdamParamState, torch::optim::AdamOptions>(archive,
                                                                                    *this);
  }
  absl::Status s;
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size() && s.ok(); ++i) {
    const Param& q = params_[i];
    auto it = state_.find(c10::guts::to_string(q.tensor.unsafeGetTensorImpl()));
    at::Tensor m, v;
    int64_t step = 0;
    if (it != state_.end()) {
      if (decoupled_) {
        auto& st = static_cast<torch::optim::AdamWParamState&>(*it->second);
        step = st.step();
        m = st.exp_avg();
        v = st.exp_avg_sq();
      } else {
        auto& st = static_cast<torch::optim::AdamParamState&>(*it->second);
        step = st.step();
        m = st.exp_avg();
        v = st.exp_avg_sq();
      }
      TORCH_CHECK(m.sizes() == q.tensor.sizes() && v.sizes() == q.tensor.sizes(),
                  "OffloadedAdam::load: the archive's state of parameter ", i,
                  " has another shape than the parameter");
    } else {
      m = at::zeros(q.tensor.sizes(), at::kFloat);
      v = m;
    }
    m = m.to(at::kFloat).contiguous();
    v = v.to(at::kFloat).contiguous();
    steps_[i] = step;
    s = tier_->WriteTensor(q.exp_avg, m.data_ptr());
    if (s.ok()) s = tier_->WriteTensor(q.exp_avg_sq, v.data_ptr());
    if (s.ok() && q.master >= 0) {  // the archive has no masters: start from the parameter
      at::Tensor master = q.tensor.detach().to(at::kFloat).contiguous();
      s = tier_->WriteTensor(static_cast<size_t>(q.master), master.data_ptr());
    }
  }
  state_.clear();
  if (s.ok()) s = StepGroups({});  // records steps + hyper-parameters, commits
  base::ThrowIfError(s, "OffloadedAdam::load");
}

}  // namespace fairscale::offload
