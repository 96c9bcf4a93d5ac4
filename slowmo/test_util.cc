#include "slowmo/test_util.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace fairscale::slowmo::testing {

Worker::Worker(Opt kind) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  w = at::randn({4, 3}, gen, at::kFloat).set_requires_grad(true);
  b = at::randn({3}, gen, at::kDouble).set_requires_grad(true);
  if (kind == Opt::kSgd) {
    opt = std::make_unique<torch::optim::SGD>(std::vector<at::Tensor>{w, b},
                                              torch::optim::SGDOptions(kLr).momentum(0.9));
  } else {
    opt = std::make_unique<torch::optim::Adam>(std::vector<at::Tensor>{w, b},
                                               torch::optim::AdamOptions(kLr));
  }
}

void Backward(const Worker& m, int worker, int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * worker + step + 1);
  at::Tensor x = at::randn({8, 4}, gen, at::kFloat);
  at::Tensor y = at::randn({8, 3}, gen, at::kFloat);
  for (const at::Tensor& p : m.params()) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
  at::Tensor out = at::matmul(x, m.w) + m.b.to(at::kFloat);
  (out - y).pow(2).mean().backward();
}

std::string Config::Name() const {
  return absl::StrCat("world ", world, (opt == Opt::kSgd ? " sgd" : " adam"), " H ", h, " alpha ",
                      alpha, " beta ", beta, " steps ", steps);
}

std::vector<std::vector<at::Tensor>> Simulate(const Config& c) {
  std::vector<std::unique_ptr<Worker>> workers;
  for (int r = 0; r < c.world; ++r) workers.push_back(std::make_unique<Worker>(c.opt));
  std::vector<at::Tensor> prev, u;
  for (const at::Tensor& p : workers[0]->params()) {
    prev.push_back(p.detach().to(at::kDouble, false, true));
    u.push_back(at::zeros_like(prev.back()));
  }
  for (int step = 0; step < c.steps; ++step) {
    for (int r = 0; r < c.world; ++r) {
      Backward(*workers[r], r, step);
      workers[r]->opt->step();
    }
    if ((step + 1) % c.h != 0) continue;
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < prev.size(); ++i) {
      at::Tensor avg = at::zeros_like(prev[i]);
      for (int r = 0; r < c.world; ++r) avg += workers[r]->params()[i].detach().to(at::kDouble);
      avg /= c.world;
      u[i] = c.beta * u[i] + (prev[i] - avg) / kLr;
      prev[i] = prev[i] - c.alpha * kLr * u[i];
      for (int r = 0; r < c.world; ++r) workers[r]->params()[i].detach().copy_(prev[i]);
    }
  }
  std::vector<std::vector<at::Tensor>> out;
  for (int r = 0; r < c.world; ++r) {
    out.push_back({workers[r]->w.detach().to(at::kDouble), workers[r]->b.detach().clone()});
  }
  return out;
}

namespace {
absl::Mutex max_error_mu;
double max_error ABSL_GUARDED_BY(max_error_mu) = 0;
}  // namespace

double TakeMaxError() {
  absl::MutexLock lock(&max_error_mu);
  const double e = max_error;
  max_error = 0;
  return e;
}

absl::Status Close(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want,
                   double tol, const std::string& what) {
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = (got[i].to(at::kDouble) - want[i]).abs().max().item<double>();
    {
      absl::MutexLock lock(&max_error_mu);
      if (err > max_error) max_error = err;
    }
    if (!(err <= tol)) {
      return absl::InternalError(absl::StrCat(what, ": parameter ", i, " max error ", err));
    }
  }
  return absl::OkStatus();
}

}  // namespace fairscale::slowmo::testing
