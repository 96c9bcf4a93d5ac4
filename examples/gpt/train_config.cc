// The job's configuration: TrainConfig's checks and JSON form, the resume compatibility rules,
// the checks the self-launcher runs before starting any rank, and the learning-rate schedule
// (declared in trainer.h; the per-rank training loop is trainer.cc).
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "examples/gpt/checkpoints.h"
#include "examples/gpt/parallel_model.h"
#include "examples/gpt/trainer.h"

namespace fairscale::examples::gpt {

namespace {

// "--<flag>=<v> is out of range: must be in [lo, hi]<note>" unless lo <= v <= hi (NaN is out).
absl::Status InRange(absl::string_view flag, double v, double lo, double hi,
                     absl::string_view note = "") {
  if (v >= lo && v <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat("--%s=%g is out of range: must be in [%g, %g]%s",
                                                    flag, v, lo, hi, note));
}
absl::Status InRange(absl::string_view flag, int64_t v, int64_t lo, int64_t hi,
                     absl::string_view note = "") {
  if (v >= lo && v <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, "=", v, " is out of range: must be in [", lo, ", ", hi, "]", note));
}

constexpr int64_t kMaxSteps = int64_t{1} << 40;

// TrainConfig::fault_tolerant's requirements (the first violated one, naming its flag).
absl::Status ValidateFaultTolerant(const TrainConfig& c) {
  if (!c.fault_tolerant) return absl::OkStatus();
  auto unsupported = [](absl::string_view what) {
    return absl::InvalidArgumentError(
        absl::StrCat("--fault_tolerant does not support ", what, " (yet); drop it"));
  };
  if (c.strategy != "hybrid_shard" || c.hybrid_shard_group_size < 1 ||
      c.data_parallel != "fsdp") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--fault_tolerant needs --data_parallel=fsdp --strategy=hybrid_shard "
        "--hybrid_shard_group_size=S (S >= 1 ranks per replica group), got --data_parallel=",
        c.data_parallel, " --strategy=", c.strategy, " --hybrid_shard_group_size=",
        c.hybrid_shard_group_size));
  }
  if (c.pipeline_stages > 1) return unsupported("--pipeline_stages");
  if (c.tensor_parallel > 1) return unsupported("--tensor_parallel");
  if (c.moe_experts > 0) return unsupported("--moe_experts");
  if (c.deterministic) return unsupported("--deterministic");
  if (c.loss_scale) return unsupported("--loss_scale");
  if (c.optimizer_offload != "none") return unsupported("--optimizer_offload");
  if (!c.trace_path.empty() || c.profile) return unsupported("--trace / --profile");
  if (c.stop_after > 0) return unsupported("--stop_after");
  if (c.fault_in_save) return unsupported("--fault_kill=R:S:save (no checkpoints)");
  if (!c.checkpoint_dir.empty() || c.resume != ResumeMode::kNever) {
    return absl::InvalidArgumentError(
        "--fault_tolerant does not write or resume checkpoints yet (a restarted replica group "
        "gets the state from a live group): pass --checkpoint_dir=none and no --resume");
  }
  FS_RETURN_IF_ERROR(InRange("ft_heartbeat_ms", c.ft_heartbeat_ms, 10, 60000));
  FS_RETURN_IF_ERROR(InRange("ft_dead_after_ms", c.ft_dead_after_ms, 2 * c.ft_heartbeat_ms,
                             3600000, " (at least 2 heartbeats)"));
  FS_RETURN_IF_ERROR(InRange("ft_min_groups", c.ft_min_groups, 1, kMaxDim));
  FS_RETURN_IF_ERROR(InRange("ft_timeout_s", c.ft_timeout_s, 1, 86400));
  return absl::OkStatus();
}

}  // namespace

int MaxThreads() {
  const unsigned cores = std::thread::hardware_concurrency();
  return cores > 0 ? static_cast<int>(std::min<unsigned>(cores, kMaxThreads)) : kMaxThreads;
}

absl::Status TrainConfig::Validate() const {
  FS_RETURN_IF_ERROR(InRange("steps", steps, 1, kMaxSteps));
  FS_RETURN_IF_ERROR(InRange("batch", batch, 1, kMaxDim));
  FS_RETURN_IF_ERROR(InRange("seq", seq, 1, kMaxDim));
  FS_RETURN_IF_ERROR(InRange("width", width, 1, kMaxDim));
  FS_RETURN_IF_ERROR(InRange("blocks", blocks, 0, kMaxDim));
  FS_RETURN_IF_ERROR(InRange("heads", heads, 1, kMaxDim));
  if (width % heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("width ", width, " is not divisible by heads ", heads));
  }
  FS_RETURN_IF_ERROR(InRange("keep_checkpoints", int64_t{keep_checkpoints}, 1, 1 << 20));
  if (!(lr > 0) || !std::isfinite(lr)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--lr=%g is out of range: must be finite and > 0", lr));
  }
  FS_RETURN_IF_ERROR(InRange("min_lr_ratio", min_lr_ratio, 0.0, 1.0,
                             " (the final learning rate as a fraction of --lr)"));
  FS_RETURN_IF_ERROR(InRange("grad_clip", grad_clip, 0.0, std::numeric_limits<double>::max(),
                             " (finite; 0: off)"));
  if (!(temperature > 0) || !std::isfinite(temperature)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--temperature=%g is out of range: must be finite and > 0", temperature));
  }
  FS_RETURN_IF_ERROR(InRange("warmup_steps", warmup_steps, 0, kMaxSteps));
  FS_RETURN_IF_ERROR(InRange("checkpoint_every", checkpoint_every, 0, kMaxSteps, " (0: never)"));
  FS_RETURN_IF_ERROR(InRange("eval_every", eval_every, 0, kMaxSteps, " (0: only at the end)"));
  FS_RETURN_IF_ERROR(InRange("eval_batches", eval_batches, 1, kMaxDim));
  FS_RETURN_IF_ERROR(InRange("log_every", log_every, 0, kMaxSteps));
  FS_RETURN_IF_ERROR(InRange("stop_after", stop_after, 0, kMaxSteps, " (0: off)"));
  FS_RETURN_IF_ERROR(InRange("sample_tokens", sample_tokens, 0, kMaxDim));
  FS_RETURN_IF_ERROR(InRange("top_k", top_k, 0, kMaxDim, " (0: all)"));
  FS_RETURN_IF_ERROR(InRange("threads", int64_t{threads}, 0, MaxThreads(),
                             absl::StrCat(" (0: cores / ranks; at most the ",
                                          std::thread::hardware_concurrency() > 0
                                              ? "core count of this machine"
                                              : "sane maximum, the core count being unknown",
                                          ")")));
  FS_RETURN_IF_ERROR(InRange("micro_batches", micro_batches, 0, kMaxDim));
  if (deterministic) {
    if (micro_batches < 1) {
      return absl::InvalidArgumentError(
          "--deterministic needs --micro_batches=M: the micro-batches (of --batch sequences "
          "each) per step over all ranks; the rank count must divide M");
    }
    if (threads > 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--threads=", threads, " with --deterministic: deterministic mode runs one intra-op "
          "thread per rank (LibTorch's reductions split by thread count); leave --threads unset"));
    }
  } else if (micro_batches != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--micro_batches=", micro_batches, " is for --deterministic; add it, or drop the flag"));
  }
  if (fault_rank < -1 || fault_step < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--fault_kill=", fault_rank, ":", fault_step, ": the rank and step must be >= 0"));
  }
  if (overwrite_checkpoints && resume != ResumeMode::kNever) {
    return absl::InvalidArgumentError(
        "--overwrite_checkpoints deletes the checkpoints that --resume would continue from; "
        "give one of them");
  }
  if (sample_tokens > 0 && prompt.empty()) {
    return absl::InvalidArgumentError("prompt must not be empty when sampling");
  }
  FS_RETURN_IF_ERROR(ValidateFaultTolerant(*this));
  return ValidateParallelConfig(*this);
}

nlohmann::json TrainConfig::ToJson() const {
  nlohmann::json j = {{"steps", steps},   {"batch", batch},       {"seq", seq},
                      {"width", width},   {"blocks", blocks},     {"heads", heads},
                      {"seed", seed},     {"lr", lr},             {"warmup_steps", warmup_steps},
                      {"min_lr_ratio", min_lr_ratio},             {"grad_clip", grad_clip},
                      {"strategy", strategy},                     {"precision", precision},
                      {"data_parallel", data_parallel}};
  // Only in pipeline mode, so that older checkpoints keep matching the unpipelined config.
  if (pipeline_stages > 1) j["pipeline_stages"] = pipeline_stages;
  if (pipeline_stages > 1 && pipeline_balance != "even") j["pipeline_balance"] = pipeline_balance;
  if (pipeline_virtual_stages > 1) j["pipeline_virtual_stages"] = pipeline_virtual_stages;
  if (tensor_parallel > 1) j["tensor_parallel"] = tensor_parallel;
  if (moe_experts > 0) {
    j["moe_experts"] = moe_experts;
    j["moe_aux_loss_coef"] = moe_aux_loss_coef;
  }
  if (deterministic) {
    j["deterministic"] = true;
    j["micro_batches"] = micro_batches;
  }
  // Only in an extended run, so that other checkpoints keep their config.
  if (schedule_length() != steps) j["schedule_steps"] = schedule_length();
  return j;
}

absl::StatusOr<int64_t> ResumeScheduleSteps(const TrainConfig& config,
                                            const std::string& checkpoint_dir,
                                            int64_t checkpoint_step,
                                            const nlohmann::json& checkpoint_config) {
  // The marker's metadata is read from disk: nothing in it is trusted.
  const std::string where = absl::StrCat("corrupt checkpoint marker ", checkpoint_dir, "/",
                                         train_state::kMarkerName, ": metadata.config");
  if (!checkpoint_config.is_object()) {
    return absl::DataLossError(absl::StrCat(where, ": is not a JSON object"));
  }
  for (const char* key : {"steps", "schedule_steps"}) {
    if (checkpoint_config.contains(key) &&
        (!checkpoint_config[key].is_number_integer() || checkpoint_config[key].get<int64_t>() < 0)) {
      return absl::DataLossError(
          absl::StrCat(where, ".", key, ": is ", checkpoint_config[key].dump(),
                       ", not an integer >= 0"));
    }
  }
  const nlohmann::json& saved = checkpoint_config;
  const nlohmann::json want = config.ToJson();
  for (const auto& [key, value] : want.items()) {
    if (key == "steps" || key == "schedule_steps") continue;  // a run may be extended
    if (!saved.contains(key) || saved[key] != value) {
      const std::string fix =
          saved.contains(key)
              ? absl::StrCat("--", key, "=",
                             saved[key].is_string() ? saved[key].get<std::string>()
                                                    : saved[key].dump())
              : absl::StrCat("the --", key, " of the run that wrote it");
      return absl::FailedPreconditionError(absl::StrCat(
          "resume: checkpoint ", checkpoint_dir, " has ", key, " = ",
          saved.contains(key) ? saved[key].dump() : "(missing)", ", this run has ", value.dump(),
          "; resume with ", fix, ", or start a new run in another --out_dir"));
    }
  }
  // A setting the saved run had and this run leaves at its default (ToJson() omits defaults
  // such as tensor_parallel 1, pipeline_stages 1, moe_experts 0): another parallel layout.
  for (const auto& [key, value] : saved.items()) {
    if (key == "steps" || key == "schedule_steps" || want.contains(key)) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "resume: checkpoint ", checkpoint_dir, " has ", key, " = ", value.dump(),
        ", this run has the default; resume with --", key, "=",
        value.is_string() ? value.get<std::string>() : value.dump(),
        ", or start a new run in another --out_dir"));
  }
  if (config.steps < checkpoint_step) {
    return absl::InvalidArgumentError(absl::StrCat(
        "resume: checkpoint ", checkpoint_dir, " is at step ", checkpoint_step,
        ", past --steps=", config.steps, "; pass --steps greater than ", checkpoint_step,
        " to train longer from it"));
  }
  int64_t schedule = 0;
  if (saved.contains("schedule_steps")) {
    schedule = saved["schedule_steps"].get<int64_t>();
  } else if (saved.contains("steps")) {
    schedule = saved["steps"].get<int64_t>();
  }
  return schedule > 0 ? schedule : config.steps;
}

absl::Status CheckWritableDir(const std::string& dir, absl::string_view what) {
  if (dir.empty()) return absl::OkStatus();
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(absl::StrCat("cannot create ", dir, " (", what, "): ",
                                                    ec.message(), "; choose a writable --out_dir"));
  }
  const std::string probe = absl::StrCat(dir, "/.train_gpt_write_test.", ::getpid());
  std::FILE* f = std::fopen(probe.c_str(), "w");
  if (f == nullptr) {
    return absl::PermissionDeniedError(absl::StrCat("cannot write in ", dir, " (", what, "): ",
                                                    std::strerror(errno),
                                                    "; choose a writable --out_dir"));
  }
  std::fclose(f);
  std::remove(probe.c_str());
  return absl::OkStatus();
}

namespace {

std::string ParentDir(const std::string& path) {
  return std::filesystem::path(path).parent_path().string();
}

}  // namespace

absl::Status CheckBeforeLaunch(const TrainConfig& config, int world_size) {
  FS_RETURN_IF_ERROR(config.Validate());
  if (config.pipeline_stages > 1 && world_size % config.pipeline_stages != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline_stages ", config.pipeline_stages, " does not divide the rank count ",
        world_size, " (each of ranks / pipeline_stages replicas runs the whole pipeline); use "
        "--nproc_per_node=", config.pipeline_stages, " or a multiple of it"));
  }
  if (config.tensor_parallel > 1 && world_size % config.tensor_parallel != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor_parallel ", config.tensor_parallel, " does not divide the rank count ",
        world_size, " (each of ranks / tensor_parallel replicas is a tensor-parallel group of ",
        config.tensor_parallel, " ranks); use --nproc_per_node=", config.tensor_parallel,
        " or a multiple of it"));
  }
  if (config.tensor_parallel > 1 && config.pipeline_stages > 1 &&
      world_size % (config.tensor_parallel * config.pipeline_stages) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor_parallel ", config.tensor_parallel, " x pipeline_stages ", config.pipeline_stages,
        " does not divide the rank count ", world_size));
  }
  if (config.moe_experts > 0 && config.moe_experts % world_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "moe_experts ", config.moe_experts, " is not divisible by the rank count ", world_size,
        " (each rank holds moe_experts / ranks experts)"));
  }
  if (config.deterministic && config.micro_batches % world_size != 0) {
    std::string ok;
    for (int64_t w = 1; w <= config.micro_batches; ++w) {
      if (config.micro_batches % w == 0) absl::StrAppend(&ok, ok.empty() ? "" : ", ", w);
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "--micro_batches=", config.micro_batches, " cannot be split evenly over ", world_size,
        " ranks (each rank runs the same number of whole micro-batches); use a rank count that "
        "divides it (", ok, ") or another --micro_batches"));
  }
  if (config.data_parallel == "fsdp" && config.pipeline_stages == 1 &&
      absl::StartsWith(config.strategy, "hybrid_shard") && config.hybrid_shard_group_size > 0 &&
      world_size % config.hybrid_shard_group_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hybrid_shard_group_size ", config.hybrid_shard_group_size,
        " does not divide the rank count ", world_size,
        "; use a divisor of it, or --nproc_per_node as a multiple of the group size"));
  }
  if (config.fault_tolerant && config.ft_min_groups > world_size / config.hybrid_shard_group_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--ft_min_groups=", config.ft_min_groups, " is more than the ",
        world_size / config.hybrid_shard_group_size, " replica groups of ",
        config.hybrid_shard_group_size, " ranks that ", world_size, " ranks make"));
  }
  // Sizes before paths: memory is the first thing a large --seq or --batch runs out of.
  const double need = EstimateRankBytes(config, /*vocab=*/256);  // a byte vocabulary at most
  const double have = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) *
                      static_cast<double>(::sysconf(_SC_PAGE_SIZE));
  if (have > 0 && need * world_size > have) {
    auto gb = [](double b) { return absl::StrFormat("%.1f GB", b / 1e9); };
    return absl::InvalidArgumentError(absl::StrCat(
        "--batch=", config.batch, " and --seq=", config.seq, " (with --width=", config.width,
        ", --blocks=", config.blocks, ", --heads=", config.heads, ") need about ", gb(need),
        " per rank (an estimate: parameters, gradients, Adam state and one step's activations), "
        "more than this machine's ", gb(have), " of memory holds for ", world_size, " rank",
        world_size == 1 ? "" : "s", "; lower --seq or --batch"));
  }
  FS_RETURN_IF_ERROR(CheckWritableDir(ParentDir(config.metrics_path), "--metrics"));
  FS_RETURN_IF_ERROR(CheckWritableDir(ParentDir(config.plot_path), "--plot"));
  FS_RETURN_IF_ERROR(CheckWritableDir(config.checkpoint_dir, "--checkpoint_dir"));
  if (!config.trace_path.empty()) {
    FS_RETURN_IF_ERROR(CheckWritableDir(ParentDir(config.trace_path), "--trace"));
  }
  if (config.optimizer_offload == "disk") {
    FS_RETURN_IF_ERROR(CheckWritableDir(config.offload_dir, "--offload_dir"));
  }
  if (config.resume == ResumeMode::kNever) {
    if (config.overwrite_checkpoints || config.checkpoint_dir.empty()) return absl::OkStatus();
    return RefuseToOverwriteCheckpoints(config.checkpoint_dir);
  }
  if (config.checkpoint_dir.empty()) {
    return absl::InvalidArgumentError(
        "resume needs a checkpoint directory: drop --checkpoint_dir=none, or --resume");
  }
  absl::StatusOr<std::optional<LatestCheckpoint>> latest =
      FindLatestCheckpoint(config.checkpoint_dir);
  if (!latest.ok()) return WithOlderCheckpointHint(latest.status(), config.checkpoint_dir);
  if (!latest->has_value()) {
    return config.resume == ResumeMode::kRequired ? NoCompleteCheckpointError(config.checkpoint_dir)
                                                  : absl::OkStatus();
  }
  const LatestCheckpoint& c = **latest;
  FS_RETURN_IF_ERROR(
      ResumeScheduleSteps(config, c.dir, c.marker.step, MarkerConfig(c.marker)).status());
  return WithOlderCheckpointHint(train_state::VerifyFiles(c.dir, c.marker),
                                 config.checkpoint_dir);
}

double EstimateRankBytes(const TrainConfig& c, int64_t vocab) {
  const double b = static_cast<double>(c.batch), t = static_cast<double>(c.seq),
               w = static_cast<double>(c.width), l = static_cast<double>(c.blocks),
               h = static_cast<double>(c.heads), v = static_cast<double>(vocab);
  // Parameters: per block attention (4 w^2) and MLP (8 w^2), the embeddings and the head; in f32
  // master, gradient, two Adam moments and a compute copy: 20 bytes each.
  const double params = l * (12 * w * w + 13 * w) + 2 * v * w + t * w;
  // Activations kept for backward, f32: per block the attention scores and their softmax
  // (2 b h t^2) and about 18 b t w (layer norms, q k v, projections, the MLP's 4w hidden twice,
  // residuals); a checkpointed block keeps only its input (b t w) and one block is recomputed
  // at a time. The logits three times (the logits, their f32 copy, the softmax gradient).
  const double block = 2 * b * h * t * t + 18 * b * t * w;
  double kept_blocks = l;
  absl::StatusOr<int64_t> every_k = ParseCheckpointActivations(c.checkpoint_activations);
  if (c.pipeline_stages == 1 && every_k.ok() && *every_k > 0 && l > 0) {
    const double checkpointed = std::ceil(l / static_cast<double>(*every_k));
    kept_blocks = l - checkpointed + 1;  // + the one being recomputed
  }
  const double activations =
      kept_blocks * block + (l - kept_blocks > 0 ? (l - kept_blocks) * b * t * w : 0) +
      3 * b * t * v + 2 * b * t * w;
  return 20 * params + 4 * activations;
}

double LearningRate(const TrainConfig& c, int64_t step) {
  if (c.warmup_steps > 0 && step <= c.warmup_steps) {
    return c.lr * static_cast<double>(step) / c.warmup_steps;
  }
  const double span = std::max<int64_t>(1, c.schedule_length() - c.warmup_steps);
  const double progress = std::min(1.0, (step - c.warmup_steps) / span);
  const double min_lr = c.lr * c.min_lr_ratio;
  return min_lr + 0.5 * (c.lr - min_lr) * (1 + std::cos(M_PI * progress));
}

}  // namespace fairscale::examples::gpt
