#include "pipe/balance.h"

#include <ATen/ops/ones_like.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/torch_error.h"

namespace fairscale::pipe {
namespace {

std::vector<at::Tensor> TensorsOf(torch::nn::AnyValue& v) {
  if (const at::Tensor* t = v.try_get<at::Tensor>()) return {*t};
  if (const std::vector<at::Tensor>* l = v.try_get<std::vector<at::Tensor>>()) return *l;
  return {};
}

int64_t Bytes(const std::vector<at::Tensor>& ts) {
  int64_t n = 0;
  for (const at::Tensor& t : ts) n += t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
  return n;
}

absl::Status CheckArgs(int64_t partitions, const torch::nn::Sequential& model,
                       const at::Tensor& sample) {
  if (model.is_empty() || model->size() == 0) {
    return absl::InvalidArgumentError("the model has no layers");
  }
  if (!sample.defined() || sample.dim() == 0 || sample.size(0) == 0) {
    return absl::InvalidArgumentError("the sample needs at least one row");
  }
  if (partitions < 1 || partitions > static_cast<int64_t>(model->size())) {
    return absl::InvalidArgumentError(
        absl::StrCat(partitions, " partitions for ", model->size(), " layers"));
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<int64_t> balance_by_cost(int64_t partitions, const std::vector<double>& costs) {
  const int64_t n = static_cast<int64_t>(costs.size());
  if (partitions < 1 || partitions > n) {
    base::ThrowIfError(
        absl::InvalidArgumentError(absl::StrCat(partitions, " partitions for ", n, " layers")),
        "pipe::balance_by_cost");
  }
  std::vector<double> prefix(n + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + costs[i];
  constexpr double kInf = std::numeric_limits<double>::infinity();
  // best[k][j]: the smallest largest-block cost splitting layers [0, j) into k blocks;
  // cut[k][j]: where its last block starts.
  std::vector<std::vector<double>> best(partitions + 1, std::vector<double>(n + 1, kInf));
  std::vector<std::vector<int64_t>> cut(partitions + 1, std::vector<int64_t>(n + 1, 0));
  for (int64_t j = 1; j <= n; ++j) best[1][j] = prefix[j];
  for (int64_t k = 2; k <= partitions; ++k) {
    for (int64_t j = k; j <= n; ++j) {
      for (int64_t i = k - 1; i < j; ++i) {
        const double c = std::max(best[k - 1][i], prefix[j] - prefix[i]);
        if (c < best[k][j]) {
          best[k][j] = c;
          cut[k][j] = i;
        }
      }
    }
  }
  std::vector<int64_t> balance(partitions);
  int64_t end = n;
  for (int64_t k = partitions; k >= 1; --k) {
    const int64_t start = k == 1 ? 0 : cut[k][end];
    balance[k - 1] = end - start;
    end = start;
  }
  return balance;
}

std::vector<int64_t> balance_by_size(int64_t partitions, torch::nn::Sequential model,
                                     const at::Tensor& sample, int64_t chunks, double param_scale) {
  base::ThrowIfError(CheckArgs(partitions, model, sample), "pipe::balance_by_size");
  if (chunks < 1) {
    base::ThrowIfError(absl::InvalidArgumentError("chunks must be >= 1"), "pipe::balance_by_size");
  }
  const int64_t rows = (sample.size(0) + chunks - 1) / chunks;
  c10::NoGradGuard no_grad;
  torch::nn::AnyValue v(sample.narrow(0, 0, std::min(rows, sample.size(0))));
  std::vector<double> costs;
  for (torch::nn::AnyModule& layer : *model) {
    v = layer.any_forward(std::move(v));
    double cost = static_cast<double>(Bytes(TensorsOf(v)));
    for (const at::Tensor& p : layer.ptr()->parameters()) {
      cost += param_scale * static_cast<double>(p.nbytes());
    }
    costs.push_back(cost);
  }
  return balance_by_cost(partitions, costs);
}

std::vector<int64_t> balance_by_time(int64_t partitions, torch::nn::Sequential model,
                                     const at::Tensor& sample, int64_t repetitions) {
  base::ThrowIfError(CheckArgs(partitions, model, sample), "pipe::balance_by_time");
  c10::AutoGradMode grad_mode(true);
  std::vector<double> costs(model->size(), std::numeric_limits<double>::infinity());
  for (int64_t r = 0; r < std::max<int64_t>(repetitions, 1); ++r) {
    torch::nn::AnyValue v(sample.detach());
    size_t l = 0;
    for (torch::nn::AnyModule& layer : *model) {
      const absl::Time start = absl::Now();
      torch::nn::AnyValue out = layer.any_forward(std::move(v));
      std::vector<at::Tensor> outs;
      std::vector<at::Tensor> grads;
      for (const at::Tensor& t : TensorsOf(out)) {
        if (t.requires_grad()) {
          outs.push_back(t);
          grads.push_back(at::ones_like(t));
        }
      }
      if (!outs.empty()) torch::autograd::backward(outs, grads);
      costs[l] = std::min(costs[l], absl::ToDoubleSeconds(absl::Now() - start));
      ++l;
      // The next layer sees this one's output as a fresh leaf (its own backward only).
      std::vector<at::Tensor> next = TensorsOf(out);
      for (at::Tensor& t : next) {
        t = t.detach();
        if (at::isFloatingType(t.scalar_type())) t.requires_grad_(true);
      }
      if (out.try_get<at::Tensor>() != nullptr) {
        v = torch::nn::AnyValue(next.at(0));
      } else {
        v = torch::nn::AnyValue(next);
      }
    }
  }
  for (const at::Tensor& p : model->parameters()) p.mutable_grad() = at::Tensor();
  return balance_by_cost(partitions, costs);
}

}  // namespace fairscale::pipe
