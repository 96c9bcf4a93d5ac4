// The GPT job's checkpoint policy (//examples/gpt:checkpoints): which checkpoint a run resumes
// from and what it may delete. The checkpoints themselves are //train_state's: step directories
// under --checkpoint_dir, each with one directory per item of the job's TrainState and a COMPLETE
// marker written last (train_state/step_dir.h); the trainer saves and restores them with a
// train_state::CheckpointManager. What the job adds:
//   - the marker's metadata: {"config": TrainConfig::ToJson(), "full_param_fnv1a64": "<hex>",
//     "mode": the mode's label}; a resume checks the config (ResumeScheduleSteps) and, after
//     loading, the full parameters' hash;
//   - a run from step 0 refuses a directory that holds complete checkpoints (they would be
//     deleted) unless told to overwrite them;
//   - a damaged newest checkpoint names the newest older one that is intact;
//   - the step directories train_gpt wrote before it used //train_state (COMPLETE of formats
//     "rank_files", "fsdp_sharded", "pipe_stages", "pipe_fsdp_sharded") are refused with an error
//     naming the format and what to do: they do not load.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "train_state/step_dir.h"

namespace fairscale::examples::gpt {

// The newest complete checkpoint under `root` and its marker (nullopt if none, or if `root` does
// not exist). A marker that does not read is kDataLoss naming it ("corrupt checkpoint marker
// ..."); one train_gpt wrote before //train_state is kFailedPrecondition naming its format.
struct LatestCheckpoint {
  std::string dir;  // the step directory
  train_state::Marker marker;
};
absl::StatusOr<std::optional<LatestCheckpoint>> FindLatestCheckpoint(const std::string& root);

// The marker's metadata.config (null when absent: ResumeScheduleSteps reports it) and
// metadata.full_param_fnv1a64 (nullopt when absent or not a string).
nlohmann::json MarkerConfig(const train_state::Marker& marker);
std::optional<std::string> MarkerFullParamHash(const train_state::Marker& marker);

// kNotFound for --resume when `root` holds no complete checkpoint, saying how to start from
// step 0 or resume only when there is one.
absl::Status NoCompleteCheckpointError(const std::string& root);

// For a run that starts from step 0 (no --resume): kFailedPrecondition when `root` holds a step
// directory with COMPLETE, naming the newest and saying how to continue from it (--resume),
// delete them (--overwrite_checkpoints) or keep them (another --out_dir). OK when there is none.
absl::Status RefuseToOverwriteCheckpoints(const std::string& root);

// Deletes every step directory under `root` (--overwrite_checkpoints; COMPLETE goes first, so a
// crash mid-delete never leaves a complete-looking partial directory).
absl::Status RemoveAllCheckpoints(const std::string& root);

// `error` (kDataLoss, about the newest complete checkpoint under `root`: damaged, unreadable) with
// what to do appended: which older complete checkpoint is intact (its files verify against its
// marker) and how to resume from it (move the damaged one aside), or that none is. Other errors
// come back unchanged.
absl::Status WithOlderCheckpointHint(const absl::Status& error, const std::string& root);

}  // namespace fairscale::examples::gpt
