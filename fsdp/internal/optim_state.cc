#include "fsdp/internal/optim_state.h"

#include <c10/util/string_utils.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <tuple>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace fairscale::fsdp::internal {
namespace {

template <typename S>
void PutAdamState(const S& s, ParamState* out) {
  out->step = s.step();
  if (s.exp_avg().defined()) out->tensors["exp_avg"] = s.exp_avg();
  if (s.exp_avg_sq().defined()) out->tensors["exp_avg_sq"] = s.exp_avg_sq();
  if (s.max_exp_avg_sq().defined()) out->tensors["max_exp_avg_sq"] = s.max_exp_avg_sq();
}

template <typename S>
std::unique_ptr<torch::optim::OptimizerParamState> MakeAdamState(const ParamState& state) {
  auto s = std::make_unique<S>();
  s->step(state.step);
  auto get = [&](const char* name) {
    auto it = state.tensors.find(name);
    return it == state.tensors.end() ? at::Tensor() : it->second;
  };
  s->exp_avg(get("exp_avg"));
  s->exp_avg_sq(get("exp_avg_sq"));
  s->max_exp_avg_sq(get("max_exp_avg_sq"));
  return s;
}

template <typename O>
std::map<std::string, double> AdamOptions(const O& o) {
  return {{"lr", o.lr()},
          {"beta1", std::get<0>(o.betas())},
          {"beta2", std::get<1>(o.betas())},
          {"eps", o.eps()},
          {"weight_decay", o.weight_decay()},
          {"amsgrad", o.amsgrad() ? 1.0 : 0.0}};
}

absl::StatusOr<double> Get(const std::map<std::string, double>& values, const std::string& key) {
  auto it = values.find(key);
  if (it == values.end()) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer option '", key, "' is missing"));
  }
  return it->second;
}

template <typename O>
absl::Status SetAdamOptions(const std::map<std::string, double>& v, O& o) {
  for (const char* key : {"lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad"}) {
    if (!v.count(key)) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer option '", key, "' is missing"));
    }
  }
  o.lr(v.at("lr"));
  o.betas(std::make_tuple(v.at("beta1"), v.at("beta2")));
  o.eps(v.at("eps"));
  o.weight_decay(v.at("weight_decay"));
  o.amsgrad(v.at("amsgrad") != 0);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> OptimizerKind(const torch::optim::Optimizer& optimizer) {
  // AdamW is not derived from Adam in LibTorch, so the order does not matter.
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer)) return std::string("adamw");
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer)) return std::string("adam");
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) return std::string("sgd");
  return absl::InvalidArgumentError(
      "unsupported optimizer: the fsdp state dicts support torch::optim::SGD, Adam and AdamW");
}

std::string StateKey(const at::Tensor& param) {
  return c10::guts::to_string(param.unsafeGetTensorImpl());
}

bool GetParamState(const torch::optim::Optimizer& optimizer, const at::Tensor& param,
                   ParamState* out) {
  auto it = optimizer.state().find(StateKey(param));
  if (it == optimizer.state().end() || !it->second) return false;
  *out = ParamState();
  const torch::optim::OptimizerParamState* s = it->second.get();
  if (auto* a = dynamic_cast<const torch::optim::AdamParamState*>(s)) {
    PutAdamState(*a, out);
  } else if (auto* w = dynamic_cast<const torch::optim::AdamWParamState*>(s)) {
    PutAdamState(*w, out);
  } else if (auto* g = dynamic_cast<const torch::optim::SGDParamState*>(s)) {
    if (g->momentum_buffer().defined()) out->tensors["momentum_buffer"] = g->momentum_buffer();
  } else {
    return false;
  }
  return true;
}

std::unique_ptr<torch::optim::OptimizerParamState> MakeParamState(const std::string& kind,
                                                                  const ParamState& state) {
  if (kind == "adam") return MakeAdamState<torch::optim::AdamParamState>(state);
  if (kind == "adamw") return MakeAdamState<torch::optim::AdamWParamState>(state);
  auto s = std::make_unique<torch::optim::SGDParamState>();
  auto it = state.tensors.find("momentum_buffer");
  if (it != state.tensors.end()) s->momentum_buffer(it->second);
  return s;
}

const std::vector<std::string>& StateNames(const std::string& kind) {
  static const auto* adam = new std::vector<std::string>{"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  static const auto* sgd = new std::vector<std::string>{"momentum_buffer"};
  return kind == "sgd" ? *sgd : *adam;
}

std::map<std::string, double> GetOptions(const std::string& kind,
                                         const torch::optim::OptimizerOptions& options) {
  if (kind == "adam") return AdamOptions(static_cast<const torch::optim::AdamOptions&>(options));
  if (kind == "adamw") return AdamOptions(static_cast<const torch::optim::AdamWOptions&>(options));
  const auto& o = static_cast<const torch::optim::SGDOptions&>(options);
  return {{"lr", o.lr()},
          {"momentum", o.momentum()},
          {"dampening", o.dampening()},
          {"weight_decay", o.weight_decay()},
          {"nesterov", o.nesterov() ? 1.0 : 0.0}};
}

absl::Status SetOptions(const std::string& kind, const std::map<std::string, double>& values,
                        torch::optim::OptimizerOptions& options) {
  if (kind == "adam") {
    return SetAdamOptions(values, static_cast<torch::optim::AdamOptions&>(options));
  }
  if (kind == "adamw") {
    return SetAdamOptions(values, static_cast<torch::optim::AdamWOptions&>(options));
  }
  auto& o = static_cast<torch::optim::SGDOptions&>(options);
  for (const char* key : {"lr", "momentum", "dampening", "weight_decay", "nesterov"}) {
    absl::StatusOr<double> v = Get(values, key);
    if (!v.ok()) return v.status();
  }
  o.lr(values.at("lr"));
  o.momentum(values.at("momentum"));
  o.dampening(values.at("dampening"));
  o.weight_decay(values.at("weight_decay"));
  o.nesterov(values.at("nesterov") != 0);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<torch::optim::Optimizer>> MakePlainOptimizer(
    const std::string& kind, const std::vector<std::vector<at::Tensor>>& groups,
    const std::vector<std::map<std::string, double>>& options) {
  std::unique_ptr<torch::optim::Optimizer> opt;
  std::vector<torch::optim::OptimizerParamGroup> param_groups;
  for (size_t g = 0; g < groups.size(); ++g) {
    std::unique_ptr<torch::optim::OptimizerOptions> o;
    if (kind == "adam") {
      o = std::make_unique<torch::optim::AdamOptions>();
    } else if (kind == "adamw") {
      o = std::make_unique<torch::optim::AdamWOptions>();
    } else if (kind == "sgd") {
      o = std::make_unique<torch::optim::SGDOptions>(0.0);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown optimizer kind '", kind, "'"));
    }
    absl::Status s = SetOptions(kind, options[g], *o);
    if (!s.ok()) return s;
    param_groups.emplace_back(groups[g], std::move(o));
  }
  if (kind == "adam") {
    opt = std::make_unique<torch::optim::Adam>(param_groups);
  } else if (kind == "adamw") {
    opt = std::make_unique<torch::optim::AdamW>(param_groups);
  } else {
    opt = std::make_unique<torch::optim::SGD>(param_groups, torch::optim::SGDOptions(0.0));
  }
  return opt;
}

}  // namespace fairscale::fsdp::internal
