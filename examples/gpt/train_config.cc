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
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "examples/gpt/checkpoint_dir.h"
#include "examples/gpt/parallel_model.h"
#include "examples/gpt/trainer.h"

namespace fairscale::examples::gpt {

absl::Status TrainConfig::Validate() const {
  auto positive = [](absl::string_view name, int64_t v) {
    return v > 0 ? absl::OkStatus()
                 : absl::InvalidArgumentError(absl::StrCat(name, " must be > 0, got ", v));
  };
  FS_RETURN_IF_ERROR(positive("steps", steps));
  FS_RETURN_IF_ERROR(positive("batch", batch));
  FS_RETURN_IF_ERROR(positive("seq", seq));
  FS_RETURN_IF_ERROR(positive("width", width));
  FS_RETURN_IF_ERROR(positive("heads", heads));
  FS_RETURN_IF_ERROR(positive("keep_checkpoints", keep_checkpoints));
  if (blocks < 0) return absl::InvalidArgumentError("blocks must be >= 0");
  if (width % heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("width ", width, " is not divisible by heads ", heads));
  }
  if (!(lr > 0)) return absl::InvalidArgumentError("lr must be > 0");
  if (!(temperature > 0)) return absl::InvalidArgumentError("temperature must be > 0");
  if (warmup_steps < 0 || checkpoint_every < 0 || eval_every < 0 || stop_after < 0) {
    return absl::InvalidArgumentError(
        "warmup_steps, checkpoint_every, eval_every and stop_after must be >= 0");
  }
  if (sample_tokens > 0 && prompt.empty()) {
    return absl::InvalidArgumentError("prompt must not be empty when sampling");
  }
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
  // Only in an extended run, so that other checkpoints keep their config.
  if (schedule_length() != steps) j["schedule_steps"] = schedule_length();
  return j;
}

absl::StatusOr<int64_t> ResumeScheduleSteps(const TrainConfig& config,
                                            const std::string& checkpoint_dir,
                                            int64_t checkpoint_step,
                                            const nlohmann::json& checkpoint_config) {
  nlohmann::json saved = checkpoint_config;
  // Checkpoints written before data_parallel existed are FSDP ones.
  if (!saved.contains("data_parallel")) saved["data_parallel"] = "fsdp";
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

namespace {

// Creates `dir` and checks that a file can be written in it.
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
  if (config.data_parallel == "fsdp" && config.pipeline_stages == 1 &&
      absl::StartsWith(config.strategy, "hybrid_shard") && config.hybrid_shard_group_size > 0 &&
      world_size % config.hybrid_shard_group_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hybrid_shard_group_size ", config.hybrid_shard_group_size,
        " does not divide the rank count ", world_size,
        "; use a divisor of it, or --nproc_per_node as a multiple of the group size"));
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
  if (config.resume == ResumeMode::kNever) return absl::OkStatus();
  if (config.checkpoint_dir.empty()) {
    return absl::InvalidArgumentError(
        "resume needs a checkpoint directory: drop --checkpoint_dir=none, or --resume");
  }
  absl::StatusOr<std::optional<CompleteCheckpoint>> latest =
      FindLatestComplete(config.checkpoint_dir);
  if (!latest.ok()) return WithOlderCheckpointHint(latest.status(), config.checkpoint_dir);
  if (!latest->has_value()) {
    return config.resume == ResumeMode::kRequired ? NoCompleteCheckpointError(config.checkpoint_dir)
                                                  : absl::OkStatus();
  }
  const CompleteCheckpoint& c = **latest;
  FS_RETURN_IF_ERROR(ResumeScheduleSteps(config, c.dir, c.step, c.config).status());
  return WithOlderCheckpointHint(VerifyCheckpoint(c), config.checkpoint_dir);
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
