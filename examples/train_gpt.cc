// The main job: train a small GPT on the King James Genesis and Exodus at character level with
// FSDP, 2 ranks as processes on this machine by default.
//
//   ./bazelw run //examples:train_gpt
//   ./bazelw run //examples:train_gpt -- --nproc_per_node=1 --steps=600 --precision=fp32
//   ./bazelw run //examples:train_gpt -- --resume           # continue from the last checkpoint
//   ./bazelw run //examples:train_gpt -- --resume --nproc_per_node=4  # another world size
//
// Unless a launcher started it (comm::StartedByLauncher(): RANK, OMPI_COMM_WORLD_*, PMI_* or
// SLURM_* set) the binary is its own launcher (LaunchLocal below, which runs
// //launch's Launch(), the fs_launch engine): it hosts the TCPStore with a job token, starts
// --nproc_per_node copies of itself with the torchrun environment, stops every rank within
// --failure_grace_s when one fails, and with --max_restarts restarts them all from the newest
// complete checkpoint. Under a launcher (fs_launch, torchrun, mpirun, srun) it runs as that
// rank through CreateCommunicatorFromEnv(). With --fault_tolerant (examples/gpt/ft_trainer.h)
// a failed rank restarts only its replica group (LaunchOptions::replica_group_size), and a rank
// makes its group's communicator itself (RunFaultTolerantRank). Outputs go to --out_dir (default
// out/train_gpt in the workspace under `bazel run`, else in the current directory).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/flags.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "base/subprocess.h"
#include "comm/communicator.h"
#include "comm/registry.h"
#include "launch/launcher.h"
#include "comm/store/tcp_store.h"
#include "examples/gpt/ft_trainer.h"
#include "examples/gpt/trainer.h"

ABSL_FLAG(int, nproc_per_node, 0,
          "ranks to launch on this machine when not started by a launcher (RANK unset); "
          "0: --nproc, else 2");
ABSL_FLAG(int, nproc, 0, "short for --nproc_per_node");
ABSL_FLAG(int64_t, steps, 400, "optimizer steps");
ABSL_FLAG(int64_t, batch, 16, "sequences per rank per step");
ABSL_FLAG(int64_t, seq, 64, "characters per sequence (context length)");
ABSL_FLAG(int64_t, width, 128, "model width");
ABSL_FLAG(int64_t, blocks, 4, "transformer blocks (each its own FSDP unit)");
ABSL_FLAG(int64_t, heads, 4, "attention heads");
ABSL_FLAG(double, lr, 3e-3, "peak learning rate (Adam; linear warmup, then cosine decay)");
ABSL_FLAG(int64_t, warmup_steps, 20, "learning-rate warmup steps");
ABSL_FLAG(double, min_lr_ratio, 0.1, "final learning rate as a fraction of --lr, in [0, 1]");
ABSL_FLAG(double, grad_clip, 1.0, "max global gradient norm, finite (0: off)");
ABSL_FLAG(uint64_t, seed, 1234, "initial weights, data order and sampling");
ABSL_FLAG(std::string, strategy, "full_shard",
          "full_shard | shard_grad_op | no_shard | hybrid_shard | hybrid_shard_zero2");
ABSL_FLAG(int64_t, hybrid_shard_group_size, 0,
          "hybrid_shard / hybrid_shard_zero2: ranks per shard group (a divisor of the rank "
          "count; consecutive ranks), replicated across groups; 0: one group per host");
ABSL_FLAG(std::string, data_parallel, "fsdp",
          "fsdp (FullyShardedDataParallel, --strategy) | sdp (oss::ShardedDataParallel + OSS "
          "Adam, ZeRO-2; needs --precision=fp32)");
ABSL_FLAG(int64_t, pipeline_stages, 1,
          "pipeline parallelism: cut the model into N stages, one per rank (1: off); the "
          "rank count must be a multiple of N (world / N data-parallel replicas, which shard each "
          "stage with FSDP under --strategy=full_shard|shard_grad_op or all-reduce its gradients "
          "under no_shard); --precision=fp32, or bf16 with FSDP; checkpoints per stage (FSDP: resumable with "
          "another replica count; no_shard: same world size only); no sample");
ABSL_FLAG(int64_t, tensor_parallel, 1,
          "tensor parallelism (//model_parallel): split heads, MLP and vocabulary over T "
          "consecutive ranks (1: off); the rank count must be a multiple of T (world / T "
          "replicas; FSDP shards each rank's slices over the replicas with --strategy=full_shard|"
          "shard_grad_op, or they all-reduce the gradients under no_shard); --precision=fp32; "
          "checkpoints per tensor rank (resumable with another replica count, the same T); "
          "composes with --pipeline_stages (T x P must divide the rank count)");
ABSL_FLAG(int64_t, moe_experts, 0,
          "mixture of experts (//moe): every odd block's MLP a Top2Gate MoE layer over E experts "
          "(0: dense), E / ranks experts per rank (E divisible by the rank count, --blocks >= 2); "
          "data_parallel fsdp only; checkpoints resume at the same rank count");
ABSL_FLAG(double, moe_aux_loss_coef, 0.01,
          "--moe_experts > 0: weight of the gates' load-balancing loss in the differentiated loss");
ABSL_FLAG(int64_t, pipeline_chunks, 4, "--pipeline_stages > 1: micro-batches per step (<= --batch)");
ABSL_FLAG(std::string, pipeline_schedule, "1f1b",
          "--pipeline_stages > 1: 1f1b | gpipe | interleaved (with --pipeline_virtual_stages)");
ABSL_FLAG(int64_t, pipeline_virtual_stages, 1,
          "--pipeline_schedule=interleaved: model chunks per rank (stages x V virtual stages, "
          "rank r holds r, r + N, ...); --pipeline_chunks must be a multiple of --pipeline_stages");
ABSL_FLAG(std::string, pipeline_balance, "even",
          "--pipeline_stages > 1: layers per stage, even (by count) | size (parameter and "
          "activation bytes, pipe::balance_by_size)");
ABSL_FLAG(std::string, oss_partition, "greedy", "sdp: OSS partition, greedy | flat");
ABSL_FLAG(bool, loss_scale, false,
          "dynamic loss scaling (amp::ShardedGradScaler; the scale in the step records)");
ABSL_FLAG(std::string, checkpoint_activations, "none",
          "activation checkpointing of the transformer blocks: none | all | every:K (block i "
          "when i % K == 0); each checkpointed block's forward is recomputed in backward (less "
          "activation memory, more time, bitwise the same numbers). With --pipeline_stages > 1: "
          "none | all | except_last (each stage's forward per micro-batch)");
ABSL_FLAG(std::string, optimizer_offload, "none",
          "none | disk: keep the Adam state of each rank's FSDP shards on the disk tier "
          "(offload::OffloadedAdam, streamed per chunk; fsdp only; same numbers, same checkpoints)");
ABSL_FLAG(std::string, offload_dir, "", "--optimizer_offload=disk: default <out_dir>/offload");
ABSL_FLAG(int64_t, offload_chunk_bytes, 4 << 20,
          "--optimizer_offload=disk: bytes of f32 state streamed through memory at a time");
ABSL_FLAG(std::string, precision, "bf16",
          "bf16 | fp32: compute and all-gather dtype (f32 master shards, f32 gradient reduction); "
          "fp16 is rejected on CPU (LibTorch has no float16 LayerNorm kernel there)");
ABSL_FLAG(std::string, out_dir, "",
          "output directory (default: $BUILD_WORKSPACE_DIRECTORY/out/train_gpt under bazel run, "
          "else ./out/train_gpt)");
ABSL_FLAG(std::string, checkpoint_dir, "", "default <out_dir>/checkpoints; 'none' disables");
ABSL_FLAG(int64_t, checkpoint_every, 100, "save a sharded checkpoint every K steps (and at the end)");
ABSL_FLAG(int, keep_checkpoints, 2, "complete checkpoints to keep");
ABSL_FLAG(bool, async_checkpoint, false,
          "save checkpoints in the background: training continues once the state is copied to "
          "host memory (at most one save in flight; an error is reported by the next save)");
ABSL_FLAG(std::string, resume, "never",
          "never | auto (resume if a complete checkpoint exists) | true (must resume); a bare "
          "--resume means true");
ABSL_FLAG(bool, overwrite_checkpoints, false,
          "without --resume: delete the complete checkpoints already in --checkpoint_dir and "
          "start from step 0 (without this flag such a run is refused)");
ABSL_FLAG(int64_t, stop_after, 0, "stop after this step as if killed (for resume tests); 0: off");
ABSL_FLAG(std::string, metrics, "", "JSON-lines metrics file (default <out_dir>/metrics.jsonl)");
ABSL_FLAG(std::string, plot, "", "SVG loss plot (default <out_dir>/loss.svg)");
ABSL_FLAG(int64_t, eval_every, 50, "validation loss every N steps (and at the end)");
ABSL_FLAG(int64_t, eval_batches, 4, "validation batches per rank (>= 1)");
ABSL_FLAG(int64_t, log_every, 10, "progress line every N steps when stdout is not a terminal");
ABSL_FLAG(int64_t, sample_tokens, 200, "characters to sample at the end (0: none)");
ABSL_FLAG(std::string, prompt, "And God said", "sampling prompt");
ABSL_FLAG(double, temperature, 0.8, "sampling temperature");
ABSL_FLAG(int64_t, top_k, 10, "sample from the k most likely characters (0: all)");
ABSL_FLAG(int, threads, 0,
          "intra-op threads per rank, at most the core count (0: cores / ranks)");
ABSL_FLAG(bool, deterministic, false,
          "bitwise the same losses and parameters at any rank count that divides "
          "--micro_batches (fsdp, sdp, and pipeline with strategy no_shard; one intra-op "
          "thread per rank)");
ABSL_FLAG(int64_t, micro_batches, 0,
          "--deterministic: micro-batches of --batch sequences per step over all ranks");
ABSL_FLAG(int, max_restarts, 0,
          "self-launch only: restart all ranks from the last complete checkpoint up to this many "
          "times after a rank fails; with --fault_tolerant, restart only the failed rank's "
          "replica group, up to this many times per group (default 3 with --fault_tolerant)");
ABSL_FLAG(int, failure_grace_s, 10,
          "self-launch only: after a rank fails, the others get this long to exit, then SIGKILL");
ABSL_FLAG(std::string, trace, "",
          "write a Chrome trace here (one track per rank: forward, backward, optimizer, every "
          "collective with its bytes); open it in ui.perfetto.dev");
ABSL_FLAG(bool, profile, false,
          "print time in compute vs communication vs idle per rank at the end (traces to "
          "--trace, default <out_dir>/trace.json)");
ABSL_FLAG(bool, fault_tolerant, false,
          "keep training when a rank dies (//ft, issue 25): replica groups of "
          "--hybrid_shard_group_size ranks (needs --strategy=hybrid_shard), FSDP inside each, "
          "gradients averaged over each step's quorum of live groups; a group that loses a rank "
          "is restarted alone (--max_restarts per group) and receives the state from a live "
          "group; no checkpoints (--checkpoint_dir=none is implied)");
ABSL_FLAG(int64_t, ft_heartbeat_ms, 200, "--fault_tolerant: heartbeat interval of every rank");
ABSL_FLAG(int64_t, ft_dead_after_ms, 2000,
          "--fault_tolerant: a rank silent this long is dead (its group is dropped)");
ABSL_FLAG(int64_t, ft_min_groups, 1,
          "--fault_tolerant: fewer live replica groups than this fails the job");
ABSL_FLAG(int64_t, ft_timeout_s, 60,
          "--fault_tolerant: bound of a quorum (a joiner waits for the others' next step), the "
          "commit vote and the cross-group collectives");
ABSL_FLAG(std::string, fault_kill, "",
          "fault injection for tests, RANK:STEP: that rank SIGKILLs itself after that step, in "
          "the first attempt only (TORCHELASTIC_RESTART_COUNT unset or 0); RANK:STEP:save: "
          "inside that step's checkpoint save instead (its files written, COMPLETE not yet)");

namespace fairscale::examples {
namespace {

constexpr int kMaxRanks = 1024;  // --nproc_per_node: processes on one machine

std::string OutDir() {
  std::string dir = absl::GetFlag(FLAGS_out_dir);
  if (!dir.empty()) return dir;
  if (const char* ws = std::getenv("BUILD_WORKSPACE_DIRECTORY")) {
    return absl::StrCat(ws, "/out/train_gpt");
  }
  return "out/train_gpt";
}

// An explicit --metrics / --plot / --trace file must go into a directory that exists: a typo
// there stops the job before launching instead of creating directories somewhere unexpected.
absl::Status CheckParentExists(absl::string_view flag, const std::string& path) {
  if (path.empty()) return absl::OkStatus();
  const std::string parent = std::filesystem::path(path).parent_path().string();
  std::error_code ec;
  if (parent.empty() || std::filesystem::is_directory(parent, ec)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "--", flag, "=", path, ": the directory ", parent, " does not exist; create it, or leave --",
      flag, " out to write under --out_dir"));
}

absl::StatusOr<gpt::TrainConfig> ConfigFromFlags() {
  FS_RETURN_IF_ERROR(CheckParentExists("metrics", absl::GetFlag(FLAGS_metrics)));
  FS_RETURN_IF_ERROR(CheckParentExists("plot", absl::GetFlag(FLAGS_plot)));
  FS_RETURN_IF_ERROR(CheckParentExists("trace", absl::GetFlag(FLAGS_trace)));
  gpt::TrainConfig c;
  c.steps = absl::GetFlag(FLAGS_steps);
  c.batch = absl::GetFlag(FLAGS_batch);
  c.seq = absl::GetFlag(FLAGS_seq);
  c.width = absl::GetFlag(FLAGS_width);
  c.blocks = absl::GetFlag(FLAGS_blocks);
  c.heads = absl::GetFlag(FLAGS_heads);
  c.lr = absl::GetFlag(FLAGS_lr);
  c.warmup_steps = absl::GetFlag(FLAGS_warmup_steps);
  c.min_lr_ratio = absl::GetFlag(FLAGS_min_lr_ratio);
  c.grad_clip = absl::GetFlag(FLAGS_grad_clip);
  c.seed = absl::GetFlag(FLAGS_seed);
  c.strategy = absl::GetFlag(FLAGS_strategy);
  c.hybrid_shard_group_size = absl::GetFlag(FLAGS_hybrid_shard_group_size);
  c.precision = absl::GetFlag(FLAGS_precision);
  c.data_parallel = absl::GetFlag(FLAGS_data_parallel);
  c.oss_partition = absl::GetFlag(FLAGS_oss_partition);
  c.loss_scale = absl::GetFlag(FLAGS_loss_scale);
  c.checkpoint_activations = absl::GetFlag(FLAGS_checkpoint_activations);
  const std::string out = OutDir();
  c.optimizer_offload = absl::GetFlag(FLAGS_optimizer_offload);
  c.offload_dir = absl::GetFlag(FLAGS_offload_dir);
  if (c.offload_dir.empty()) c.offload_dir = out + "/offload";
  c.offload_chunk_bytes = absl::GetFlag(FLAGS_offload_chunk_bytes);
  c.pipeline_stages = absl::GetFlag(FLAGS_pipeline_stages);
  c.pipeline_chunks = absl::GetFlag(FLAGS_pipeline_chunks);
  c.pipeline_schedule = absl::GetFlag(FLAGS_pipeline_schedule);
  c.pipeline_balance = absl::GetFlag(FLAGS_pipeline_balance);
  c.pipeline_virtual_stages = absl::GetFlag(FLAGS_pipeline_virtual_stages);
  c.tensor_parallel = absl::GetFlag(FLAGS_tensor_parallel);
  c.moe_experts = absl::GetFlag(FLAGS_moe_experts);
  c.moe_aux_loss_coef = absl::GetFlag(FLAGS_moe_aux_loss_coef);
  c.fault_tolerant = absl::GetFlag(FLAGS_fault_tolerant);
  c.ft_heartbeat_ms = absl::GetFlag(FLAGS_ft_heartbeat_ms);
  c.ft_dead_after_ms = absl::GetFlag(FLAGS_ft_dead_after_ms);
  c.ft_min_groups = absl::GetFlag(FLAGS_ft_min_groups);
  c.ft_timeout_s = absl::GetFlag(FLAGS_ft_timeout_s);
  c.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  // Fault-tolerant mode writes no checkpoints (yet): no default directory.
  if (c.checkpoint_dir.empty() && !c.fault_tolerant) c.checkpoint_dir = out + "/checkpoints";
  if (c.checkpoint_dir == "none") c.checkpoint_dir.clear();
  c.checkpoint_every = absl::GetFlag(FLAGS_checkpoint_every);
  c.keep_checkpoints = absl::GetFlag(FLAGS_keep_checkpoints);
  c.async_checkpoint = absl::GetFlag(FLAGS_async_checkpoint);
  const std::string resume = absl::GetFlag(FLAGS_resume);
  if (resume == "never" || resume == "false" || resume.empty()) {
    c.resume = gpt::ResumeMode::kNever;
    c.overwrite_checkpoints = absl::GetFlag(FLAGS_overwrite_checkpoints);
    // A restarted attempt (fs_launch --max_restarts, or ours) continues from its checkpoint, and
    // never deletes what the first attempt saved.
    // (Fault-tolerant mode: a restarted replica group rejoins and gets the state from a live
    // group instead.)
    const char* restarts = std::getenv("FS_RESTART_COUNT");
    if (restarts != nullptr && std::atoi(restarts) > 0 && !c.fault_tolerant) {
      c.resume = gpt::ResumeMode::kAuto;
      c.overwrite_checkpoints = false;
    }
  } else if (resume == "auto") {
    c.resume = gpt::ResumeMode::kAuto;
    c.overwrite_checkpoints = absl::GetFlag(FLAGS_overwrite_checkpoints);  // refused by Validate
  } else if (resume == "true" || resume == "required") {
    c.resume = gpt::ResumeMode::kRequired;
    c.overwrite_checkpoints = absl::GetFlag(FLAGS_overwrite_checkpoints);  // refused by Validate
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--resume=", resume, ": expected never, auto or true"));
  }
  c.stop_after = absl::GetFlag(FLAGS_stop_after);
  c.metrics_path = absl::GetFlag(FLAGS_metrics);
  if (c.metrics_path.empty()) c.metrics_path = out + "/metrics.jsonl";
  c.plot_path = absl::GetFlag(FLAGS_plot);
  if (c.plot_path.empty()) c.plot_path = out + "/loss.svg";
  c.eval_every = absl::GetFlag(FLAGS_eval_every);
  c.eval_batches = absl::GetFlag(FLAGS_eval_batches);
  c.log_every = absl::GetFlag(FLAGS_log_every);
  c.sample_tokens = absl::GetFlag(FLAGS_sample_tokens);
  c.prompt = absl::GetFlag(FLAGS_prompt);
  c.temperature = absl::GetFlag(FLAGS_temperature);
  c.top_k = absl::GetFlag(FLAGS_top_k);
  c.threads = absl::GetFlag(FLAGS_threads);
  c.deterministic = absl::GetFlag(FLAGS_deterministic);
  c.micro_batches = absl::GetFlag(FLAGS_micro_batches);
  c.trace_path = absl::GetFlag(FLAGS_trace);
  c.profile = absl::GetFlag(FLAGS_profile);
  if (c.profile && c.trace_path.empty()) c.trace_path = out + "/trace.json";
  const std::string fault = absl::GetFlag(FLAGS_fault_kill);
  if (!fault.empty()) {
    std::vector<std::string> rs = absl::StrSplit(fault, ':');
    if (rs.size() < 2 || rs.size() > 3 || !absl::SimpleAtoi(rs[0], &c.fault_rank) ||
        !absl::SimpleAtoi(rs[1], &c.fault_step) || (rs.size() == 3 && rs[2] != "save")) {
      return absl::InvalidArgumentError(
          absl::StrCat("--fault_kill=", fault, ": expected RANK:STEP or RANK:STEP:save"));
    }
    c.fault_in_save = rs.size() == 3;
    // The first incarnation only: of the job, or (--fault_tolerant) of the rank's replica group.
    for (const char* var : {"TORCHELASTIC_RESTART_COUNT", "FS_RESTART_COUNT"}) {
      const char* restarts = std::getenv(var);
      if (restarts != nullptr && std::atoi(restarts) > 0) c.fault_rank = -1;
    }
  }
  FS_RETURN_IF_ERROR(c.Validate());
  return c;
}

// Whether a path of `config` is a default under --out_dir (the flag for it was left out).
bool UsesOutDir(const gpt::TrainConfig& config) {
  return absl::GetFlag(FLAGS_metrics).empty() || absl::GetFlag(FLAGS_plot).empty() ||
         absl::GetFlag(FLAGS_checkpoint_dir).empty() ||
         (config.optimizer_offload == "disk" && absl::GetFlag(FLAGS_offload_dir).empty()) ||
         (config.profile && absl::GetFlag(FLAGS_trace).empty());
}

// A rank's error: with FS_ERROR_DIR (set by LaunchLocal) into <dir>/<attempt>.<rank> for the
// launcher to print once per distinct message (ranks often fail the same way); else to stderr.
void ReportRankError(int rank, const std::string& text) {
  if (const char* dir = std::getenv("FS_ERROR_DIR"); dir != nullptr && rank >= 0) {
    const char* attempt = std::getenv("FS_RESTART_COUNT");
    const std::string path =
        absl::StrCat(dir, "/", attempt != nullptr ? attempt : "0", ".", rank);
    if (std::FILE* f = std::fopen(path.c_str(), "w")) {
      const bool ok = std::fputs(text.c_str(), f) >= 0;
      if (std::fclose(f) == 0 && ok) return;
    }
  }
  std::fprintf(stderr, "%strain_gpt: %s\n", base::OutputRankPrefix(rank).c_str(), text.c_str());
}

// Prints the errors the ranks left in `dir` (ReportRankError): one line per attempt and distinct
// message, naming the ranks, e.g. "train_gpt: all 4 ranks: DATA_LOSS: resume: ..." (an attempt
// that was restarted: "train_gpt: before restart 1, rank 0 of 2: ...").
void PrintRankErrors(const std::string& dir, int n, bool job_succeeded) {
  std::map<int, std::map<std::string, std::vector<int>>> by_attempt;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    int attempt = 0, rank = 0;
    const std::vector<std::string> parts = absl::StrSplit(e.path().filename().string(), '.');
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &attempt) ||
        !absl::SimpleAtoi(parts[1], &rank)) {
      continue;
    }
    std::ifstream in(e.path());
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    by_attempt[attempt][text].push_back(rank);
  }
  // Errors of an attempt that was restarted say so (a job that succeeded restarted them all).
  const int last_attempt =
      job_succeeded || by_attempt.empty() ? -1 : by_attempt.rbegin()->first;
  for (auto& [attempt, messages] : by_attempt) {
    // The first-failing ranks' message first is not known here; fewest ranks first puts a
    // lone root cause before the echoes of it on the other ranks.
    std::vector<std::pair<std::string, std::vector<int>>> sorted(messages.begin(), messages.end());
    std::stable_sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) {
      return a.second.size() < b.second.size();
    });
    for (auto& [text, ranks] : sorted) {
      std::sort(ranks.begin(), ranks.end());
      std::string who;
      if (static_cast<int>(ranks.size()) == n && n > 1) {
        who = absl::StrCat("all ", n, " ranks");
      } else if (ranks.size() > 2 &&
                 ranks.back() - ranks.front() + 1 == static_cast<int>(ranks.size())) {
        who = absl::StrCat("ranks ", ranks.front(), "-", ranks.back(), " of ", n);
      } else {
        who = absl::StrCat(ranks.size() == 1 ? "rank " : "ranks ", absl::StrJoin(ranks, ", "),
                           " of ", n);
      }
      std::fprintf(stderr, "train_gpt: %s%s: %s\n",
                   attempt != last_attempt
                       ? absl::StrCat("before restart ", attempt + 1, ", ").c_str()
                       : "",
                   who.c_str(), text.c_str());
    }
  }
}

// A --fault_tolerant rank: no world communicator; its replica group's communicator over the
// launcher's store (comm::CommConfigFromEnv), named per group incarnation (FS_RESTART_COUNT).
int RunFaultTolerantRank(const gpt::TrainConfig& config) {
  const char* rank_var = std::getenv("RANK");
  int rank = rank_var != nullptr ? std::atoi(rank_var) : -1;
  absl::StatusOr<comm::EnvCommConfig> env = comm::CommConfigFromEnv();
  if (!env.ok()) {
    ReportRankError(rank, absl::StrCat("cannot read the environment: ", env.status().ToString()));
    return 1;
  }
  rank = env->env.rank;
  const int world = env->env.world_size;
  base::SetLogRank(rank, world);
  if (world > 1 && !env->env.use_agent_store && env->env.store_dir.empty()) {
    ReportRankError(rank,
                    "--fault_tolerant needs a store that the launcher hosts (fs_launch or "
                    "train_gpt's self-launcher: TORCHELASTIC_USE_AGENT_STORE=True): here rank 0 "
                    "would host it, and its death would end the job");
    return 2;
  }
  const char* restarts = std::getenv("FS_RESTART_COUNT");
  const int incarnation = restarts != nullptr ? std::max(0, std::atoi(restarts)) : 0;
  const int s = static_cast<int>(config.hybrid_shard_group_size);
  if (s < 1 || world % s != 0) {
    ReportRankError(rank, absl::StrCat("--hybrid_shard_group_size=", s,
                                       " does not divide the rank count ", world));
    return 2;
  }
  comm::CommConfig group_config = env->config;
  group_config.rank = rank % s;
  group_config.size = s;
  group_config.name = gpt::FtGroupCommName(rank / s, incarnation);
  absl::StatusOr<std::shared_ptr<comm::Communicator>> group =
      comm::CreateCommunicator(env->env.backend, group_config);
  if (!group.ok()) {
    ReportRankError(rank, absl::StrCat("cannot create the replica group's communicator: ",
                                       group.status().ToString()));
    return 1;
  }
  gpt::FtRankContext context;
  context.rank = rank;
  context.world_size = world;
  context.incarnation = incarnation;
  context.group = *group;
  context.store = env->config.store;
  context.backend = env->env.backend;
  context.base = env->config;
  absl::StatusOr<gpt::TrainResult> result = gpt::TrainFaultTolerantRank(config, context);
  if (absl::IsCancelled(result.status())) {  // restarted after the others finished: nothing to do
    std::printf("%s%s; exiting 0\n", base::OutputRankPrefix(rank).c_str(),
                std::string(result.status().message()).c_str());
    std::fflush(stdout);
    return 0;
  }
  if (!result.ok()) {
    ReportRankError(rank, absl::StrCat(absl::StatusCodeToString(result.status().code()), ": ",
                                       result.status().message()));
    return 1;
  }
  return 0;
}

// One rank, started by a launcher (ours or another) with the torchrun environment.
int RunRank() {
  absl::StatusOr<gpt::TrainConfig> config = ConfigFromFlags();
  if (!config.ok()) {
    const char* rank = std::getenv("RANK");
    ReportRankError(rank != nullptr ? std::atoi(rank) : -1, std::string(config.status().message()));
    return 2;
  }
  if (config->fault_tolerant) return RunFaultTolerantRank(*config);
  absl::StatusOr<std::shared_ptr<comm::Communicator>> comm = comm::CreateCommunicatorFromEnv();
  if (!comm.ok()) {
    const char* rank = std::getenv("RANK");
    ReportRankError(rank != nullptr ? std::atoi(rank) : -1,
                    absl::StrCat("cannot create the communicator: ", comm.status().ToString()));
    return 1;
  }
  base::SetLogRank((*comm)->rank(), (*comm)->size());
  absl::StatusOr<gpt::TrainResult> result = gpt::TrainRank(*config, *comm);
  if (!result.ok()) {
    // TrainRank's message opens with "rank r/N: ", which would make every rank's differ.
    absl::string_view message = result.status().message();
    absl::ConsumePrefix(&message,
                        absl::StrCat("rank ", (*comm)->rank(), "/", (*comm)->size(), ": "));
    ReportRankError((*comm)->rank(), absl::StrCat(absl::StatusCodeToString(result.status().code()),
                                                  ": ", message));
    (*comm)->Abort(result.status());  // peers blocked on us fail now instead of timing out
    return 1;
  }
  return 0;
}

// The self-launcher: //launch's Launch() (what fs_launch runs) with --nproc_per_node ranks of
// this binary on this machine, a free port and the ranks' output going straight to this terminal
// (only rank 0 prints, and its progress line may redraw itself). Restarts resume from the newest
// complete checkpoint (ConfigFromFlags turns --resume=never into auto when FS_RESTART_COUNT > 0).
int LaunchLocal(const std::vector<std::string>& args) {
  const int nproc = absl::GetFlag(FLAGS_nproc);
  const int nproc_per_node = absl::GetFlag(FLAGS_nproc_per_node);
  if (nproc > 0 && nproc_per_node > 0 && nproc != nproc_per_node) {
    std::fprintf(stderr,
                 "train_gpt: --nproc=%d and --nproc_per_node=%d disagree (--nproc is short for "
                 "--nproc_per_node); give one of them\n",
                 nproc, nproc_per_node);
    return 2;
  }
  const int n = nproc_per_node != 0 ? nproc_per_node : nproc != 0 ? nproc : 2;
  if (n < 1 || n > kMaxRanks) {
    std::fprintf(stderr, "train_gpt: --nproc_per_node=%d is out of range: must be in [1, %d]\n",
                 n, kMaxRanks);
    return 2;
  }
  int max_restarts = absl::GetFlag(FLAGS_max_restarts);
  const bool restarts_given = std::any_of(args.begin(), args.end(), [](const std::string& a) {
    return absl::StartsWith(a, "--max_restarts") || absl::StartsWith(a, "-max_restarts");
  });
  if (absl::GetFlag(FLAGS_fault_tolerant) && !restarts_given) {
    max_restarts = 3;  // per replica group: a dead rank need not end the job
  }
  const int grace_s = absl::GetFlag(FLAGS_failure_grace_s);
  if (max_restarts < 0 || max_restarts > 1000 || grace_s < 0 || grace_s > 3600) {
    std::fprintf(stderr,
                 "train_gpt: --max_restarts=%d and --failure_grace_s=%d: must be in [0, 1000] and "
                 "[0, 3600]\n",
                 max_restarts, grace_s);
    return 2;
  }
  // Every check that can be made here is made before a rank starts: one message, and nothing
  // launched (flags, the world size, the output directories, the checkpoint to resume from).
  absl::StatusOr<gpt::TrainConfig> config = ConfigFromFlags();
  absl::Status ready = config.status();
  // The output directory first, when anything defaults into it: its own OS error, not that of a
  // later path under it.
  if (ready.ok() && UsesOutDir(*config)) ready = gpt::CheckWritableDir(OutDir(), "--out_dir");
  if (ready.ok()) ready = gpt::CheckBeforeLaunch(*config, n);
  if (!ready.ok()) {
    std::fprintf(stderr, "train_gpt: %s\n", std::string(ready.message()).c_str());
    return 2;
  }
  launch::LaunchOptions o;
  o.nproc_per_node = n;
  o.master_port = 0;
  o.max_restarts = max_restarts;
  o.stop_timeout = absl::Seconds(absl::GetFlag(FLAGS_failure_grace_s));
  o.program = "/proc/self/exe";
  o.args = args;
  o.capture_output = false;
  if (std::getenv("FS_COMM_TIMEOUT_S") == nullptr) o.env.push_back("FS_COMM_TIMEOUT_S=60");
  if (config->fault_tolerant) {
    // A failed rank restarts only its replica group; the others keep training.
    o.replica_group_size = static_cast<int>(config->hybrid_shard_group_size);
  } else if (o.max_restarts > 0 && config->checkpoint_dir.empty()) {
    std::fprintf(stderr, "train_gpt: --max_restarts needs checkpoints (--checkpoint_dir)\n");
    return 2;
  }
  // The ranks leave their errors here and this process prints each distinct one once.
  std::error_code ec;
  const std::filesystem::path error_dir =
      std::filesystem::temp_directory_path(ec) /
      absl::StrCat("train_gpt_errors.", ::getpid(), ".", absl::ToUnixNanos(absl::Now()));
  if (std::filesystem::create_directories(error_dir, ec)) {
    o.env.push_back(absl::StrCat("FS_ERROR_DIR=", error_dir.string()));
  }
  absl::StatusOr<int> status = launch::Launch(o);
  PrintRankErrors(error_dir.string(), n, status.ok() && *status == 0);
  std::filesystem::remove_all(error_dir, ec);
  if (!status.ok()) {
    std::fprintf(stderr, "train_gpt: %s\n", status.status().ToString().c_str());
    return 1;
  }
  return *status;
}

constexpr char kUsage[] =
    "the main job: a small GPT trained with FSDP on the King James Genesis and\n"
    "Exodus, 2 ranks as processes on this machine by default (README.md).\n"
    "\n"
    "  train_gpt [--nproc_per_node=N] [--steps=400] [--resume] [--out_dir=DIR] ...\n"
    "  fs_launch --nproc_per_node=4 -- train_gpt ...      (under a launcher: one rank each)\n"
    "  train_gpt --nproc_per_node=4 --fault_tolerant --strategy=hybrid_shard\n"
    "            --hybrid_shard_group_size=2              (keep training when a rank dies; under\n"
    "                                                      fs_launch add --replica_group_size=2)\n"
    "\n"
    "Environment read: RANK, or Open MPI / PMI / Slurm rank variables (set: run as that rank\n"
    "under a launcher; unset: launch --nproc_per_node ranks of this binary), WORLD_SIZE,\n"
    "LOCAL_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE, FS_STORE_PROTOCOL,\n"
    "FS_STORE_TOKEN, FS_STORE_PREFIX (the launcher's rendezvous, launch/README.md),\n"
    "FS_COMM_BACKEND (tcp or ucx), FS_SOCKET_IFNAME (the interface ranks on several hosts\n"
    "reach each other on; comm/registry.h),\n"
    "FS_COMM_TIMEOUT_S (collective and rendezvous timeout; 60 when self-launched),\n"
    "FS_RESTART_COUNT and TORCHELASTIC_RESTART_COUNT (> 0: a restart, which resumes; with\n"
    "--fault_tolerant: the replica group's restarts, which rejoins),\n"
    "BUILD_WORKSPACE_DIRECTORY (bazel run: the default --out_dir is in the workspace),\n"
    "FS_ERROR_DIR (set by the self-launcher for its ranks).";

}  // namespace
}  // namespace fairscale::examples

int main(int argc, char** argv) {
  // A bare --resume means --resume=true (absl string flags need a value).
  std::vector<char*> argv_fixed(argv, argv + argc);
  static char kResumeTrue[] = "--resume=true";
  for (char*& a : argv_fixed) {
    if (std::strcmp(a, "--resume") == 0 || std::strcmp(a, "-resume") == 0) a = kResumeTrue;
  }
  fairscale::base::ParseCommandLine(static_cast<int>(argv_fixed.size()), argv_fixed.data(),
                                    fairscale::examples::kUsage);
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  if (!fairscale::comm::StartedByLauncher()) {
    return fairscale::examples::LaunchLocal(
        std::vector<std::string>(argv_fixed.begin() + 1, argv_fixed.end()));
  }
  return fairscale::examples::RunRank();
}
