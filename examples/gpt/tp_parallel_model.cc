// The trainer's tensor-parallel mode (--tensor_parallel=T > 1): TpParallelModel behind
// ParallelModel. A T x (world / T) grid (model_parallel::MakeParallelGrid(world, T, 1)): each
// tensor group holds one TpGpt loaded from the job's dense Gpt (so the job trains the dense
// job's model), every rank of a group reads its replica's batch, and the replicas average their
// gradients over grid.data_group (a plain all-reduce: strategy no_shard; FSDP over the data
// dimension is a later step).
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/optim/adam.h>

#include <cmath>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "examples/gpt/parallel_model_internal.h"
#include "examples/gpt/tp_model.h"
#include "model_parallel/grid.h"
#include "pipe/grid.h"

namespace fairscale::examples::gpt::internal {
namespace {

class TpParallelModel final : public ParallelModel {
 public:
  // `sharded`: the names of the TpGpt's parameters that hold a slice of the dense one (the
  // others are replicated, identical on every rank of the tensor group).
  TpParallelModel(model_parallel::ParallelGrid grid, TpGpt model, std::set<std::string> sharded,
                  int64_t num_params, const torch::optim::AdamOptions& adam, std::string label)
      : grid_(std::move(grid)),
        model_(std::move(model)),
        sharded_(std::move(sharded)),
        opt_(model_->parameters(), adam),
        num_params_(num_params),
        label_(std::move(label)) {}

  // The gathered logits (collective on the tensor group). The trainer calls loss() instead.
  at::Tensor forward(const at::Tensor& tokens) override { return model_(tokens); }
  bool computes_loss() const override { return true; }
  // TpGpt's vocab-parallel cross-entropy on this replica's batch. Training: backward, then the
  // gradients averaged over the replicas.
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets) override {
    at::Tensor loss = model_->loss(tokens, targets);
    if (!c10::GradMode::is_enabled()) return loss;
    loss.backward();
    if (grid_.data > 1) pipe::all_reduce_gradients(model_->parameters(), *grid_.data_group);
    return loss.detach();
  }
  int data_rank(int) const override { return static_cast<int>(grid_.replica); }
  int data_replicas(int) const override { return static_cast<int>(grid_.data); }

  torch::optim::Optimizer& optimizer() override { return opt_; }
  void zero_grad() override { opt_.zero_grad(); }
  // clip_grad_norm_'s rule over the dense model: the replicated parameters' squared norms once
  // (identical on the tensor group's ranks), the shards' summed over the tensor group. After
  // the data all-reduce every replica holds the same gradients.
  void clip_grad_norm(double max_norm) override {
    double replicated = 0, sharded = 0;
    for (const auto& item : model_->named_parameters()) {
      const at::Tensor& g = item.value().grad();
      if (!g.defined()) continue;
      const double sq = g.to(at::kDouble).pow(2).sum().item<double>();
      (sharded_.count(item.key()) > 0 ? sharded : replicated) += sq;
    }
    const double total =
        replicated + AllReduceSum(*grid_.tensor_group, sharded,
                                  "clip_grad_norm: squared norm over the tensor group");
    const double coef = max_norm / (std::sqrt(total) + 1e-6);
    if (coef >= 1) return;
    torch::NoGradGuard no_grad;
    for (const at::Tensor& p : model_->parameters()) {
      if (p.grad().defined()) p.grad().mul_(coef);
    }
  }
  int64_t num_params() const override { return num_params_; }
  std::string label() const override { return label_; }

  void add_state(train_state::TrainState&) override {
    // Validate() rejects --checkpoint_dir with tensor_parallel > 1; this is the backstop.
    TORCH_CHECK(false, "checkpoints with --tensor_parallel are not supported yet");
  }

  uint64_t param_hash() override {
    uint64_t h = kFnv1a64Basis;
    for (const at::Tensor& p : model_->parameters()) h = HashTensor(p, h);
    return h;
  }
  // The dense parameters by name (TpGpt::full_state_dict: collective on the tensor group).
  uint64_t full_param_hash() override {
    uint64_t h = kFnv1a64Basis;
    for (const auto& item : model_->full_state_dict()) h = HashNamed(item.key(), item.value(), h);
    return h;
  }

 private:
  model_parallel::ParallelGrid grid_;
  TpGpt model_;
  std::set<std::string> sharded_;
  torch::optim::Adam opt_;
  int64_t num_params_;
  std::string label_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ParallelModel>> MakeTpModel(const TrainConfig& config,
                                                           const GptConfig& model_config,
                                                           std::shared_ptr<comm::Communicator> comm,
                                                           const torch::optim::AdamOptions& adam) {
  const int64_t t = config.tensor_parallel;
  if (comm->size() % t != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor_parallel ", t, " does not divide the world size ", comm->size()));
  }
  // The same Gpt (so the same initial weights, from torch's seeded global generator) as the
  // other modes; the TpGpt takes its slices.
  Gpt dense(model_config);
  model_parallel::TensorDict dense_params;
  int64_t num_params = 0;
  for (const auto& item : dense->named_parameters()) {
    dense_params.insert(item.key(), item.value());
    num_params += item.value().numel();
  }
  try {
    model_parallel::ParallelGrid grid = model_parallel::MakeParallelGrid(comm, t, 1);
    TpGpt model(model_config, grid.tensor_group);
    model->load_dense_state_dict(dense_params);
    std::set<std::string> sharded;
    for (const auto& item : model->named_parameters()) {
      const at::Tensor* d = dense_params.find(item.key());
      if (d == nullptr || !d->sizes().equals(item.value().sizes())) {
        sharded.insert(item.key());
      }
    }
    const std::string label = absl::StrCat("tensor parallel ", t, " x ", grid.data, " replica",
                                           grid.data == 1 ? "" : "s", " (all-reduce)");
    return std::unique_ptr<ParallelModel>(std::make_unique<TpParallelModel>(
        std::move(grid), std::move(model), std::move(sharded), num_params, adam, label));
  } catch (const c10::Error& e) {
    // kUnknown: the code is the one in the message (e.g. TpGpt's INVALID_ARGUMENT for heads or
    // a vocabulary that T does not divide).
    return absl::UnknownError(
        absl::StrCat("tensor_parallel ", t, ": ", e.what_without_backtrace()));
  }
}

}  // namespace fairscale::examples::gpt::internal
