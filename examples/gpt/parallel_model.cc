#include "examples/gpt/parallel_model.h"

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
#include <limits>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/torch_error.h"
#include "examples/gpt/parallel_model_internal.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/wrap.h"
#include "offload/offloaded_optimizer.h"
#include "oss/oss.h"
#include "oss/sharded_data_parallel.h"
#include "pipe/balance.h"
#include "pipe/fsdp_stage.h"
#include "pipe/grid.h"
#include "pipe/pipe.h"
#include "train_state/fsdp_item.h"
#include "train_state/items.h"

namespace fairscale::examples::gpt {
namespace internal {


absl::StatusOr<fsdp::ShardingStrategy> ParseStrategy(const std::string& s) {
  if (s == "full_shard") return fsdp::ShardingStrategy::kFullShard;
  if (s == "shard_grad_op") return fsdp::ShardingStrategy::kShardGradOp;
  if (s == "no_shard") return fsdp::ShardingStrategy::kNoShard;
  if (s == "hybrid_shard") return fsdp::ShardingStrategy::kHybridShard;
  if (s == "hybrid_shard_zero2") return fsdp::ShardingStrategy::kHybridShardZero2;
  return absl::InvalidArgumentError(
      absl::StrCat("strategy '", s,
                   "': expected full_shard, shard_grad_op, no_shard, hybrid_shard or "
                   "hybrid_shard_zero2"));
}

absl::StatusOr<c10::optional<c10::ScalarType>> ParsePrecision(const std::string& p) {
  if (p == "bf16") return c10::optional<c10::ScalarType>(at::kBFloat16);
  if (p == "fp16") return c10::optional<c10::ScalarType>(at::kHalf);
  if (p == "fp32") return c10::optional<c10::ScalarType>();
  return absl::InvalidArgumentError(
      absl::StrCat("precision '", p, "': expected bf16, fp16 or fp32"));
}

absl::StatusOr<oss::PartitionMode> ParsePartition(const std::string& p) {
  if (p == "greedy") return oss::PartitionMode::kGreedy;
  if (p == "flat") return oss::PartitionMode::kFlat;
  return absl::InvalidArgumentError(
      absl::StrCat("oss_partition '", p, "': expected greedy or flat"));
}

absl::StatusOr<pipe::Schedule> ParseSchedule(const std::string& s) {
  if (s == "1f1b") return pipe::Schedule::k1F1B;
  if (s == "gpipe") return pipe::Schedule::kGPipe;
  if (s == "interleaved") return pipe::Schedule::kInterleaved1F1B;
  return absl::InvalidArgumentError(
      absl::StrCat("pipeline_schedule '", s, "': expected 1f1b, gpipe or interleaved"));
}

// --checkpoint_activations in pipeline mode: the pipe checkpoints whole stages per micro-batch.
absl::StatusOr<pipe::CheckpointMode> ParsePipeCheckpoint(const std::string& s) {
  if (s == "none") return pipe::CheckpointMode::kNever;
  if (s == "all") return pipe::CheckpointMode::kAlways;
  if (s == "except_last") return pipe::CheckpointMode::kExceptLast;
  return absl::InvalidArgumentError(absl::StrCat(
      "checkpoint_activations '", s,
      "' with pipeline_stages > 1: expected none, all or except_last (the pipe checkpoints a "
      "stage's forward per micro-batch: all of them, or all but the last; every:K is per "
      "block)"));
}

// Sum of `value` over `comm` (collective).
double AllReduceSum(comm::Communicator& comm, double value, const char* what) {
  double total = 0;
  const absl::Status st = comm.AllReduce(comm::MakeConstBuffer(&value, 1),
                                         comm::MakeBuffer(&total, 1), comm::ReduceOp::kSum)
                              .Wait();
  base::ThrowIfError(st, what);
  return total;
}



uint64_t HashTensor(const at::Tensor& t, uint64_t h) {
  at::Tensor c = t.detach().contiguous();
  return Fnv1a64(c.data_ptr(), c.numel() * c.element_size(), h);
}

uint64_t HashNamed(const std::string& name, const at::Tensor& t, uint64_t h) {
  return HashTensor(t, Fnv1a64(name.data(), name.size(), h));
}

}  // namespace internal

using internal::AllReduceSum;
using internal::Fnv1a64;
using internal::kFnv1a64Basis;
using internal::HashNamed;
using internal::HashTensor;
using internal::ParsePartition;
using internal::ParsePipeCheckpoint;
using internal::ParsePrecision;
using internal::ParseSchedule;
using internal::ParseStrategy;


at::Tensor ParallelModel::loss(const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "ParallelModel::loss: only the pipeline mode computes the loss itself");
}

absl::StatusOr<int64_t> ParseCheckpointActivations(const std::string& value) {
  if (value == "none") return 0;
  if (value == "all") return 1;
  int64_t k = 0;
  if (absl::StartsWith(value, "every:") && absl::SimpleAtoi(value.substr(6), &k) && k >= 1) {
    return k;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "checkpoint_activations '", value,
      "': expected none, all or every:K with K >= 1 (checkpoint block i when i % K == 0)"));
}


namespace {

// Copies an optimizer's state through torch's archive (OffloadedAdam <-> torch::optim::Adam:
// the same layout, bitwise). Both must step the same parameters in the same order.
void CopyOptimizer(const torch::optim::Optimizer& from, torch::optim::Optimizer& to) {
  torch::serialize::OutputArchive out;
  from.save(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  std::istringstream in_bytes(bytes.str());
  torch::serialize::InputArchive in;
  in.load_from(in_bytes);
  to.load(in);
}

// fsdp_item for a model whose Adam state lives on the disk tier (offload::OffloadedAdam): the
// snapshot copies the state into an in-memory torch::optim::Adam (the same archive layout,
// bitwise) and snapshots that, then drops its state; a restore stages into that Adam and, when
// applied, copies it back. So its checkpoints are fsdp_item's ("fsdp_sharded"), and a run may
// resume with or without --optimizer_offload. The whole state is in memory during a snapshot and
// a restore (as it is for OffloadedAdam's own archive save / load).
class OffloadedFsdpItem final : public train_state::Stateful {
 public:
  OffloadedFsdpItem(fsdp::FullyShardedDataParallel model, offload::OffloadedAdam& offloaded,
                    const torch::optim::AdamOptions& adam)
      : offloaded_(offloaded),
        staging_(std::make_unique<torch::optim::Adam>(model->parameters(), adam)),
        inner_(train_state::fsdp_item(std::move(model), staging_.get())) {}
  std::string kind() const override { return inner_->kind(); }
  std::unique_ptr<Snapshot> snapshot(const train_state::SaveContext& context,
                                     std::unique_ptr<Snapshot> reuse) override {
    CopyOptimizer(offloaded_, *staging_);
    std::unique_ptr<Snapshot> snap = inner_->snapshot(context, std::move(reuse));
    staging_->state().clear();  // the snapshot holds its own copy
    return snap;
  }
  std::function<void()> restore(const train_state::RestoreContext& context) override {
    std::function<void()> apply = inner_->restore(context);
    return [this, apply] {
      apply();
      CopyOptimizer(*staging_, offloaded_);
      staging_->state().clear();
    };
  }

 private:
  offload::OffloadedAdam& offloaded_;
  std::unique_ptr<torch::optim::Adam> staging_;
  std::shared_ptr<train_state::Stateful> inner_;
};

// This rank's experts of a mixture-of-experts Gpt (GptConfig::moe_experts), which FSDP leaves
// alone (FsdpOptions::ignored_modules): registered by global index ("block1.expert2") for the
// checkpoint, their gradients scaled by 1 / world by a hook (each expert's gradient sums every
// rank's tokens' contributions, while FSDP averages the other gradients over the ranks), and an
// Adam of their own.
class LocalExperts {
 public:
  LocalExperts(const GptExperts& experts, const GptConfig& config, const comm::Communicator& comm,
               const torch::optim::AdamOptions& adam)
      : holder_(std::make_shared<torch::nn::Module>()), world_(comm.size()) {
    const int64_t local = config.moe_experts() / comm.size();
    for (size_t j = 0; j < experts.per_block.size(); ++j) {
      for (size_t l = 0; l < experts.per_block[j].size(); ++l) {
        const int64_t global = comm.rank() * local + static_cast<int64_t>(l);
        holder_->register_module(absl::StrCat("block", 2 * j + 1, "_expert", global),
                                 experts.per_block[j][l].ptr());
      }
    }
    const double scale = 1.0 / world_;
    for (at::Tensor& p : holder_->parameters()) {
      p.register_hook([scale](const at::Tensor& g) { return g * scale; });
      local_numel_ += p.numel();
    }
    opt_ = std::make_unique<torch::optim::Adam>(holder_->parameters(), adam);
  }

  torch::optim::Optimizer& optimizer() { return *opt_; }
  std::vector<at::Tensor> parameters() const { return holder_->parameters(); }
  int64_t total_numel() const { return local_numel_ * world_; }
  double grad_square_sum() const {
    double sq = 0;
    for (const at::Tensor& p : holder_->parameters()) {
      if (p.grad().defined()) sq += p.grad().to(at::kDouble).pow(2).sum().item<double>();
    }
    return sq;
  }
  // Each rank's experts and their Adam state, as a pipeline's stages (one directory per rank):
  // restorable at the same rank count; another one is an error naming both.
  void add_state(train_state::TrainState& state, int rank) {
    state
        .add("experts", train_state::stage_item(rank, world_, 0, 1,
                                                train_state::module_item(holder_)))
        .add("expert_optimizer", train_state::stage_item(rank, world_, 0, 1,
                                                         train_state::optimizer_item(*opt_)));
  }
  // FNV-1a 64 of this rank's experts by their global names.
  uint64_t hash(uint64_t h) const {
    for (const auto& item : holder_->named_parameters()) h = HashNamed(item.key(), item.value(), h);
    return h;
  }
  const std::shared_ptr<torch::nn::Module>& holder() const { return holder_; }

 private:
  std::shared_ptr<torch::nn::Module> holder_;
  int world_;
  int64_t local_numel_ = 0;
  std::unique_ptr<torch::optim::Adam> opt_;
};

// FSDP: the embeddings, every block and the head each their own unit under a parameterless root;
// Adam over the units' f32 master shards. With experts, those stay on their rank (LocalExperts).
class FsdpModel final : public ParallelModel {
 public:
  FsdpModel(fsdp::FullyShardedDataParallel model, std::unique_ptr<torch::optim::Optimizer> opt,
            torch::optim::AdamOptions adam, std::string label, Gpt gpt = Gpt(nullptr),
            std::unique_ptr<LocalExperts> experts = nullptr, uint64_t seed = 0)
      : model_(std::move(model)),
        opt_(std::move(opt)),
        adam_(std::move(adam)),
        label_(std::move(label)),
        gpt_(std::move(gpt)),
        experts_(std::move(experts)),
        seed_(seed) {
    for (const auto& info : model_->flat_param_info()) num_params_ += info.numel;
    for (auto* unit : model_->fsdp_units()) {
      if (unit == model_.get()) continue;
      for (const auto& info : unit->flat_param_info()) num_params_ += info.numel;
    }
    if (experts_) num_params_ += experts_->total_numel();
  }

  at::Tensor forward(const at::Tensor& tokens) override { return model_(tokens); }
  torch::optim::Optimizer& optimizer() override { return *opt_; }
  torch::optim::Optimizer* expert_optimizer() override {
    return experts_ ? &experts_->optimizer() : nullptr;
  }
  // The gates' noise for this step and rank: a function of (seed, step, rank) only.
  void start_step(int64_t step) override {
    if (!experts_) return;
    uint64_t h = Fnv1a64(&seed_, sizeof(seed_), kFnv1a64Basis);
    h = Fnv1a64(&step, sizeof(step), h);
    const int rank = model_->rank();
    gpt_->seed_moe_noise(Fnv1a64(&rank, sizeof(rank), h));
  }
  at::Tensor aux_loss() override { return experts_ ? gpt_->aux_loss() : at::Tensor(); }
  void zero_grad() override {
    opt_->zero_grad();
    if (experts_) experts_->optimizer().zero_grad();
  }
  // With experts: FSDP's norm of its shards (max_norm infinity: computed, nothing scaled) and
  // the experts' squared norms summed over the ranks, then both scaled as clip_grad_norm_ would.
  void clip_grad_norm(double max_norm) override {
    if (!experts_) {
      model_->clip_grad_norm_(max_norm);
      return;
    }
    const double fsdp_norm =
        model_->clip_grad_norm_(std::numeric_limits<double>::infinity()).item<double>();
    const double total = std::sqrt(
        fsdp_norm * fsdp_norm +
        AllReduceSum(*model_->communicator(), experts_->grad_square_sum(),
                     "clip_grad_norm: the experts' squared norm over the ranks"));
    const double coef = max_norm / (total + 1e-6);
    if (coef >= 1) return;
    torch::NoGradGuard no_grad;
    for (const std::vector<at::Tensor>& params : {model_->parameters(), experts_->parameters()}) {
      for (const at::Tensor& p : params) {
        if (p.grad().defined()) p.grad().mul_(coef);
      }
    }
  }
  int64_t num_params() const override { return num_params_; }
  std::string label() const override { return label_; }
  fsdp::FullyShardedDataParallel* fsdp_root() override { return &model_; }

  // The sharded model and its Adam (fsdp_item: restorable at any world size). An OffloadedAdam
  // is staged through an in-memory torch::optim::Adam of the same archive layout. Experts: see
  // LocalExperts::add_state.
  void add_state(train_state::TrainState& state) override {
    if (auto* offloaded = dynamic_cast<offload::OffloadedAdam*>(opt_.get())) {
      state.add("model", std::make_shared<OffloadedFsdpItem>(model_, *offloaded, adam_));
    } else {
      state.add("model", train_state::fsdp_item(model_, opt_.get()));
    }
    if (experts_) experts_->add_state(state, model_->rank());
  }

  uint64_t param_hash() override {
    uint64_t h = kFnv1a64Basis;
    for (const at::Tensor& p : model_->parameters()) h = HashTensor(p, h);
    return experts_ ? experts_->hash(h) : h;
  }
  // Gathers every unit's full parameters and hashes the original parameters (not the shards,
  // which differ between ranks) in a fixed order. With experts: then every rank's experts' hash,
  // gathered in rank order (collective), so every rank returns the same value.
  uint64_t full_param_hash() override {
    uint64_t h = kFnv1a64Basis;
    std::set<const c10::TensorImpl*> skip;
    if (experts_) {
      for (const at::Tensor& p : experts_->parameters()) skip.insert(p.unsafeGetTensorImpl());
    }
    {
      auto guard = model_->summon_full_params(/*writeback=*/false);
      for (fsdp::FullyShardedDataParallelImpl* u : model_->fsdp_units()) {
        for (const at::Tensor& p : u->parameters(/*recurse=*/false)) {
          skip.insert(p.unsafeGetTensorImpl());
        }
      }
      for (fsdp::FullyShardedDataParallelImpl* u : model_->fsdp_units()) {
        for (const auto& item : u->module()->named_parameters()) {
          if (skip.count(item.value().unsafeGetTensorImpl()) > 0) continue;
          h = HashNamed(item.key(), item.value(), h);
        }
      }
    }
    if (!experts_) return h;
    comm::Communicator& comm = *model_->communicator();
    const int64_t mine = static_cast<int64_t>(experts_->hash(kFnv1a64Basis));
    std::vector<int64_t> all(comm.size());
    base::ThrowIfError(comm.AllGather(comm::MakeConstBuffer(&mine, 1),
                                      comm::MakeBuffer(all.data(), all.size()))
                           .Wait(),
                       "full_param_hash: the experts' hashes");
    return Fnv1a64(all.data(), all.size() * sizeof(int64_t), h);
  }

 private:
  fsdp::FullyShardedDataParallel model_;
  std::unique_ptr<torch::optim::Optimizer> opt_;
  torch::optim::AdamOptions adam_;  // the defaults opt_ was built with
  std::string label_;
  Gpt gpt_;                                // set with experts only
  std::unique_ptr<LocalExperts> experts_;  // null for a dense model
  uint64_t seed_;
  int64_t num_params_ = 0;
};

// ZeRO-2: every rank holds the full fp32 model; OSS partitions the Adam state and
// ShardedDataParallel reduces each gradient to its owner only.
class SdpModel final : public ParallelModel {
 public:
  SdpModel(Gpt plain, std::shared_ptr<oss::OSS> opt, std::string label,
           oss::ShardedDataParallelOptions options)
      : plain_(std::move(plain)),
        oss_(std::move(opt)),
        sdp_(torch::nn::AnyModule(plain_), oss_, options),
        label_(std::move(label)) {}

  // Evaluation and sampling run the local replica: no ShardedDataParallel collectives.
  at::Tensor forward(const at::Tensor& tokens) override {
    return c10::GradMode::is_enabled() ? sdp_->forward(tokens) : plain_(tokens);
  }
  torch::optim::Optimizer& optimizer() override { return *oss_; }
  void zero_grad() override { oss_->zero_grad(); }
  void clip_grad_norm(double max_norm) override { oss_->clip_grad_norm(max_norm); }
  int64_t num_params() const override {
    int64_t n = 0;
    for (const at::Tensor& p : plain_->parameters()) n += p.numel();
    return n;
  }
  std::string label() const override { return label_; }

  // The replicated fp32 model (module_item: rank 0's copy) and the OSS Adam state consolidated
  // on rank 0 (oss_item: an unsharded Adam's archive); both restore at any world size.
  void add_state(train_state::TrainState& state) override {
    state.add("model", train_state::module_item(plain_.ptr()))
        .add("optimizer", train_state::oss_item(*oss_));
  }

  uint64_t param_hash() override {
    uint64_t h = kFnv1a64Basis;
    for (const at::Tensor& p : plain_->parameters()) h = HashTensor(p, h);
    return h;
  }
  uint64_t full_param_hash() override {  // every rank holds the full parameters
    uint64_t h = kFnv1a64Basis;
    for (const auto& item : plain_->named_parameters()) h = HashNamed(item.key(), item.value(), h);
    return h;
  }

 private:
  Gpt plain_;
  std::shared_ptr<oss::OSS> oss_;
  oss::ShardedDataParallel sdp_;
  std::string label_;
};


}  // namespace

absl::StatusOr<std::unique_ptr<ParallelModel>> MakeParallelModel(
    const TrainConfig& config, const GptConfig& model_config,
    std::shared_ptr<comm::Communicator> comm) {
  const auto adam = torch::optim::AdamOptions(config.lr).betas({0.9, 0.99});
  if (config.pipeline_stages > 1) {
    return internal::MakePipeModel(config, model_config, std::move(comm), adam);
  }
  if (config.tensor_parallel > 1) {
    return internal::MakeTpModel(config, model_config, std::move(comm), adam);
  }
  if (config.data_parallel == "sdp") {
    FS_ASSIGN_OR_RETURN(oss::PartitionMode partition, ParsePartition(config.oss_partition));
    Gpt plain(model_config);
    std::shared_ptr<oss::OSS> opt = oss::OSS::make<torch::optim::Adam>(
        plain->parameters(), adam, comm,
        oss::OssOptions().partition(partition).deterministic(config.deterministic));
    auto sdp_options = oss::ShardedDataParallelOptions();
    if (config.deterministic) sdp_options.deterministic(true).micro_batches(config.micro_batches);
    return std::unique_ptr<ParallelModel>(
        std::make_unique<SdpModel>(std::move(plain), std::move(opt),
                                   absl::StrCat("sdp/", config.oss_partition), sdp_options));
  }
  FS_ASSIGN_OR_RETURN(fsdp::ShardingStrategy strategy, ParseStrategy(config.strategy));
  FS_ASSIGN_OR_RETURN(c10::optional<c10::ScalarType> dtype, ParsePrecision(config.precision));
  fsdp::MixedPrecision mp;
  // Compute and all-gather in `dtype`; reduce gradients in f32 (FairScale's
  // fp32_reduce_scatter): the shards the optimizer steps are f32 master copies either way.
  if (dtype) mp.param_dtype(dtype).reduce_dtype(at::kFloat);
  auto opts = fsdp::FsdpOptions().sharding_strategy(strategy).mixed_precision(mp);
  if (config.deterministic) opts.deterministic(true).micro_batches(config.micro_batches);
  if (fsdp::IsHybrid(strategy)) {
    if (config.hybrid_shard_group_size > 0 && comm->size() % config.hybrid_shard_group_size != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("hybrid_shard_group_size ", config.hybrid_shard_group_size,
                       " does not divide the number of ranks ", comm->size()));
    }
    opts.hybrid_shard_group_size(static_cast<int>(config.hybrid_shard_group_size));
  }
  fsdp::FullyShardedDataParallel model{nullptr};
  Gpt gpt{nullptr};
  std::unique_ptr<LocalExperts> experts;
  std::shared_ptr<comm::Communicator> expert_comm;
  if (model_config.moe_experts() > 0) {
    // The experts' all-to-alls on a communicator of their own (the same ranks), so that they
    // never interleave with FSDP's collectives.
    FS_ASSIGN_OR_RETURN(expert_comm, comm->Split(0, comm->rank()));
  }
  try {
    // Experts first (before the rest of the model, as Gpt draws them), so FSDP can be told to
    // leave them alone.
    const GptExperts local = MakeGptExperts(model_config, *comm);
    if (model_config.moe_experts() > 0) opts.ignored_modules(local.modules());
    fsdp::EnableWrap scope(comm, opts, GptWrapPolicy());
    gpt = Gpt(model_config, expert_comm, local);
    model = fsdp::FullyShardedDataParallel(gpt, comm, opts);
    if (model_config.moe_experts() > 0) {
      experts = std::make_unique<LocalExperts>(local, model_config, *comm, adam);
    }
  } catch (const c10::Error& e) {
    return absl::UnknownError(absl::StrCat("model: ", e.what_without_backtrace()));
  }
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (config.optimizer_offload == "disk") {
    // The state of this rank's f32 shards on the disk tier, one file per rank.
    try {
      opt = std::make_unique<offload::OffloadedAdam>(
          std::vector{torch::optim::OptimizerParamGroup(model->parameters())}, adam,
          offload::OffloadOptions(config.offload_dir)
              .name(absl::StrCat("rank", comm->rank()))
              .chunk_bytes(config.offload_chunk_bytes));
    } catch (const c10::Error& e) {
      // kUnknown: the code is the one in the message ("OffloadedAdam: FAILED_PRECONDITION: ...").
      return absl::UnknownError(
          absl::StrCat("optimizer_offload disk: ", e.what_without_backtrace()));
    }
  } else {
    opt = std::make_unique<torch::optim::Adam>(model->parameters(), adam);
  }
  std::string label = config.strategy;
  if (experts) absl::StrAppend(&label, ", ", model_config.moe_experts(), " experts");
  return std::unique_ptr<ParallelModel>(std::make_unique<FsdpModel>(
      std::move(model), std::move(opt), adam, label, experts ? gpt : Gpt(nullptr),
      std::move(experts), config.seed));
}

absl::Status ValidateParallelConfig(const TrainConfig& config) {
  FS_ASSIGN_OR_RETURN(fsdp::ShardingStrategy strategy, ParseStrategy(config.strategy));
  if (config.hybrid_shard_group_size < 0 ||
      (config.hybrid_shard_group_size > 0 &&
       (!fsdp::IsHybrid(strategy) || config.data_parallel != "fsdp"))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hybrid_shard_group_size ", config.hybrid_shard_group_size,
        ": expected >= 0, and > 0 only with data_parallel fsdp and strategy hybrid_shard or "
        "hybrid_shard_zero2 (strategy ", config.strategy, ")"));
  }
  FS_RETURN_IF_ERROR(ParsePrecision(config.precision).status());
  FS_RETURN_IF_ERROR(ParsePartition(config.oss_partition).status());
  if (config.pipeline_stages > 1) {
    FS_RETURN_IF_ERROR(ParsePipeCheckpoint(config.checkpoint_activations).status());
  } else {
    FS_RETURN_IF_ERROR(ParseCheckpointActivations(config.checkpoint_activations).status());
  }
  if (config.optimizer_offload != "none" && config.optimizer_offload != "disk") {
    return absl::InvalidArgumentError(absl::StrCat("optimizer_offload '", config.optimizer_offload,
                                                   "': expected none or disk"));
  }
  if (config.optimizer_offload == "disk") {
    // OSS builds and consolidates its optimizers through Optimizer::state(), which an
    // OffloadedAdam keeps on its tier: not wired.
    if (config.data_parallel != "fsdp") {
      return absl::InvalidArgumentError(absl::StrCat(
          "optimizer_offload disk needs data_parallel fsdp, got ", config.data_parallel));
    }
    if (config.offload_dir.empty()) {
      return absl::InvalidArgumentError("optimizer_offload disk needs an offload_dir");
    }
    if (config.offload_chunk_bytes < 4) {
      return absl::InvalidArgumentError(absl::StrCat(
          "offload_chunk_bytes must be >= 4 (one f32), got ", config.offload_chunk_bytes));
    }
  }
  if (config.pipeline_stages < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline_stages must be >= 1 (1: no pipeline), got ", config.pipeline_stages));
  }
  if (config.tensor_parallel < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor_parallel must be >= 1 (1: no tensor parallelism), got ", config.tensor_parallel));
  }
  if (config.tensor_parallel > 1) {
    const std::string p = absl::StrCat("tensor_parallel ", config.tensor_parallel, ": ");
    if (config.data_parallel != "fsdp" || fsdp::IsHybrid(strategy)) {
      return absl::InvalidArgumentError(absl::StrCat(
          p, "FSDP shards the slices over the replicas: needs data_parallel fsdp with strategy "
          "full_shard, shard_grad_op or no_shard, got data_parallel ", config.data_parallel,
          ", strategy ", config.strategy));
    }
    if (config.precision != "fp32") {
      return absl::InvalidArgumentError(
          absl::StrCat(p, "precision must be fp32, got ", config.precision));
    }
    if (config.pipeline_stages > 1 && config.pipeline_balance != "even") {
      return absl::InvalidArgumentError(absl::StrCat(
          p, "with pipeline_stages > 1 needs pipeline_balance even (balance by size would run "
          "the tensor-parallel layers outside the pipe), got ", config.pipeline_balance));
    }
    if (config.deterministic || config.loss_scale || config.optimizer_offload != "none" ||
        config.checkpoint_activations != "none") {
      return absl::InvalidArgumentError(absl::StrCat(
          p, "--deterministic, --loss_scale, --optimizer_offload and --checkpoint_activations "
          "are not supported with tensor parallelism yet"));
    }
    if (config.heads % config.tensor_parallel != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          p, "does not divide heads ", config.heads, " (each rank holds heads / T heads)"));
    }
  }
  if (config.moe_experts < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("moe_experts must be >= 0 (0: dense), got ", config.moe_experts));
  }
  if (config.moe_experts > 0) {
    const std::string p = absl::StrCat("moe_experts ", config.moe_experts, ": ");
    if (config.blocks < 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          p, "needs blocks >= 2 (every odd block is MoE), got ", config.blocks));
    }
    if (config.data_parallel != "fsdp" || config.pipeline_stages != 1 ||
        config.tensor_parallel != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          p, "needs data_parallel fsdp without pipeline or tensor parallelism, got data_parallel ",
          config.data_parallel, ", pipeline_stages ", config.pipeline_stages,
          ", tensor_parallel ", config.tensor_parallel));
    }
    if (config.deterministic || config.loss_scale || config.optimizer_offload != "none" ||
        config.checkpoint_activations != "none") {
      return absl::InvalidArgumentError(absl::StrCat(
          p, "--deterministic, --loss_scale, --optimizer_offload and --checkpoint_activations "
          "are not supported with experts (a recomputed MoE block would route again)"));
    }
    if (!(config.moe_aux_loss_coef >= 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "moe_aux_loss_coef must be >= 0, got ", config.moe_aux_loss_coef));
    }
  }
  if (config.deterministic && config.data_parallel == "sdp" && config.oss_partition != "greedy") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--deterministic with data_parallel sdp needs oss_partition greedy (whole tensors per "
        "rank), got ", config.oss_partition));
  }
  if (config.deterministic && config.pipeline_stages > 1 && config.strategy != "no_shard") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--deterministic with pipeline_stages > 1 needs strategy no_shard (whole stages whose "
        "gradients are reduced over the replicas); FSDP inside the stages (strategy ",
        config.strategy, ") is not supported in deterministic mode yet"));
  }
  if (config.pipeline_stages == 1 && config.pipeline_virtual_stages != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline_virtual_stages ", config.pipeline_virtual_stages,
        " needs pipeline_stages > 1 (it cuts each rank's part of the pipeline into chunks)"));
  }
  if (config.pipeline_stages > 1) {
    const std::string p = absl::StrCat("pipeline_stages ", config.pipeline_stages, ": ");
    FS_RETURN_IF_ERROR(ParseSchedule(config.pipeline_schedule).status());
    // (Deterministic mode derives the chunks: micro_batches / replicas, of `batch` rows each.)
    if (!config.deterministic &&
        (config.pipeline_chunks < 1 || config.pipeline_chunks > config.batch)) {
      return absl::InvalidArgumentError(absl::StrCat(
          p, "pipeline_chunks must be in [1, batch = ", config.batch, "], got ",
          config.pipeline_chunks));
    }
    if (config.pipeline_virtual_stages < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          p, "pipeline_virtual_stages must be >= 1, got ", config.pipeline_virtual_stages));
    }
    const std::string schedule_error =
        pipe::ValidateSchedule(*ParseSchedule(config.pipeline_schedule), config.pipeline_stages,
                               config.pipeline_chunks, config.pipeline_virtual_stages);
    if (!schedule_error.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          p, "pipeline_schedule ", config.pipeline_schedule, ", pipeline_virtual_stages ",
          config.pipeline_virtual_stages, ", pipeline_chunks ", config.pipeline_chunks, ": ",
          schedule_error));
    }
    if (config.pipeline_stages * config.pipeline_virtual_stages > config.blocks + 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          p, "more stages", config.pipeline_virtual_stages > 1 ? " x virtual stages" : "",
          " than layers (embed + ", config.blocks, " blocks + lm_head)"));
    }
    if (config.precision != "fp32" &&
        (config.precision != "bf16" || config.strategy == "no_shard")) {
      return absl::InvalidArgumentError(absl::StrCat(
          p, "precision must be fp32, or bf16 with FSDP inside the stages (strategy full_shard "
          "or shard_grad_op: f32 master shards, bf16 compute and boundary activations); got "
          "precision ", config.precision, ", strategy ", config.strategy));
    }
    if (config.data_parallel != "fsdp") {
      return absl::InvalidArgumentError(absl::StrCat(
          p, "the replicas of a stage shard it with FSDP (strategy full_shard or shard_grad_op) "
          "or all-reduce its gradients (strategy no_shard): needs data_parallel fsdp, got ",
          config.data_parallel));
    }
    if (fsdp::IsHybrid(strategy)) {
      return absl::InvalidArgumentError(absl::StrCat(
          p, "strategy ", config.strategy, " is not wired for the pipeline's replicas (use "
          "full_shard, shard_grad_op or no_shard)"));
    }
    if (config.pipeline_virtual_stages > 1 && strategy != fsdp::ShardingStrategy::kNoShard) {
      return absl::InvalidArgumentError(absl::StrCat(
          p, "pipeline_virtual_stages ", config.pipeline_virtual_stages,
          " needs strategy no_shard (FSDP inside a stage wraps one stage per rank, not its "
          "chunks), got strategy ", config.strategy));
    }
    if (config.pipeline_balance != "even" && config.pipeline_balance != "size") {
      return absl::InvalidArgumentError(absl::StrCat(
          p, "pipeline_balance '", config.pipeline_balance, "': expected even or size"));
    }
    if (config.loss_scale || config.optimizer_offload != "none") {
      return absl::InvalidArgumentError(
          absl::StrCat(p, "loss_scale and optimizer_offload are not supported with a pipeline"));
    }
  }
  if (config.data_parallel != "fsdp" && config.data_parallel != "sdp") {
    return absl::InvalidArgumentError(
        absl::StrCat("data_parallel '", config.data_parallel, "': expected fsdp or sdp"));
  }
  if (config.data_parallel == "sdp" && config.precision != "fp32") {
    return absl::InvalidArgumentError(absl::StrCat(
        "data_parallel sdp trains the fp32 model (no mixed precision): precision must be fp32, "
        "got ", config.precision));
  }
  if (config.precision == "fp16") {
    // The job runs on CPU tensors, and LibTorch 1.13's CPU LayerNorm has no Half kernel
    // ("LayerNormKernelImpl" not implemented for 'Half'): fail before launching anything.
    return absl::InvalidArgumentError(
        "precision fp16: LibTorch's CPU LayerNorm has no float16 kernel; use bf16 or fp32");
  }
  return absl::OkStatus();
}

}  // namespace fairscale::examples::gpt
