#include "moe/gate.h"

#include <ATen/ops/one_hot.h>
#include <ATen/ops/rand.h>

#include <cmath>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "base/torch_error.h"

namespace fairscale::moe {
namespace {

void Fail(absl::string_view context, const std::string& message) {
  base::ThrowIfError(absl::InvalidArgumentError(message), context);
}

void CheckOptions(absl::string_view context, int64_t model_dim, int64_t num_experts,
                  int64_t min_experts, double capacity_factor) {
  if (model_dim < 1) Fail(context, absl::StrCat("model_dim ", model_dim, " must be positive"));
  if (num_experts < min_experts) {
    Fail(context, absl::StrCat("num_experts ", num_experts, " must be at least ", min_experts));
  }
  if (!(capacity_factor > 0)) {
    Fail(context, absl::StrCat("capacity_factor ", capacity_factor, " must be positive"));
  }
}

void CheckInput(absl::string_view context, const at::Tensor& x, int64_t model_dim) {
  if (!x.defined() || x.dim() != 2 || x.size(1) != model_dim || x.size(0) == 0) {
    const std::string shape =
        x.defined() ? absl::StrCat("[", absl::StrJoin(x.sizes(), ", "), "]") : "undefined";
    Fail(context, absl::StrCat("x ", shape, ": expected [tokens >= 1, model_dim ", model_dim,
                               "]"));
  }
}

// FairScale's softmax(dtype=torch.float): f32 for the 16-bit types, else x's own dtype.
at::ScalarType ComputeType(const at::Tensor& x) {
  const at::ScalarType t = x.scalar_type();
  return t == at::kHalf || t == at::kBFloat16 ? at::kFloat : t;
}

double Eps(at::ScalarType t) {
  return t == at::kDouble ? std::numeric_limits<double>::epsilon()
                          : std::numeric_limits<float>::epsilon();
}

int64_t Capacity(double slots, double capacity_factor) {
  const auto c = static_cast<int64_t>(std::ceil(slots * capacity_factor));
  return c < 1 ? 1 : c;
}

// combine[s, e, c] = g[s] * mask[s, e] * (location[s] == c).
at::Tensor Combine(const at::Tensor& g, const at::Tensor& mask, const at::Tensor& location,
                   int64_t capacity) {
  const at::Tensor slot = at::one_hot(location, capacity).to(g.scalar_type());
  return g.unsqueeze(1).unsqueeze(2) * mask.to(g.scalar_type()).unsqueeze(2) * slot.unsqueeze(1);
}

}  // namespace

Top2GateImpl::Top2GateImpl(Top2GateOptions options_) : options(std::move(options_)) {
  CheckOptions("moe::Top2Gate", options.model_dim(), options.num_experts(), 2,
               options.capacity_factor());
  reset();
}

void Top2GateImpl::reset() {
  wg = register_module(
      "wg", torch::nn::Linear(
                torch::nn::LinearOptions(options.model_dim(), options.num_experts()).bias(false)));
}

GateOutput Top2GateImpl::forward(const at::Tensor& x) {
  CheckInput("moe::Top2Gate::forward", x, options.model_dim());
  const int64_t s = x.size(0);
  const int64_t e = options.num_experts();
  const at::ScalarType ct = ComputeType(x);
  const at::Tensor logits = wg->forward(x).to(ct);
  const at::Tensor gates = logits.softmax(1);
  const int64_t capacity =
      Capacity(2.0 * static_cast<double>(s) / static_cast<double>(e), options.capacity_factor());

  const at::Tensor index1 = gates.argmax(1);
  at::Tensor mask1 = at::one_hot(index1, e);  // int64 [S, E]
  at::Tensor logits2 = logits.detach();
  if (is_training() && options.second_expert_noise()) {
    const double eps = std::numeric_limits<float>::epsilon();
    c10::optional<at::Generator> gen;  // LibTorch 1.13's optional is not std::optional
    if (options.generator().has_value()) gen = *options.generator();
    const at::Tensor u = at::rand({s, e}, gen, logits2.options()).clamp(eps, 1.0 - eps);
    logits2 = logits2 - (-u.log()).log();
  }
  const at::Tensor index2 =
      logits2.masked_fill(mask1.to(at::kBool), -std::numeric_limits<double>::infinity())
          .argmax(1);
  at::Tensor mask2 = at::one_hot(index2, e);

  const at::Tensor location1 = mask1.cumsum(0) - 1;
  // Second choices queue behind every first choice of the expert (counted before dropping).
  const at::Tensor location2 = mask2.cumsum(0) - 1 + mask1.sum(0, /*keepdim=*/true);

  const at::Tensor me = gates.mean(0);
  const at::Tensor ce = mask1.to(ct).mean(0);
  const at::Tensor l_aux = (me * ce).mean() * static_cast<double>(e * e);

  mask1 = mask1 * location1.lt(capacity);
  mask2 = mask2 * location2.lt(capacity);
  const at::Tensor location1_s = (location1 * mask1).sum(1);
  const at::Tensor location2_s = (location2 * mask2).sum(1);

  at::Tensor g1 = (gates * mask1).sum(1);
  at::Tensor g2 = (gates * mask2).sum(1);
  const at::Tensor denom = (g1 + g2).clamp_min(Eps(ct));
  g1 = g1 / denom;
  g2 = g2 / denom;
  const at::Tensor combine =
      Combine(g1, mask1, location1_s, capacity) + Combine(g2, mask2, location2_s, capacity);
  return GateOutput{l_aux.to(x.scalar_type()), combine.to(x.scalar_type()), combine.ne(0)};
}

Top1GateImpl::Top1GateImpl(Top1GateOptions options_) : options(std::move(options_)) {
  CheckOptions("moe::Top1Gate", options.model_dim(), options.num_experts(), 1,
               options.capacity_factor());
  reset();
}

void Top1GateImpl::reset() {
  wg = register_module(
      "wg", torch::nn::Linear(
                torch::nn::LinearOptions(options.model_dim(), options.num_experts()).bias(false)));
}

GateOutput Top1GateImpl::forward(const at::Tensor& x) {
  CheckInput("moe::Top1Gate::forward", x, options.model_dim());
  const int64_t s = x.size(0);
  const int64_t e = options.num_experts();
  const at::ScalarType ct = ComputeType(x);
  const at::Tensor gates = wg->forward(x).to(ct).softmax(1);
  const int64_t capacity =
      Capacity(static_cast<double>(s) / static_cast<double>(e), options.capacity_factor());

  at::Tensor mask1 = at::one_hot(gates.argmax(1), e);
  const at::Tensor location1 = mask1.cumsum(0) - 1;

  const at::Tensor me = gates.mean(0);
  const at::Tensor ce = mask1.to(ct).mean(0);
  const at::Tensor l_aux = (me * ce).mean() * static_cast<double>(e * e);

  mask1 = mask1 * location1.lt(capacity);
  const at::Tensor location1_s = (location1 * mask1).sum(1);
  const at::Tensor g1 = (gates * mask1).sum(1);
  const at::Tensor combine = Combine(g1, mask1, location1_s, capacity);
  return GateOutput{l_aux.to(x.scalar_type()), combine.to(x.scalar_type()), combine.ne(0)};
}

}  // namespace fairscale::moe
