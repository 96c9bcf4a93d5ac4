// Helpers of the per-parameter layout tests (testonly): the hand-derived row shards of the
// contract, AdamW with or without the two param groups users build (weight decay on matrices
// only), a single-process reference trajectory, and small models (the test Net, a tied one).
#pragma once

#include <ATen/ops/tanh.h>
#include <c10/core/GradMode.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/test_util.h"

namespace fairscale::fsdp::testing {

inline constexpr int kSteps = 4;

inline bool Sharded(ShardingStrategy s, int world) {
  return world > 1 && s != ShardingStrategy::kNoShard;
}

// This rank's rows of the full tensor `t` in the per-parameter layout, derived
// from the documented contract: ceil(rows / world) rows per rank, fewer or none
// on the last ranks; a 0-dim tensor is one row, shaped [1] or [0].
inline at::Tensor Rows(const at::Tensor& t, int rank, int world, bool sharded) {
  if (!sharded) return t;
  at::Tensor x = t.dim() == 0 ? t.reshape({1}) : t;
  const int64_t rows = x.size(0);
  const int64_t per = (rows + world - 1) / world;
  const int64_t begin = std::min(rows, rank * per);
  return x.narrow(0, begin, std::min(rows, begin + per) - begin);
}

// AdamW over the distinct trainable parameters of `named`: group 0 (weight
// decay 0.1) the matrices, group 1 (no weight decay) the rest (biases, vectors,
// scalars), by name and shape of the unwrapped module, as users group them.
inline std::unique_ptr<torch::optim::AdamW> GroupedAdamW(
    const torch::OrderedDict<std::string, at::Tensor>& named, const std::set<std::string>& matrices,
    bool grouped = true) {
  std::vector<at::Tensor> decay;
  std::vector<at::Tensor> no_decay;
  std::vector<at::Tensor> seen;
  for (const auto& item : named) {
    const at::Tensor& p = item.value();
    bool dup = false;
    for (const at::Tensor& q : seen) dup = dup || q.is_same(p);
    if (dup || !p.requires_grad()) continue;
    seen.push_back(p);
    (!grouped || matrices.count(item.key()) ? decay : no_decay).push_back(p);
  }
  if (!grouped) {
    return std::make_unique<torch::optim::AdamW>(
        decay, torch::optim::AdamWOptions(0.02).weight_decay(0.1));
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(0.02).weight_decay(0.1)));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(0.02).weight_decay(0.0)));
  return std::make_unique<torch::optim::AdamW>(groups,
                                               torch::optim::AdamWOptions(0.02).weight_decay(0.1));
}

inline std::set<std::string> Matrices(const torch::nn::Module& m) {
  std::set<std::string> out;
  for (const auto& item : m.named_parameters()) {
    if (item.value().dim() >= 2) out.insert(item.key());
  }
  return out;
}

struct Step {
  at::Tensor loss;
  std::map<std::string, at::Tensor> grads;   // undefined: no gradient
  std::map<std::string, at::Tensor> params;  // after the step
};

// A model family for the harness: make(nested_comm, options) builds it (plain
// when null), loss(model, step, rank, world) runs forward on this rank's rows
// and returns the loss (whose backward over all ranks equals the global
// batch's).
template <typename Make, typename Loss>
std::vector<Step> Reference(Make make, Loss loss_fn, double max_norm = 0, int steps = kSteps,
                            bool grouped = true) {
  auto net = make(nullptr, FsdpOptions());
  auto opt = GroupedAdamW(net->named_parameters(), Matrices(*net), grouped);
  std::vector<Step> out;
  for (int step = 0; step < steps; ++step) {
    opt->zero_grad();
    Step s;
    s.loss = loss_fn(net, step, 0, 1);
    s.loss.backward();
    if (max_norm > 0) {
      std::vector<at::Tensor> params;
      for (const at::Tensor& p : DistinctParameters(*net)) {
        if (p.requires_grad()) params.push_back(p);
      }
      // torch.nn.utils.clip_grad_norm_, written out.
      double sq = 0;
      for (const at::Tensor& p : params) sq += p.grad().pow(2).sum().item<double>();
      const double coef = max_norm / (std::sqrt(sq) + 1e-6);
      c10::NoGradGuard no_grad;
      if (coef < 1) {
        for (const at::Tensor& p : params) p.grad().mul_(coef);
      }
    }
    for (const auto& item : net->named_parameters()) {
      s.grads[item.key()] =
          item.value().grad().defined() ? item.value().grad().clone() : at::Tensor();
    }
    opt->step();
    for (const auto& item : net->named_parameters()) {
      s.params[item.key()] = item.value().detach().clone();
    }
    out.push_back(std::move(s));
  }
  return out;
}

inline auto MakeNet(NetConfig config = {}) {
  return [config](std::shared_ptr<comm::Communicator> nested, FsdpOptions o) {
    return NestedNet(nested, o, config);
  };
}

template <typename M>
at::Tensor NetLoss(M& model, int step, int rank, int world) {
  Batch b = GlobalBatch(step);
  at::Tensor out = Call<at::Tensor>(model, RankRows(b.x, rank, world));
  return Mse(out, RankRows(b.y, rank, world));
}
struct NetLossFn {
  template <typename M>
  at::Tensor operator()(M& model, int step, int rank, int world) const {
    return NetLoss(model, step, rank, world);
  }
};

// Parameters of 0, 1, 2, 3 and 5 rows, a 0-dim scale, and a [1, 4] matrix (one
// row, fewer than most world sizes): out = (x @ w3^T * s + b1) summed with the
// other parameters' terms.
// names).
class HeadImpl : public torch::nn::Module {
 public:
  explicit HeadImpl(at::Tensor w) { weight = register_parameter("weight", std::move(w)); }
  at::Tensor weight;
};

class TiedImpl : public torch::nn::Module {
 public:
  TiedImpl() {
    emb = register_parameter("emb", at::zeros({6, 5}));
    bias = register_parameter("bias", at::zeros({6}));
    InitDeterministic(*this, "tied.");
    head = register_module("head", std::make_shared<HeadImpl>(emb));
  }
  at::Tensor forward(at::Tensor x) {
    at::Tensor h = at::tanh(x.matmul(emb.t()) + bias);  // [n, 6]
    return h.matmul(head->weight).sum(1, true) * 0.5;   // [n, 1]
  }
  at::Tensor emb, bias;
  std::shared_ptr<HeadImpl> head;
};
TORCH_MODULE(Tied);

struct TiedLossFn {
  template <typename M>
  at::Tensor operator()(M& model, int step, int rank, int world) const {
    at::Tensor x = RankRows(GlobalBatch(step).x, rank, world);
    return (Call<at::Tensor>(model, x) - 0.2).pow(2).mean();
  }
};

template <typename T>
auto MakePlain() {
  return [](std::shared_ptr<comm::Communicator>, FsdpOptions) { return T(); };
}

}  // namespace fairscale::fsdp::testing
