// The trainer's pipeline mode (--pipeline_stages > 1): PipeModel behind ParallelModel.
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/adam.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <ATen/ops/zeros.h>

#include <cmath>
#include <filesystem>
#include <type_traits>
#include <utility>
#include <vector>

#include "deterministic/collectives.h"
#include "deterministic/tree.h"
#include "absl/strings/str_cat.h"
#include "base/fnv1a.h"
#include "base/status_macros.h"
#include "examples/gpt/parallel_model_internal.h"
#include "examples/gpt/tp_model.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "model_parallel/cross_entropy.h"
#include "model_parallel/grid.h"
#include "model_parallel/pipe_grid.h"
#include "pipe/balance.h"
#include "pipe/fsdp_stage.h"
#include "pipe/grid.h"
#include "pipe/pipe.h"
#include "train_state/fsdp_item.h"
#include "train_state/items.h"

namespace fairscale::examples::gpt::internal {
namespace {

// Pipeline x data parallel: this rank holds one stage (a few consecutive layers of the fp32
// Gpt) of one replica; an Adam over the stage's parameters. The replicas of a stage either keep
// it whole and all-reduce its gradients (strategy no_shard), or shard it with FSDP over them
// (full_shard / shard_grad_op: pipe::fsdp_stage; the Adam steps this rank's shard).
// Tensor x pipeline (tensor_parallel T > 1): the stages are TpGpt layers on a tensor group of T
// ranks (model_parallel::MakeParallelGrid(world, T, stages)): every tensor rank runs its own pipe
// over the ranks with its tensor rank, the last stage scores its vocabulary shard of the logits
// with vocab_parallel_cross_entropy, FSDP inside a stage runs per parameter (names kept for the
// clipping norm), and each (stage, tensor rank) is a checkpoint stage of its own.
class PipeModel final : public ParallelModel {
 public:
  // `micro_batches` > 0: deterministic mode with that many micro-batches per step.
  // `tensor`: the tensor-parallel group (null without tensor parallelism).
  PipeModel(pipe::PipeGrid grid, std::unique_ptr<pipe::Pipe> pipe, int64_t vocab,
            int64_t num_params, torch::optim::AdamOptions adam, std::string label,
            int64_t micro_batches, std::shared_ptr<comm::Communicator> tensor = nullptr)
      : micro_batches_(micro_batches),
        tensor_(std::move(tensor)),
        grid_(std::move(grid)),
        pipe_(std::move(pipe)),
        fsdp_(std::dynamic_pointer_cast<fsdp::FullyShardedDataParallelImpl>(pipe_->module())),
        opt_(pipe_->parameters(), adam),
        vocab_(vocab),
        num_params_(num_params),
        label_(std::move(label)) {}

  at::Tensor forward(const at::Tensor&) override {
    TORCH_CHECK(false, "pipeline mode: no rank holds the whole model's forward (use loss())");
  }
  bool computes_loss() const override { return true; }
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets) override {
    const int64_t vocab = vocab_;
    comm::Communicator* tensor = tensor_.get();
    const pipe::LossFn fn = [vocab, tensor](const at::Tensor& logits, const at::Tensor& y) {
      // The vocabulary shard's logits: the tensor group's vocab-parallel cross-entropy.
      if (tensor != nullptr) {
        return model_parallel::vocab_parallel_cross_entropy(logits.to(at::kFloat), y, *tensor);
      }
      // bf16 logits (mixed precision) are scored in f32, as in the unpipelined modes.
      return torch::nn::functional::cross_entropy(logits.to(at::kFloat).reshape({-1, vocab}),
                                                  y.reshape({-1}));
    };
    const bool train = c10::GradMode::is_enabled();
    at::Tensor loss =
        train ? pipe_->train_step(tokens, targets, fn) : pipe_->eval_step(tokens, targets, fn);
    if (micro_batches_ > 0) {
      // Deterministic mode: this replica ran micro-batches [replica c, (replica + 1) c) of the
      // step's M; the gradients and the loss are reduced over the replicas on the tree.
      if (train && grid_.replicas > 1) pipe::all_reduce_gradients(*pipe_, *grid_.data);
      // The loss in double from the micro-batch losses, as the unpipelined modes compute it
      // (the pipe's own is rounded to the loss's dtype).
      const auto layout = deterministic::MicroBatchLayout::Make(
          micro_batches_, static_cast<int>(grid_.replicas), static_cast<int>(grid_.replica));
      return at::scalar_tensor(
          deterministic::Mean(*grid_.data, layout, pipe_->micro_batch_losses(),
                              train ? "train loss" : "validation loss"),
          at::kDouble);
    }
    // Under FSDP every micro-batch's backward already reduce-scattered its gradient.
    if (train && grid_.replicas > 1 && !fsdp_) {
      pipe::all_reduce_gradients(pipe_->parameters(), *grid_.data);
    }
    return loss;
  }
  int data_rank(int) const override { return static_cast<int>(grid_.replica); }
  int data_replicas(int) const override { return static_cast<int>(grid_.replicas); }

  torch::optim::Optimizer& optimizer() override { return opt_; }
  void zero_grad() override { opt_.zero_grad(); }
  // torch::nn::utils::clip_grad_norm_'s rule over the whole model: the squared norms of the
  // stages summed over the pipe (whole stages: the same in every replica after the all-reduce;
  // FSDP: each stage's shards summed over its replicas first).
  void clip_grad_norm(double max_norm) override {
    if (micro_batches_ > 0) {
      // Deterministic mode: an exact sum of squares over the pipe (the replicas hold the same
      // gradients), so the norm does not depend on the cut into stages.
      deterministic::ExactSquareSum squares;
      for (const at::Tensor& p : pipe_->parameters()) {
        if (p.grad().defined()) squares.Add(p.grad());
      }
      squares.AllReduce(*grid_.pipe, "clip_grad_norm");
      const double coef = max_norm / (squares.norm() + 1e-6);
      if (coef >= 1) return;
      torch::NoGradGuard no_grad;
      for (const at::Tensor& p : pipe_->parameters()) {
        if (p.grad().defined()) p.grad().mul_(coef);
      }
      return;
    }
    // Tensor parallelism: the split parameters' squares (TpGptImpl::is_split) also summed over
    // the tensor group, the replicated ones' (the same on every tensor rank) not.
    double sq = 0, split = 0;
    for (const auto& item : pipe_->module()->named_parameters()) {
      const at::Tensor& g = item.value().grad();
      if (!g.defined()) continue;
      const double s = g.to(at::kDouble).pow(2).sum().item<double>();
      (tensor_ && TpGptImpl::is_split(item.key()) ? split : sq) += s;
    }
    if (fsdp_) sq = AllReduceSum(*grid_.data, sq, "clip_grad_norm: squared norm over the replicas");
    if (tensor_) {
      if (fsdp_) split = AllReduceSum(*grid_.data, split, "clip_grad_norm: split squares over the replicas");
      sq += AllReduceSum(*tensor_, split, "clip_grad_norm: split squares over the tensor group");
    }
    const double total_sq = AllReduceSum(*grid_.pipe, sq, "clip_grad_norm: squared norm over the pipe");
    const double coef = max_norm / (std::sqrt(total_sq) + 1e-6);
    if (coef >= 1) return;
    torch::NoGradGuard no_grad;
    for (const at::Tensor& p : pipe_->parameters()) {
      if (p.grad().defined()) p.grad().mul_(coef);
    }
  }
  int64_t num_params() const override { return num_params_; }
  std::string label() const override { return label_; }

  // Every stage's replicas save their stage (stage_item, "stage<s>/" of each item): FSDP inside
  // the stages, the stage's sharded model and Adam (fsdp_item); whole stages, the stage's
  // parameters by their full-model names (module_item) and its Adam (optimizer_item), replica
  // 0's. Both restore with the same pipeline_stages at any number of replicas.
  void add_state(train_state::TrainState& state) override {
    // With tensor parallelism each (stage, tensor rank) holds other slices: checkpoint stage
    // stage * T + tensor rank of stages * T.
    const int t = tensor_ ? tensor_->size() : 1, tr = tensor_ ? tensor_->rank() : 0;
    const int stage = static_cast<int>(grid_.stage) * t + tr,
              stages = static_cast<int>(grid_.stages) * t;
    const int replica = static_cast<int>(grid_.replica), replicas = static_cast<int>(grid_.replicas);
    if (fsdp_) {
      state.add("model", train_state::stage_item(
                             stage, stages, replica, replicas,
                             train_state::fsdp_item(fsdp::FullyShardedDataParallel(fsdp_), &opt_)));
      return;
    }
    state.add("model", train_state::stage_item(stage, stages, replica, replicas,
                                               train_state::module_item(pipe_->stage_module().ptr())))
        .add("optimizer", train_state::stage_item(stage, stages, replica, replicas,
                                                  train_state::optimizer_item(opt_)));
  }

  uint64_t param_hash() override {
    uint64_t h = kFnv1a64Basis;
    for (const at::Tensor& p : pipe_->parameters()) h = HashTensor(p, h);
    return h;
  }
  // This stage's parameters by their full-model names (each stage hashes its own; FSDP gathers
  // them over the replicas: collective).
  uint64_t full_param_hash() override {
    auto hash = [this] {
      uint64_t h = kFnv1a64Basis;
      for (const auto& item : pipe_->stage_module()->named_parameters()) {
        h = HashNamed(item.key(), item.value(), h);
      }
      return h;
    };
    if (!fsdp_) return hash();
    auto full = fsdp_->summon_full_params(/*writeback=*/false);
    return hash();
  }

 private:
  int64_t micro_batches_;
  std::shared_ptr<comm::Communicator> tensor_;  // null without tensor parallelism
  pipe::PipeGrid grid_;
  std::unique_ptr<pipe::Pipe> pipe_;
  std::shared_ptr<fsdp::FullyShardedDataParallelImpl> fsdp_;  // null: whole stages
  torch::optim::Adam opt_;
  int64_t vocab_;
  int64_t num_params_;
  std::string label_;
};


}  // namespace

absl::StatusOr<std::unique_ptr<ParallelModel>> MakePipeModel(
    const TrainConfig& config, const GptConfig& model_config,
    std::shared_ptr<comm::Communicator> comm, const torch::optim::AdamOptions& adam) {
  const int64_t stages = config.pipeline_stages;
  if (comm->size() % stages != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline_stages ", stages, " does not divide the world size ", comm->size(),
        " (each of world / pipeline_stages replicas runs the whole pipeline)"));
  }
  FS_ASSIGN_OR_RETURN(pipe::Schedule schedule, ParseSchedule(config.pipeline_schedule));
  const int64_t t = config.tensor_parallel;
  if (comm->size() % (stages * t) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline_stages ", stages, " x tensor_parallel ", t, " does not divide the world size ",
        comm->size()));
  }
  // The pipe's functions raise c10::Error; the configuration checks above and in
  // ValidateParallelConfig come first, so what they raise here is rare (a failed split).
  pipe::PipeGrid grid;
  std::shared_ptr<comm::Communicator> tensor_group;
  if (t > 1) {
    model_parallel::ParallelGrid g;
    try {
      g = model_parallel::MakeParallelGrid(comm, t, stages);
    } catch (const c10::Error& e) {
      return absl::UnknownError(absl::StrCat("grid: ", e.what_without_backtrace()));
    }
    grid = model_parallel::ToPipeGrid(g);
    tensor_group = g.tensor_group;
  } else {
    grid = pipe::MakePipeGrid(comm, stages);
  }
  // The same Gpt (so the same initial weights) as the unpipelined modes, its layers in order;
  // with tensor parallelism a TpGpt loaded from it.
  Gpt full(model_config);
  int64_t num_params = 0;
  for (const at::Tensor& p : full->parameters()) num_params += p.numel();
  std::shared_ptr<torch::nn::Module> source = full.ptr();
  if (t > 1) {
    model_parallel::TensorDict dense;
    for (const auto& item : full->named_parameters()) dense.insert(item.key(), item.value());
    try {
      TpGpt tp(model_config, tensor_group);  // outside any EnableWrap scope: plain blocks
      tp->load_dense_state_dict(dense);
      source = tp.ptr();
    } catch (const c10::Error& e) {
      return absl::UnknownError(
          absl::StrCat("tensor_parallel ", t, ": ", e.what_without_backtrace()));
    }
  }
  torch::nn::Sequential layers;
  // Pushes `m` as an `Impl` layer when it is one.
  const auto push = [&layers](const std::string& name, const std::shared_ptr<torch::nn::Module>& m,
                              auto* type) {
    using Impl = std::remove_pointer_t<decltype(type)>;
    auto typed = std::dynamic_pointer_cast<Impl>(m);
    if (typed) layers->push_back(name, typed);
    return typed != nullptr;
  };
  for (const auto& item : source->named_children()) {
    const std::shared_ptr<torch::nn::Module>& m = item.value();
    const std::string& n = item.key();
    if (!push(n, m, static_cast<EmbeddingsImpl*>(nullptr)) &&
        !push(n, m, static_cast<TransformerBlockImpl*>(nullptr)) &&
        !push(n, m, static_cast<LmHeadImpl*>(nullptr)) &&
        !push(n, m, static_cast<TpEmbeddingsImpl*>(nullptr)) &&
        !push(n, m, static_cast<TpTransformerBlockImpl*>(nullptr)) &&
        !push(n, m, static_cast<TpLmHeadImpl*>(nullptr))) {
      return absl::InternalError(absl::StrCat("pipeline mode: Gpt child '", item.key(),
                                              "' is not an embeddings, block or head layer"));
    }
  }
  FS_ASSIGN_OR_RETURN(pipe::CheckpointMode checkpoint,
                      ParsePipeCheckpoint(config.checkpoint_activations));
  FS_ASSIGN_OR_RETURN(fsdp::ShardingStrategy strategy, ParseStrategy(config.strategy));
  // Deterministic mode: each replica runs its M / replicas micro-batches as the pipe's chunks.
  const int64_t chunks = config.deterministic ? config.micro_batches / grid.replicas
                                              : config.pipeline_chunks;
  if (config.deterministic && config.micro_batches % grid.replicas != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--micro_batches=", config.micro_batches, " does not split over ", grid.replicas,
        " pipeline replicas"));
  }
  auto opts = pipe::PipeOptions()
                  .chunks(chunks)
                  .schedule(schedule)
                  .virtual_stages(config.pipeline_virtual_stages)
                  .checkpoint(checkpoint);
  if (config.deterministic) {
    opts.deterministic(true).replica(grid.replica).replicas(grid.replicas);
  }
  if (config.pipeline_balance == "size") {
    // Parameter bytes x 4 (parameter, gradient, Adam's two moments) + one micro-batch's
    // output bytes per layer, measured on a batch of the job's shape (the same on every rank).
    const at::Tensor sample = at::zeros({config.batch, config.seq}, at::kLong);
    try {
      opts.balance(pipe::balance_by_size(stages * config.pipeline_virtual_stages, layers, sample,
                                         config.pipeline_chunks, 4.0));
    } catch (const c10::Error& e) {
      // kUnknown: the code is the one in the message ("pipe::balance_by_size: INVALID_...").
      return absl::UnknownError(
          absl::StrCat("pipeline_balance size: ", e.what_without_backtrace()));
    }
  }
  if (strategy != fsdp::ShardingStrategy::kNoShard) {
    // bf16: each stage computes (and sends its boundary activations) in bf16 over f32 master
    // shards, gradients reduced in f32, like the unpipelined fsdp mode.
    FS_ASSIGN_OR_RETURN(c10::optional<c10::ScalarType> dtype, ParsePrecision(config.precision));
    fsdp::MixedPrecision mp;
    if (dtype) mp.param_dtype(dtype).reduce_dtype(at::kFloat);
    opts.wrap_stage(pipe::fsdp_stage(grid.data, fsdp::FsdpOptions()
                                                    .sharding_strategy(strategy)
                                                    .mixed_precision(mp)
                                                    .flatten_parameters(t == 1)));
  }
  std::unique_ptr<pipe::Pipe> p;
  try {
    p = pipe::Pipe::Create(layers, grid.pipe, opts);
  } catch (const c10::Error& e) {
    return absl::UnknownError(
        absl::StrCat("pipeline_stages ", stages, ": ", e.what_without_backtrace()));
  }
  std::string balance;
  for (int64_t n : p->balance()) absl::StrAppend(&balance, balance.empty() ? "" : "+", n);
  const std::string label = absl::StrCat(
      t > 1 ? absl::StrCat("tensor parallel ", t, " x ") : std::string(), "pipe ", stages,
      " stages",
      config.pipeline_virtual_stages > 1
          ? absl::StrCat(" x ", config.pipeline_virtual_stages, " virtual")
          : std::string(),
      " (layers ", balance, ") x ", grid.replicas, " replica",
      grid.replicas == 1 ? "" : "s",
      strategy == fsdp::ShardingStrategy::kNoShard
          ? std::string(" (all-reduce)")
          : absl::StrCat(" (FSDP ", fsdp::ShardingStrategyName(strategy), ")"),
      ", ", config.pipeline_schedule, ", ", chunks, " micro-batches",
      config.deterministic ? " (deterministic)" : "");
  const int64_t vocab = model_config.vocab();
  return std::unique_ptr<ParallelModel>(std::make_unique<PipeModel>(
      std::move(grid), std::move(p), vocab, num_params, adam, label,
      config.deterministic ? config.micro_batches : 0, std::move(tensor_group)));
}

}  // namespace fairscale::examples::gpt::internal
