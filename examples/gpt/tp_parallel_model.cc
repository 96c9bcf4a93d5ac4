// The trainer's tensor-parallel mode (--tensor_parallel=T > 1): TpParallelModel behind
// ParallelModel. A T x (world / T) grid (model_parallel::MakeParallelGrid(world, T, 1)): each
// tensor group holds one TpGpt loaded from the job's dense Gpt (so the job trains the dense
// job's model), every rank of a tensor group reads its replica's batch, and FSDP shards each
// rank's TP slices over the data group (the ranks holding the same slices: one per replica) with
// the job's strategy (no_shard: the replicas all-reduce their gradients). FSDP runs per parameter
// (flatten_parameters(false)), so each shard keeps its parameter's name, which the clipping norm
// needs (TpGptImpl::is_split).
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/adam.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "examples/gpt/parallel_model_internal.h"
#include "examples/gpt/tp_model.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/wrap.h"
#include "model_parallel/grid.h"
#include "train_state/fsdp_item.h"
#include "train_state/items.h"

namespace fairscale::examples::gpt::internal {
namespace {

// The FSDP root's module: forward(tokens, targets) is TpGpt's vocab-parallel loss, so that the
// root's forward (which gathers the parameters and hooks the gradient reduction) runs it; with
// undefined targets, the gathered logits (sampling).
class TpLossImpl : public torch::nn::Module {
 public:
  explicit TpLossImpl(TpGpt gpt) : gpt_(register_module("gpt", std::move(gpt))) {}
  torch::Tensor forward(torch::Tensor tokens, torch::Tensor targets) {
    if (!targets.defined()) return gpt_(tokens);
    return gpt_->loss(tokens, targets);
  }
  const TpGpt& gpt() const { return gpt_; }

 private:
  TpGpt gpt_;
};
TORCH_MODULE(TpLoss);

class TpParallelModel final : public ParallelModel {
 public:
  TpParallelModel(model_parallel::ParallelGrid grid, TpGpt gpt, fsdp::FullyShardedDataParallel fsdp,
                  int64_t num_params, const torch::optim::AdamOptions& adam, std::string label)
      : grid_(std::move(grid)),
        gpt_(std::move(gpt)),
        fsdp_(std::move(fsdp)),
        opt_(fsdp_->parameters(), adam),
        num_params_(num_params),
        label_(std::move(label)) {}

  // The gathered logits, through the FSDP root (collective on the whole grid): the sample at
  // the end of the job.
  at::Tensor forward(const at::Tensor& tokens) override {
    return fsdp_->forward(tokens, at::Tensor());
  }
  bool computes_loss() const override { return true; }
  // TpGpt's vocab-parallel cross-entropy on this replica's batch, through the FSDP root. Training:
  // backward, which FSDP ends with the gradients averaged (reduce-scattered) over the replicas.
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets) override {
    at::Tensor loss = fsdp_->forward(tokens, targets);
    if (!c10::GradMode::is_enabled()) return loss;
    loss.backward();
    return loss.detach();
  }
  int data_rank(int) const override { return static_cast<int>(grid_.replica); }
  int data_replicas(int) const override { return static_cast<int>(grid_.data); }

  torch::optim::Optimizer& optimizer() override { return opt_; }
  void zero_grad() override { opt_.zero_grad(); }
  // clip_grad_norm_'s rule over the dense model. Each rank's shards hold its rows of its TP
  // slices: a split parameter's squared norm is the sum over the whole grid, a replicated one's
  // (identical on every rank of the tensor group) the sum over the data group only.
  void clip_grad_norm(double max_norm) override {
    double replicated = 0, split = 0;
    for (const auto& item : fsdp_->named_parameters()) {
      const at::Tensor& g = item.value().grad();
      if (!g.defined()) continue;
      const double sq = g.to(at::kDouble).pow(2).sum().item<double>();
      (TpGptImpl::is_split(item.key()) ? split : replicated) += sq;
    }
    if (grid_.data > 1) {
      replicated = AllReduceSum(*grid_.data_group, replicated,
                                "clip_grad_norm: replicated squared norm over the data group");
    }
    const double total =
        replicated + AllReduceSum(*grid_.world, split,
                                  "clip_grad_norm: split squared norm over the grid");
    const double coef = max_norm / (std::sqrt(total) + 1e-6);
    if (coef >= 1) return;
    torch::NoGradGuard no_grad;
    for (const at::Tensor& p : fsdp_->parameters()) {
      if (p.grad().defined()) p.grad().mul_(coef);
    }
  }
  int64_t num_params() const override { return num_params_; }
  std::string label() const override { return label_; }

  // One FSDP checkpoint per tensor rank ("stage<r>/" of the item: stage_item with the tensor
  // rank as the stage), each restorable at any number of replicas; the same T is required (the
  // slices differ per T), and another T is an error naming both.
  void add_state(train_state::TrainState& state) override {
    state.add("model",
              train_state::stage_item(static_cast<int>(grid_.tensor_rank),
                                      static_cast<int>(grid_.tensor), static_cast<int>(grid_.replica),
                                      static_cast<int>(grid_.data),
                                      train_state::fsdp_item(fsdp_, &opt_)));
  }

  uint64_t param_hash() override {
    uint64_t h = kFnv1a64Basis;
    for (const at::Tensor& p : fsdp_->parameters()) h = HashTensor(p, h);
    return h;
  }
  // The dense parameters by name: FSDP gathers each rank's slices over the replicas, then
  // TpGpt::full_state_dict gathers the slices over the tensor group (collective).
  uint64_t full_param_hash() override {
    auto full = fsdp_->summon_full_params(/*writeback=*/false);
    uint64_t h = kFnv1a64Basis;
    for (const auto& item : gpt_->full_state_dict()) h = HashNamed(item.key(), item.value(), h);
    return h;
  }

 private:
  model_parallel::ParallelGrid grid_;
  TpGpt gpt_;
  fsdp::FullyShardedDataParallel fsdp_;
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
  FS_ASSIGN_OR_RETURN(fsdp::ShardingStrategy strategy, ParseStrategy(config.strategy));
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
    const auto opts =
        fsdp::FsdpOptions().sharding_strategy(strategy).flatten_parameters(false);
    TpGpt gpt{nullptr};
    fsdp::FullyShardedDataParallel root{nullptr};
    {
      // Every block its own FSDP unit over the data group; the root holds the embeddings and
      // the head.
      fsdp::EnableWrap scope(grid.data_group, opts,
                             fsdp::module_type_auto_wrap_policy<TpTransformerBlockImpl>());
      gpt = TpGpt(model_config, grid.tensor_group);
      root = fsdp::FullyShardedDataParallel(TpLoss(gpt), grid.data_group, opts);
    }
    {
      // Collective on the data group: every rank writes its rows of the dense slices back.
      auto full = root->summon_full_params(/*writeback=*/true);
      gpt->load_dense_state_dict(dense_params);
    }
    const std::string label =
        absl::StrCat("tensor parallel ", t, " x ", grid.data, " replica", grid.data == 1 ? "" : "s",
                     " (", config.strategy, ")");
    return std::unique_ptr<ParallelModel>(std::make_unique<TpParallelModel>(
        std::move(grid), std::move(gpt), std::move(root), num_params, adam, label));
  } catch (const c10::Error& e) {
    // kUnknown: the code is the one in the message (e.g. TpGpt's INVALID_ARGUMENT for heads or
    // a vocabulary that T does not divide).
    return absl::UnknownError(
        absl::StrCat("tensor_parallel ", t, ": ", e.what_without_backtrace()));
  }
}

}  // namespace fairscale::examples::gpt::internal
