#include "examples/gpt/checkpoints.h"

#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace fairscale::examples::gpt {
namespace {

// The COMPLETE formats train_gpt wrote before //train_state ("rank_files" had no "format").
bool IsLegacyFormat(const std::string& f) {
  return f == "rank_files" || f == "fsdp_sharded" || f == "pipe_stages" ||
         f == "pipe_fsdp_sharded";
}

// kFailedPrecondition naming the format when `step_dir`'s COMPLETE is one of train_gpt's
// formats from before //train_state; OK otherwise (including when it does not parse: the
// marker reader names that).
absl::Status CheckNotLegacy(const std::string& step_dir) {
  absl::StatusOr<std::string> text =
      train_state::ReadFile(absl::StrCat(step_dir, "/", train_state::kMarkerName));
  if (!text.ok()) return absl::OkStatus();
  const nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("files") || !j["files"].is_array()) return absl::OkStatus();
  std::string format = "rank_files";
  if (j.contains("format")) {
    if (!j["format"].is_string()) return absl::OkStatus();
    format = j["format"].get<std::string>();
  }
  if (!IsLegacyFormat(format)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "checkpoint ", step_dir, " is in train_gpt's format \"", absl::CEscape(format),
      "\" from before the job used //train_state; this build reads only \"",
      train_state::kMarkerFormat,
      "\" step directories and does not load it: resume it with a train_gpt built before the "
      "change (git log -1 -- examples/gpt/checkpoint_dir.cc), or start from step 0 with "
      "--overwrite_checkpoints (deletes it) or with another --out_dir"));
}

}  // namespace

absl::StatusOr<std::optional<LatestCheckpoint>> FindLatestCheckpoint(const std::string& root) {
  for (const train_state::StepEntry& e : train_state::ListSteps(root)) {
    if (!e.complete) continue;
    if (absl::Status legacy = CheckNotLegacy(e.dir); !legacy.ok()) return legacy;
    absl::StatusOr<train_state::Marker> m = train_state::ReadMarker(e.dir, e.step);
    if (!m.ok()) return m.status();
    return std::optional<LatestCheckpoint>(LatestCheckpoint{e.dir, *std::move(m)});
  }
  return std::optional<LatestCheckpoint>();
}

nlohmann::json MarkerConfig(const train_state::Marker& marker) {
  const nlohmann::json& m = marker.metadata;
  return m.is_object() && m.contains("config") ? m["config"] : nlohmann::json();
}

std::optional<std::string> MarkerFullParamHash(const train_state::Marker& marker) {
  const nlohmann::json& m = marker.metadata;
  if (!m.is_object() || !m.contains("full_param_fnv1a64") || !m["full_param_fnv1a64"].is_string()) {
    return std::nullopt;
  }
  return m["full_param_fnv1a64"].get<std::string>();
}

absl::Status NoCompleteCheckpointError(const std::string& root) {
  return absl::NotFoundError(absl::StrCat(
      "resume: no complete checkpoint (a step_* directory with ", train_state::kMarkerName,
      ") under ", root,
      "; run without --resume to start from step 0, or with --resume=auto to resume only when "
      "there is one"));
}

absl::Status RefuseToOverwriteCheckpoints(const std::string& root) {
  int complete = 0;
  std::string newest;
  for (const train_state::StepEntry& e : train_state::ListSteps(root)) {
    if (!e.complete) continue;
    if (complete++ == 0) newest = e.dir;
  }
  if (complete == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      root, " already holds ", complete, " complete checkpoint", complete == 1 ? "" : "s",
      " (newest ", newest, "), which a run from step 0 would delete: run with --resume to "
      "continue from the newest, with --overwrite_checkpoints to delete them and start from step "
      "0, or with another --out_dir to keep them"));
}

absl::Status RemoveAllCheckpoints(const std::string& root) {
  for (const train_state::StepEntry& e : train_state::ListSteps(root)) {
    if (absl::Status s = train_state::RemoveStepDir(e.dir); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status WithOlderCheckpointHint(const absl::Status& error, const std::string& root) {
  if (error.ok() || error.code() != absl::StatusCode::kDataLoss) return error;
  std::string newest;
  for (const train_state::StepEntry& e : train_state::ListSteps(root)) {
    if (!e.complete) continue;
    if (newest.empty()) {
      newest = e.dir;
      continue;
    }
    absl::StatusOr<train_state::Marker> m = train_state::ReadMarker(e.dir, e.step);
    if (!m.ok() || !train_state::VerifyFiles(e.dir, *m).ok()) continue;
    return absl::Status(
        error.code(),
        absl::StrCat(error.message(), "; the newest intact checkpoint before it is ", e.dir,
                     " (step ", e.step, "): to resume from it, move the damaged one aside (mv ",
                     newest, " ", newest, ".damaged) and run with --resume again"));
  }
  return absl::Status(error.code(),
                      absl::StrCat(error.message(), "; no older intact checkpoint is under ", root,
                                   ": start again without --resume (with another --out_dir to "
                                   "keep these files)"));
}

}  // namespace fairscale::examples::gpt
