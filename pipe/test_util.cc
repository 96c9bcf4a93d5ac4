#include "pipe/test_util.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/cos.h>
#include <ATen/ops/mse_loss.h>
#include <ATen/ops/sin.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/tensor_close.h"
#include "comm/testing/inproc_ranks.h"
#include "testing/c10_error.h"

namespace fairscale::pipe::testing {

torch::nn::Sequential MakeMlp() {
  torch::nn::Sequential m(torch::nn::Linear(4, 6), torch::nn::Tanh(), torch::nn::Linear(6, 6),
                          torch::nn::Tanh(), torch::nn::Linear(6, 6), torch::nn::Tanh(),
                          torch::nn::Linear(6, 3));
  InitDeterministic(*m);
  return m;
}

torch::nn::Sequential MakeDeepMlp() {
  torch::nn::Sequential m(torch::nn::Linear(4, 6));
  for (int k = 0; k < 5; ++k) {
    m->push_back(torch::nn::Tanh());
    m->push_back(torch::nn::Linear(6, 6));
  }
  m->push_back(torch::nn::Tanh());
  m->push_back(torch::nn::Linear(6, 3));
  InitDeterministic(*m);
  return m;
}

at::Tensor Inputs(int64_t rows, int seed) {
  return at::sin(at::arange(rows * 4, at::kFloat).view({rows, 4}) * 0.37 + seed);
}

at::Tensor Targets(int64_t rows, int seed) {
  return at::cos(at::arange(rows * 3, at::kFloat).view({rows, 3}) * 0.53 + seed);
}

at::Tensor Mse(const at::Tensor& output, const at::Tensor& target) {
  return at::mse_loss(output, target);
}

Reference RunReference(const std::function<torch::nn::Sequential()>& make_model,
                       const std::vector<at::Tensor>& inputs,
                       const std::vector<at::Tensor>& targets, int64_t chunks,
                       const LossFn& loss_fn) {
  torch::nn::Sequential model = make_model();
  Reference ref;
  for (size_t s = 0; s < inputs.size(); ++s) {
    const int64_t n = inputs[s].size(0);
    double total = 0;
    for (int64_t i = 0; i < chunks; ++i) {
      const int64_t offset = i * (n / chunks) + std::min(i, n % chunks);
      const int64_t size = n / chunks + (i < n % chunks ? 1 : 0);
      at::Tensor loss = loss_fn(model->forward(inputs[s].narrow(0, offset, size)),
                                targets[s].narrow(0, offset, size));
      total += loss.item<double>();
      (loss / static_cast<double>(chunks)).backward();
    }
    ref.losses.push_back(total / static_cast<double>(chunks));
  }
  for (const auto& item : model->named_parameters()) {
    ref.grads[item.key()] = item.value().grad().defined() ? item.value().grad().clone()
                                                          : at::zeros_like(item.value());
  }
  return ref;
}

absl::Status ExpectClose(const std::string& what, const at::Tensor& actual,
                         const at::Tensor& expected, double rtol) {
  return base::ExpectTensorClose(what, actual, expected, rtol);
}

absl::Status CheckStageGrads(const Pipe& pipe, const std::map<std::string, at::Tensor>& grads,
                             double rtol, const std::string& what) {
  int checked = 0;
  for (const auto& item : pipe.stage_module()->named_parameters()) {
    auto it = grads.find(item.key());
    if (it == grads.end()) {
      return absl::InternalError(absl::StrCat(what, ": no reference for ", item.key()));
    }
    absl::Status s = ExpectClose(absl::StrCat(what, " grad ", item.key()), item.value().grad(),
                                 it->second, rtol);
    if (!s.ok()) return s;
    ++checked;
  }
  if (checked == 0 && !pipe.stage_module()->parameters().empty()) {
    return absl::InternalError(absl::StrCat(what, ": no parameter checked"));
  }
  return absl::OkStatus();
}

std::vector<absl::Status> RunParity(int ranks,
                                    const std::function<torch::nn::Sequential()>& make_model,
                                    const PipeOptions& options,
                                    const std::vector<at::Tensor>& inputs,
                                    const std::vector<at::Tensor>& targets, const Reference& ref,
                                    const std::string& what) {
  return RunInproc(
      ranks, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        std::unique_ptr<Pipe> pipe = Pipe::Create(make_model(), comm, options);
        if (pipe->virtual_stages() != options.virtual_stages()) {
          return absl::InternalError(absl::StrCat(what, ": virtual_stages()"));
        }
        for (size_t step = 0; step < inputs.size(); ++step) {
          // Only stage 0 reads the input and only the last stage the target.
          const at::Tensor x = rank == 0 ? inputs[step] : at::Tensor();
          const at::Tensor y = rank == ranks - 1 ? targets[step] : at::Tensor();
          const at::Tensor loss = pipe->train_step(x, y, Mse);
          const double expected = ref.losses[step];
          if (std::abs(loss.item<double>() - expected) > 1e-5 * std::max(1.0, std::abs(expected))) {
            return absl::InternalError(absl::StrCat(what, " rank ", rank, " step ", step,
                                                    ": loss ", loss.item<double>(), " != ",
                                                    expected));
          }
        }
        return CheckStageGrads(*pipe, ref.grads, 1e-5, absl::StrCat(what, " rank ", rank));
      });
}

std::vector<absl::Status> RunInproc(
    int world,
    const std::function<absl::Status(int rank, std::shared_ptr<comm::Communicator>)>& body,
    absl::Duration timeout) {
  return comm::testing::RunInprocRanks(
      world,
      [&body](int rank, int, std::shared_ptr<comm::Communicator> comm) {
        return fairscale::testing::CatchErrors([&] { return body(rank, comm); });
      },
      timeout);
}

}  // namespace fairscale::pipe::testing
