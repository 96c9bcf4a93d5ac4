// One rank of the GPT training job (//examples/gpt:trainer): the loop that //examples:train_gpt
// runs on every rank, kept out of the binary so that tests and other launchers can run it.
//
//   absl::StatusOr<TrainResult> r = TrainRank(config, comm);  // every rank, same config
//
// The model is examples/gpt/model.h's Gpt with the embeddings, every transformer block and the
// head each its own FSDP unit (GptWrapPolicy) under a parameterless root; the data are the embedded corpus at character level (examples/gpt/data.h), the
// batch of (step, rank) a pure function of (seed, step, rank). Rank 0 prints the progress line
// and writes the metrics (JSON lines), the loss plot (SVG) and the sample; every rank writes its
// part of each checkpoint (//train_state's CheckpointManager; examples/gpt/checkpoints.h for what
// the job adds: the config and parameter hash in the marker, the resume policy).
// Resuming from a checkpoint gives bitwise the same losses and parameters as a run that was
// never interrupted: the data, the learning-rate schedule and the sampling depend only on the
// step and the seed, and the checkpoint holds the parameters and the optimizer state.
// Every mode's checkpoints restore at another world size (ParallelModel::add_state): the per-rank batch stays (`batch` is part of ToJson()), rank r trains
// on the batch of (seed, step, r), so the global batch becomes world size x batch; the schedule
// continues from the step. Right after loading, the gathered full parameters must hash to the
// value the saving run recorded in the marker (kDataLoss otherwise), at any world size.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "comm/communicator.h"

namespace fairscale::examples::gpt {

enum class ResumeMode {
  kNever,     // start from step 0 (existing checkpoints are kept and eventually pruned)
  kAuto,      // resume from the newest complete checkpoint if there is one
  kRequired,  // resume from the newest complete checkpoint; error if there is none
};

// Sanity bounds of TrainConfig::Validate (memory is checked per machine by CheckBeforeLaunch).
inline constexpr int64_t kMaxDim = 1 << 20;  // batch, seq, width, blocks, heads, chunks
inline constexpr int kMaxThreads = 1024;     // when the core count is unknown

struct TrainConfig {
  // Model and data.
  int64_t steps = 400;  // the step this run ends at (and, from step 0, the schedule's length)
  // The learning-rate schedule's length: 0 = `steps`. A resume sets it to the checkpoint's
  // (ResumeScheduleSteps): the schedule is the one of the run that started at step 0, so a run
  // extended past it (--resume with a larger `steps`) holds the final learning rate.
  int64_t schedule_steps = 0;
  int64_t batch = 16;   // sequences per rank per step
  int64_t seq = 64;     // tokens per sequence (= context length)
  int64_t width = 128;
  int64_t blocks = 4;
  int64_t heads = 4;
  uint64_t seed = 1234;
  // Optimizer: Adam, linear warmup to lr then cosine decay to lr * min_lr_ratio at `steps`.
  double lr = 3e-3;
  int64_t warmup_steps = 20;
  double min_lr_ratio = 0.1;
  double grad_clip = 1.0;  // max global grad norm; 0 = off
  // Data parallelism: "fsdp" (FullyShardedDataParallel over GptWrapPolicy units, `strategy`)
  // or "sdp" (the plain model under oss::ShardedDataParallel with an oss::OSS Adam partitioned
  // by `oss_partition` (greedy | flat): ZeRO-2). sdp computes in fp32 (precision must be fp32);
  // its checkpoints hold the full parameters (train_state::module_item) and the OSS state
  // consolidated on rank 0 (oss_item), resumable at any world size and partition.
  std::string data_parallel = "fsdp";
  std::string oss_partition = "greedy";
  // Dynamic loss scaling (amp::ShardedGradScaler over the job's communicator): the loss is
  // scaled before backward, the gradients unscaled before clipping, a step with inf/NaN
  // gradients skipped on every rank. The scaler's state (scale, growth tracker) is saved in
  // each checkpoint (the "trainer" item) and restored on resume.
  bool loss_scale = false;
  // Activation checkpointing of the transformer blocks: "none", "all" or "every:K" (block i when
  // i % K == 0, so "every:1" = "all", "every:2" = blocks 0, 2, ...). A checkpointed block keeps
  // only its input in forward and recomputes its forward in backward (checkpoint::
  // CheckpointWrapper; under FSDP inside the block's unit). It changes memory and time, not the
  // numbers (bitwise; the model has no randomness in its forward), so it is not part of ToJson():
  // a run may resume with another setting.
  std::string checkpoint_activations = "none";
  // Optimizer offload: "none" (Adam's state in memory) or "disk" (fsdp only): the Adam state of
  // this rank's f32 shards lives in <offload_dir>/rank<r>.fso on the disk tier and is streamed
  // through memory `offload_chunk_bytes` at a time (offload::OffloadedAdam). The same update
  // expressions as torch::optim::Adam, bitwise, and checkpoints keep Adam's archive layout, so it
  // is not part of ToJson(): a run may resume with the other setting. The .fso files are scratch
  // (rewritten at start; resume restores the state from the checkpoint).
  std::string optimizer_offload = "none";
  std::string offload_dir;
  int64_t offload_chunk_bytes = 4 << 20;
  // Pipeline parallelism (//pipe): with pipeline_stages > 1 the Gpt (embed, block0..,
  // lm_head) is cut into that many stages, one per rank: pipeline_balance "even" (by layer
  // count) or "size" (pipe::balance_by_size: 4 x parameter bytes + one micro-batch's output
  // bytes per layer). The world size must be a multiple of pipeline_stages, and
  // world / pipeline_stages replicas of the pipeline train on their own batches (replica k
  // reads the batch of rank k). The ranks holding the same stage either shard it with FSDP
  // (strategy full_shard / shard_grad_op: pipe::fsdp_stage, one FSDP unit per stage over its
  // replicas, gradients reduce-scattered per micro-batch) or keep it whole and average its
  // gradients (strategy no_shard: pipe::all_reduce_gradients). Each batch runs as
  // pipeline_chunks micro-batches (<= batch) in the pipeline_schedule (1f1b | gpipe |
  // interleaved). pipeline_virtual_stages V > 1 (interleaved only; pipeline_chunks a multiple of
  // pipeline_stages; strategy no_shard) cuts the model into stages x V virtual stages, rank r
  // holding r, r + N, ... (pipe::PipeOptions::virtual_stages; in ToJson() when > 1);
  // checkpoint_activations none | all | except_last maps onto the pipe's checkpoint modes
  // (never / always / all but the last micro-batch; every:K is rejected). Gradient clipping uses
  // the norm over the whole model. Needs data_parallel fsdp and precision fp32, or bf16 with FSDP
  // inside the stages (bf16 compute, boundary activations and their gradients over f32 master
  // shards, gradients reduced in f32); not supported (rejected by Validate): loss_scale,
  // optimizer_offload. Checkpoints (train_state::stage_item, "stage<s>/" of each item): with
  // FSDP, each stage's replicas write an fsdp sharded checkpoint; without, replica 0 of each
  // stage saves the stage's parameters and its Adam state; both resume with another number of
  // replicas (same stages and balance), bitwise. pipeline_stages (and pipeline_balance when not
  // even) are in ToJson(). No sample is drawn at the end (no rank holds the whole model).
  int64_t pipeline_stages = 1;
  int64_t pipeline_chunks = 4;
  std::string pipeline_schedule = "1f1b";
  std::string pipeline_balance = "even";
  int64_t pipeline_virtual_stages = 1;
  // Tensor parallelism (//model_parallel, examples/gpt/tp_model.h): with tensor_parallel T > 1
  // the ranks form a T x (world / T) grid (model_parallel::MakeParallelGrid(world, T, 1)): each
  // group of T consecutive ranks holds one TpGpt (heads, MLP columns and the vocabulary split T
  // ways) loaded from the dense Gpt of the job's seed, so the job trains the dense job's model;
  // replica k (ranks kT .. kT + T - 1) reads rank k's batch, the loss is the vocab-parallel
  // cross-entropy, FSDP (per parameter, every block a unit) shards each rank's slices over the
  // replicas with `strategy` full_shard or shard_grad_op, or averages the gradients (no_shard);
  // clipping uses the norm over the whole model, Adam steps each rank's shards. Checkpoints: one
  // FSDP checkpoint per tensor rank (stage_item), restorable with the same T at any replica
  // count. The sample at the end runs the gathered logits on every rank. T must divide the world
  // size, heads and the vocabulary. With pipeline_stages P > 1 the TpGpt's layers are the
  // pipeline's stages on a T x P x (world / TP) grid (pipe_model.cc; pipeline_balance even).
  // Needs data_parallel fsdp, a non-hybrid strategy and precision fp32; not supported yet
  // (rejected by Validate): deterministic, loss_scale, optimizer_offload,
  // checkpoint_activations. In ToJson() when > 1.
  int64_t tensor_parallel = 1;
  // Mixture of experts (//moe, GptConfig::moe_experts): with moe_experts E > 0 every odd block's
  // MLP is a Top2Gate MOELayer over E experts (each an MLP of hidden width 2 * width), E / world
  // experts on each rank (expert parallelism over all ranks: E must be divisible by the rank
  // count; blocks >= 2). FSDP shards everything else (FsdpOptions::ignored_modules keeps the
  // experts out); each rank steps its experts with an Adam of its own, their gradients scaled
  // by 1 / world (they already hold every rank's tokens), the clipping norm covers both. The
  // loss differentiated is the cross-entropy + moe_aux_loss_coef * the gates' load-balancing
  // loss (the logged loss is the cross-entropy alone; the aux loss is logged as "aux_loss").
  // The second-expert noise is seeded per step and rank, so a resumed run routes as the
  // uninterrupted one. Checkpoints: the FSDP item plus each rank's experts and their Adam state
  // ("experts", "expert_optimizer": stage_item per rank), so a resume needs the same rank count.
  // Needs data_parallel fsdp; not supported (rejected by Validate): pipeline_stages > 1,
  // tensor_parallel > 1, deterministic, loss_scale, optimizer_offload, checkpoint_activations.
  // In ToJson() when > 0.
  int64_t moe_experts = 0;
  double moe_aux_loss_coef = 0.01;
  // Deterministic mode (//deterministic): bitwise the same losses, parameters and parameter hash
  // at any world size that divides `micro_batches`. A step's global batch is `micro_batches`
  // (M) micro-batches of `batch` sequences each (so `batch` is per micro-batch, not per rank):
  // micro-batch j of step s is the batch TokenData::Batch(seed, s, j) (the one rank j trains on
  // in the default mode, so M = world size reads the same data as the default mode), and rank r
  // of W runs micro-batches [r M/W, (r+1) M/W), one forward and backward each. Gradients are
  // summed over a fixed tree of the micro-batch index and divided by M (see
  // deterministic/README.md), clipping uses an exact sum of squares, the train loss is the same
  // tree's mean of the micro-batch losses, and validation scores the M micro-batches of the
  // validation split the same way (eval_batches does not apply). Modes: fsdp (every strategy,
  // any precision, loss scaling, offload), sdp (oss_partition greedy), and the pipeline with
  // whole stages (strategy no_shard: each of the world / pipeline_stages replicas runs its
  // M / replicas micro-batches as the pipe's chunks; pipeline_chunks does not apply), which
  // trains the unpipelined job's model bitwise. One intra-op thread per rank (threads must be 0
  // or 1). deterministic and micro_batches are in ToJson() when on.
  bool deterministic = false;
  int64_t micro_batches = 0;
  // FSDP.
  // full_shard | shard_grad_op | no_shard | hybrid_shard | hybrid_shard_zero2 (FULL_SHARD /
  // SHARD_GRAD_OP inside groups of hybrid_shard_group_size ranks, replicated across them).
  std::string strategy = "full_shard";
  int64_t hybrid_shard_group_size = 0;  // hybrid strategies: ranks per shard group (0: per host)
  // bf16 | fp32: the compute and all-gather dtype. fp16 parses but is rejected on CPU (no
  // float16 LayerNorm kernel in LibTorch 1.13); it would also want a loss scaler.
  std::string precision = "bf16";
  // Evaluation and output (rank 0 writes; empty paths are skipped).
  int64_t eval_every = 50;    // validation loss every N steps and at the end
  int64_t eval_batches = 4;   // per rank
  int64_t log_every = 10;     // progress lines when stdout is not a terminal
  bool progress = true;       // rank 0 prints the progress line
  std::string metrics_path;   // JSON lines
  std::string plot_path;      // SVG
  int64_t sample_tokens = 200;
  std::string prompt = "And God said";
  double temperature = 0.8;
  int64_t top_k = 10;
  // Checkpoints: <checkpoint_dir>/step_%08d/ every `checkpoint_every` steps and at the end.
  std::string checkpoint_dir;
  int64_t checkpoint_every = 100;  // 0: never
  int keep_checkpoints = 2;
  // Save in the background (train_state::CheckpointManagerOptions::async): the loop continues
  // once the state is snapshotted into host memory. Not part of ToJson().
  bool async_checkpoint = false;
  ResumeMode resume = ResumeMode::kNever;
  // With resume kNever, a checkpoint_dir that already holds complete checkpoints is refused
  // (RefuseToOverwriteCheckpoints: starting from step 0 deletes them) unless this is set.
  bool overwrite_checkpoints = false;
  // Stop after this step as if the job were killed there (no final eval, plot or sample);
  // 0 = run to `steps`. For resume tests.
  int64_t stop_after = 0;
  // Intra-op threads per rank; 0 = max(1, cores / world size). At most the core count (or
  // kMaxThreads where it is unknown): more only oversubscribes, and 100000 hung a rank.
  int threads = 0;
  // Observability (//trace). With `trace_path`, every rank records forward / backward /
  // optimizer spans and each collective (with its bytes) and rank 0 writes one Chrome trace
  // (a track per rank; open it in ui.perfetto.dev or chrome://tracing) at the end. With
  // `profile`, rank 0 also prints the time in compute vs communication vs idle per rank
  // (profile needs a trace_path: the summary is computed from the merged trace).
  std::string trace_path;
  bool profile = false;
  // Fault injection for tests: rank `fault_rank` SIGKILLs itself right after the optimizer step
  // of `fault_step` (before that step's checkpoint), or with `fault_in_save` inside that step's
  // checkpoint save: after its own files are written, before rank 0 writes COMPLETE. -1 = off.
  int fault_rank = -1;
  int64_t fault_step = 0;
  bool fault_in_save = false;
  // Fault-tolerant mode (//ft, issue 25; examples/gpt/ft_trainer.h): the job keeps training
  // when a rank dies. The ranks form replica groups of hybrid_shard_group_size S consecutive
  // ranks (group RANK / S; S = 1: plain data-parallel replicas), each running FSDP FULL_SHARD over
  // a communicator of its own; ft::FaultTolerantHsdp averages the gradients over the groups of
  // each step's quorum (ft::Membership over the launcher's store). A group that loses a rank
  // exits and is restarted alone by the launcher (--replica_group_size), the others keep
  // stepping; the restarted group rejoins and receives the state from a live group directly.
  // Needs strategy hybrid_shard with hybrid_shard_group_size > 0 and data_parallel fsdp; not
  // supported (rejected by Validate): pipeline_stages, tensor_parallel, moe_experts,
  // deterministic, loss_scale, optimizer_offload, checkpoints (checkpoint_dir), resume,
  // stop_after, trace_path / profile. The ft_* fields are ft::Membership's timings.
  bool fault_tolerant = false;
  int64_t ft_heartbeat_ms = 200;     // Membership::Options::heartbeat_interval
  int64_t ft_dead_after_ms = 2000;   // a silent rank is dead after this long
  int64_t ft_min_groups = 1;         // fewer live groups: the job fails
  int64_t ft_timeout_s = 60;         // quorum, commit vote and collective timeouts

  // Validates the values (kInvalidArgument naming the flag and its range, e.g. "--min_lr_ratio=2
  // is out of range: must be in [0, 1]"). Every numeric field has a range; sizes are bounded so
  // that products of them cannot overflow (kMaxDim) and threads by the core count.
  absl::Status Validate() const;
  // The learning-rate schedule's length (schedule_steps, else steps).
  int64_t schedule_length() const { return schedule_steps > 0 ? schedule_steps : steps; }
  // What a checkpoint records and a resume must match (model, data, schedule, FSDP). Settings
  // that do not change the numbers (checkpoint_activations, optimizer_offload, threads, outputs)
  // are left out.
  nlohmann::json ToJson() const;
};

struct TrainResult {
  int64_t start_step = 0;  // 0, or the step of the checkpoint resumed from
  int64_t last_step = 0;   // the last step run
  double train_loss = 0;   // mean over ranks, at last_step
  double val_loss = 0;     // at last_step (NaN when stopped early)
  std::string sample;      // decoded sample (empty when stopped early or sample_tokens == 0)
  // FNV-1a 64 of every rank's parameter shards (f32 master copies) after the last step, by
  // rank: equal between an interrupted-and-resumed run and an uninterrupted one.
  std::vector<uint64_t> param_hashes;
  // FNV-1a 64 of the full parameters (every unit's, gathered with summon_full_params, in the
  // compute dtype) as each rank sees them: equal on all ranks when they agree on the model.
  std::vector<uint64_t> full_param_hashes;
};

// Collective over `comm`: every rank calls it with the same config, one rank per process (the
// initial weights come from torch's global generator, seeded here, which threads would share). Errors (bad config,
// corrupt checkpoint, a peer that died) come back as a Status naming the rank, file or step.
absl::StatusOr<TrainResult> TrainRank(const TrainConfig& config,
                                      std::shared_ptr<comm::Communicator> comm);

// The checks a launcher runs before starting `world_size` ranks of TrainRank(config), so that a
// bad value stops the job before anything is launched, with one message: Validate(); the values
// that depend on the world size (pipeline_stages, hybrid_shard_group_size); the memory the
// batch and sequence need (EstimateRankBytes) against this machine's (kResourceExhausted naming
// --batch and --seq); every output directory can be created and written (naming the flag and
// the OS error); without `resume`, no complete checkpoint would be deleted
// (RefuseToOverwriteCheckpoints, unless overwrite_checkpoints); with `resume`, a complete
// checkpoint exists (kNotFound
// under ResumeMode::kRequired), matches the config (ResumeScheduleSteps) and is intact
// (train_state::VerifyFiles; kDataLoss pointing to an older intact one). Each message ends with what to
// do. Creates the output directories.
absl::Status CheckBeforeLaunch(const TrainConfig& config, int world_size);

// Whether `config` may resume from the checkpoint (`checkpoint_dir`, at `checkpoint_step`, with
// its recorded `checkpoint_config`) and with which schedule: every setting of ToJson() but the
// steps must match (kFailedPrecondition naming the first that differs), and config.steps must
// not be before the checkpoint's step (kInvalidArgument). Returns the learning-rate schedule's
// length: the checkpoint's (its schedule_steps, else its steps), so that a run extended with a
// larger `steps` keeps the schedule it was trained with and holds its final learning rate.
absl::StatusOr<int64_t> ResumeScheduleSteps(const TrainConfig& config,
                                            const std::string& checkpoint_dir,
                                            int64_t checkpoint_step,
                                            const nlohmann::json& checkpoint_config);

// Creates `dir` and checks that a file can be written in it: kPermissionDenied "cannot create
// <dir> (<flag>): <OS error>" / "cannot write in <dir> (<flag>): <OS error>", ending with what to
// do. An empty `dir` is OK.
absl::Status CheckWritableDir(const std::string& dir, absl::string_view flag);

// The most --threads Validate() accepts: the core count (kMaxThreads when unknown).
int MaxThreads();

// A rough upper estimate of one rank's memory for `config` (bytes): the parameters with their
// gradients and Adam state unsharded, and one step's activations (per block the attention
// scores, batch x heads x seq^2, and the MLP, batch x seq x width terms; the logits, batch x seq x
// vocab). For refusing sizes that cannot fit before launching, not for planning.
double EstimateRankBytes(const TrainConfig& config, int64_t vocab);

// Learning rate at `step` (1-based): linear warmup, then cosine to lr * min_lr_ratio at
// schedule_length(), held there after it.
double LearningRate(const TrainConfig& config, int64_t step);

// Peak resident set size of this process in bytes (VmHWM), 0 if unknown.
int64_t PeakRssBytes();

}  // namespace fairscale::examples::gpt
