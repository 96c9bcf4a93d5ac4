// The GPT job's data-parallel model and optimizer (//examples/gpt:parallel_model): one interface
// over the modes of TrainConfig::data_parallel, so that the training loop (trainer.cc) is written
// once. "fsdp": the Gpt with its GptWrapPolicy units under a FullyShardedDataParallel root and an
// Adam over the f32 master shards (in memory, or offload::OffloadedAdam with the state on the disk
// tier); "sdp": the plain fp32 Gpt under oss::ShardedDataParallel with
// an oss::OSS Adam (ZeRO-2); with TrainConfig::pipeline_stages > 1, "pipe": the Gpt as a
// torch::nn::Sequential (embed, block0.., lm_head) cut into stages by pipe::Pipe, one stage per
// rank, world / stages replicas (pipe::MakePipeGrid) sharding each stage with FSDP
// (pipe::fsdp_stage; fp32 or bf16 over f32 masters) or averaging its gradients (no_shard, fp32),
// an Adam per stage. The pipe mode computes the loss itself (computes_loss()), since no rank holds the
// logits of the whole model. With TrainConfig::tensor_parallel T > 1, "tensor parallel"
// (tp_parallel_model.cc): a TpGpt (tp_model.h) per group of T consecutive ranks, loaded from the
// dense Gpt, world / T replicas all-reducing their gradients; it also computes the loss itself
// (vocab-parallel cross-entropy). Each mode also says which //train_state items checkpoint it
// (add_state) and what its parameter hashes cover. Used by the trainer only.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "examples/gpt/model.h"
#include "examples/gpt/trainer.h"
#include "train_state/stateful.h"

namespace fairscale::fsdp {
class FullyShardedDataParallel;
}  // namespace fairscale::fsdp

namespace fairscale::examples::gpt {

// Methods throw c10::Error / std::exception on failure (LibTorch, FSDP, OSS); the trainer
// converts them into a Status.
class ParallelModel {
 public:
  virtual ~ParallelModel() = default;

  // int64 tokens [batch, t] -> logits [batch, t, vocab]. With grad enabled this is the training
  // forward (collective in both modes); under NoGradGuard it is the evaluation forward (sdp runs
  // the local replica without collectives; FSDP's forward is collective either way, so every rank
  // must call it in lockstep).
  virtual at::Tensor forward(const at::Tensor& tokens) = 0;
  // Pipeline and tensor-parallel modes (computes_loss() true; the pipeline's forward() then
  // throws, the tensor-parallel one gathers the logits on the tensor group): tokens [batch, t] and
  // targets [batch, t] -> the mean cross-entropy over the batch (detached, 0-dim f32, the same on
  // every stage of the pipe / rank of the tensor group). With grad enabled it is a training step
  // whose backward is done: the gradients are accumulated in this rank's parameters and averaged
  // over the replicas (do not call backward()); under NoGradGuard an evaluation. Collective in
  // both cases.
  virtual bool computes_loss() const { return false; }
  virtual at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets);
  // Which rank's batch (TokenData::Batch) this rank trains on, and how many distinct batches a
  // step trains on: the rank and the world size, or in pipeline mode the replica and the
  // replica count (every stage of a pipe reads the same batch).
  virtual int data_rank(int rank) const { return rank; }
  virtual int data_replicas(int world) const { return world; }
  // The optimizer stepping this rank's parameters (FSDP shards, or the OSS wrapper). Its param
  // groups carry AdamOptions (the trainer sets the learning rate there).
  virtual torch::optim::Optimizer& optimizer() = 0;
  // Mixture of experts: the Adam of this rank's own experts (no data-parallel wrapper holds
  // them), stepped together with optimizer(); null otherwise.
  virtual torch::optim::Optimizer* expert_optimizer() { return nullptr; }
  // Mixture of experts: called before each training step's forward (seeds the gates' noise for
  // the step); the gates' load-balancing loss of the last forward (undefined without experts).
  virtual void start_step(int64_t step) { (void)step; }
  virtual at::Tensor aux_loss() { return {}; }
  virtual void zero_grad() = 0;
  // Clips the global gradient norm over all ranks (collective).
  virtual void clip_grad_norm(double max_norm) = 0;
  // Elements of the whole model (not this rank's shard).
  virtual int64_t num_params() const = 0;
  // For the banner and the plot title: the FSDP strategy, or "sdp/<partition>".
  virtual std::string label() const = 0;
  // The fsdp mode's FSDP root (null in the other modes): for a loop that drives the FSDP
  // module itself (--fault_tolerant: ft::FaultTolerantHsdp).
  virtual fsdp::FullyShardedDataParallel* fsdp_root() { return nullptr; }

  // Adds this mode's items to the job's training state (//train_state; every rank adds the same
  // names): fsdp "model" (fsdp_item: the sharded model and its Adam); sdp "model" (module_item)
  // and "optimizer" (oss_item); pipeline "model" (stage_item of fsdp_item, or of module_item)
  // and, with whole stages, "optimizer" (stage_item of optimizer_item). All of them restore at
  // any world size (a pipeline: with the same pipeline_stages). The items refer to this model.
  virtual void add_state(train_state::TrainState& state) = 0;

  // FNV-1a 64 of this rank's parameters as the optimizer steps them (FSDP: the f32 shards).
  virtual uint64_t param_hash() = 0;
  // FNV-1a 64 of the full parameters by name (gathered under FSDP: collective).
  virtual uint64_t full_param_hash() = 0;
};

// Builds the mode's model (weights from torch's global generator: seed it first, identically on
// every rank) and its optimizer. `config` must have passed Validate().
absl::StatusOr<std::unique_ptr<ParallelModel>> MakeParallelModel(
    const TrainConfig& config, const GptConfig& model_config,
    std::shared_ptr<comm::Communicator> comm);

// The checks of TrainConfig::Validate() that concern the parallel mode, precision, strategy,
// activation checkpointing and optimizer offload (kInvalidArgument naming the field and the
// accepted values).
absl::Status ValidateParallelConfig(const TrainConfig& config);

// TrainConfig::checkpoint_activations -> GptConfig::checkpoint_every_k:
// "none" -> 0, "all" -> 1, "every:K" (K >= 1) -> K.
absl::StatusOr<int64_t> ParseCheckpointActivations(const std::string& value);

}  // namespace fairscale::examples::gpt
