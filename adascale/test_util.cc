#include "adascale/test_util.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "comm/testing/rank_runner.h"

namespace fairscale::adascale::testing {

const char* KindName(Kind kind) { return kind == Kind::kSgd ? "SGD" : "Adam"; }

at::Tensor Randn(std::vector<int64_t> shape, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, torch::kFloat32);
}

at::Tensor InitialW() { return Randn({3, 4}, 7); }
at::Tensor InitialB() { return Randn({3}, 8); }

Batch Data(int step, int worker, int micro) {
  const uint64_t seed = 1000 + 100 * step + 10 * worker + micro;
  return {Randn({5, 4}, seed), Randn({5, 3}, seed + 50000) + 0.5};
}

at::Tensor Loss(const at::Tensor& w, const at::Tensor& b, const Batch& batch) {
  return torch::mse_loss(torch::matmul(batch.x, w.t()) + b, batch.y);
}

Model::Model() {
  w = InitialW().requires_grad_();
  b = InitialB().requires_grad_();
}

PlainLinearImpl::PlainLinearImpl() {
  w = register_parameter("w", InitialW());
  b = register_parameter("b", InitialB());
}

at::Tensor PlainLinearImpl::forward(at::Tensor x) { return torch::matmul(x, w.t()) + b; }

std::vector<torch::optim::OptimizerParamGroup> MakeGroups(
    Kind kind, const std::vector<std::vector<at::Tensor>>& groups) {
  std::vector<torch::optim::OptimizerParamGroup> out;
  for (size_t g = 0; g < groups.size(); ++g) {
    // A group's options replace the defaults entirely: momentum is set on each.
    if (kind == Kind::kSgd) {
      out.emplace_back(groups[g], std::make_unique<torch::optim::SGDOptions>(
                                      torch::optim::SGDOptions(g == 0 ? 0.05 : 0.1).momentum(0.9)));
    } else {
      out.emplace_back(groups[g], std::make_unique<torch::optim::AdamOptions>(g == 0 ? 0.01 : 0.02));
    }
  }
  return out;
}

std::unique_ptr<torch::optim::Optimizer> MakeInner(
    Kind kind, std::vector<torch::optim::OptimizerParamGroup> groups) {
  if (kind == Kind::kSgd) {
    return std::make_unique<torch::optim::SGD>(std::move(groups),
                                               torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  return std::make_unique<torch::optim::Adam>(std::move(groups), torch::optim::AdamOptions(0.01));
}

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(Kind kind, Model& m, bool one_group) {
  return MakeInner(kind, one_group ? MakeGroups(kind, {{m.w, m.b}})
                                   : MakeGroups(kind, {{m.w}, {m.b}}));
}

std::vector<StepRecord> Simulate(Kind kind, int workers, int accum, double smoothing, int steps,
                                 bool debias, bool one_group) {
  Model m;
  auto opt = MakeOptimizer(kind, m, one_group);
  const int ng = one_group ? 1 : 2;
  const double n = workers * accum;
  const double scale = n;
  std::vector<double> sqr_b(ng, 0), var_b(ng, 0), unbias(ng, 0), sqr_avg(ng, 1), var_avg(ng, 0),
      sqr_tot(ng, 0), var_tot(ng, 0);
  double progress = 0;
  std::vector<StepRecord> out;
  for (int step = 0; step < steps; ++step) {
    double local[2] = {0, 0};  // per tensor (W, b)
    at::Tensor sum_w = torch::zeros_like(m.w), sum_b = torch::zeros_like(m.b);
    for (int worker = 0; worker < workers; ++worker) {
      at::Tensor acc_w, acc_b;
      for (int micro = 0; micro < accum; ++micro) {
        auto grads = torch::autograd::grad({m.loss(step, worker, micro)}, {m.w, m.b});
        local[0] += grads[0].to(torch::kFloat64).pow(2).sum().item<double>();
        local[1] += grads[1].to(torch::kFloat64).pow(2).sum().item<double>();
        acc_w = micro == 0 ? grads[0] : acc_w + grads[0];
        acc_b = micro == 0 ? grads[1] : acc_b + grads[1];
      }
      sum_w += acc_w;
      sum_b += acc_b;
    }
    at::Tensor avg[2] = {sum_w / workers, sum_b / workers};
    double tensor_total[2];
    for (int t = 0; t < 2; ++t) {
      tensor_total[t] =
          avg[t].to(torch::kFloat64).pow(2).sum().item<double>() / (double(accum) * accum);
    }
    std::vector<double> gains(ng);
    double var_sum = 0, sqr_sum = 0;
    for (int g = 0; g < ng; ++g) {
      const double group_local = one_group ? local[0] + local[1] : local[g];
      const double total = one_group ? tensor_total[0] + tensor_total[1] : tensor_total[g];
      double var = group_local * (scale / n) / (n - 1) - total * scale / (n - 1);
      double sqr = total - var / scale;
      var = std::max(var, 1e-6);
      sqr = std::max(sqr, 0.0);
      if (debias) {
        sqr_b[g] = smoothing * sqr_b[g] + (1 - smoothing) * sqr;
        var_b[g] = smoothing * var_b[g] + (1 - smoothing) * var;
        unbias[g] = smoothing * unbias[g] + (1 - smoothing);
        sqr_avg[g] = sqr_b[g] / unbias[g];
        var_avg[g] = var_b[g] / unbias[g];
      } else if (step + 1 < 1 / (1 - smoothing)) {  // appendix B.3: the mean of the first steps
        sqr_tot[g] += sqr;
        var_tot[g] += var;
        sqr_avg[g] = sqr_tot[g] / (step + 1);
        var_avg[g] = var_tot[g] / (step + 1);
      } else {
        sqr_avg[g] = smoothing * sqr_avg[g] + (1 - smoothing) * sqr;
        var_avg[g] = smoothing * var_avg[g] + (1 - smoothing) * var;
      }
      const double s = sqr_avg[g], v = var_avg[g];
      gains[g] = (v + s) / (v / scale + s);
      var_sum += v;
      sqr_sum += s;
    }
    const double gain = (var_sum + sqr_sum) / (var_sum / scale + sqr_sum);
    m.w.mutable_grad() = avg[0];
    m.b.mutable_grad() = avg[1];
    std::vector<double> lrs(ng);
    for (int g = 0; g < ng; ++g) {
      auto& o = opt->param_groups()[g].options();
      lrs[g] = o.get_lr();
      o.set_lr(lrs[g] * gains[g]);
    }
    opt->step();
    for (int g = 0; g < ng; ++g) opt->param_groups()[g].options().set_lr(lrs[g]);
    progress += gain;
    out.push_back({m.w.detach().clone(), m.b.detach().clone(), gains, gain, progress});
  }
  return out;
}

absl::Status CompareStep(const std::string& what, const at::Tensor& w, const at::Tensor& b,
                         const AdaScale& ada, const StepRecord& want, double tol,
                         double* max_err) {
  const double ew = (w.detach() - want.w).abs().max().item<double>();
  const double eb = (b.detach() - want.b).abs().max().item<double>();
  double eg = std::abs(ada.gain() - want.gain);
  for (size_t g = 0; g < want.gains.size(); ++g) {
    eg = std::max(eg, std::abs(ada.gain(g) - want.gains[g]));
  }
  const double ep = std::abs(ada.progress() - want.progress);
  *max_err = std::max({*max_err, ew, eb, eg, ep});
  return comm::testing::Check(
      ew <= tol && eb <= tol && eg <= tol && ep <= tol,
      absl::StrCat(what, ": |dW| ", ew, " |db| ", eb, " |dgain| ", eg, " |dprogress| ", ep,
                   " (gain ", ada.gain(), " want ", want.gain, ")"));
}

}  // namespace fairscale::adascale::testing
