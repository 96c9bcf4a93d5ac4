// CheckpointManager (//train_state): the training state of a job (a TrainState: the model, its
// optimizer, the data position, the loss scaler, RNG states, user JSON) saved into step
// directories and restored from the newest complete one, by every rank together.
//
//   train_state::TrainState state;
//   state.add("model", train_state::fsdp_item(model, &optimizer))
//        .add("data", train_state::sampler_item(sampler));
//   train_state::CheckpointManager manager(comm, train_state::CheckpointManagerOptions("/ckpt")
//                                                    .keep_last(3).async(true));
//   int64_t start = manager.restore(state).value_or(0);   // a fresh run gets nullopt
//   for (int64_t step = start; step < steps; ++step) {
//     ...;
//     if ((step + 1) % 100 == 0) manager.save(step + 1, state);
//   }
//   manager.wait();
//
// Directory layout and marker: step_dir.h. A save: every item snapshots (training thread), then
// every rank writes its files (atomically), the ranks exchange what they wrote, every rank
// finalizes the items (FSDP's manifest, on rank 0), the ranks exchange that too, and rank 0
// writes COMPLETE (with every file's size and checksum) last and applies the retention policy. A save interrupted anywhere (a killed rank, a full disk) leaves no COMPLETE
// in its directory: the previous checkpoints are untouched, and the next save or restore removes
// the leftovers. With async(true), save() returns after the snapshot and the rest runs on a
// background thread, while training continues; at most one save is in flight (the next save()
// and wait() wait for it), its snapshot buffers are reused by the next, and its error is thrown
// by the next save(), wait() or restore().
//
// The manager talks to the other ranks on a communicator of its own (split from the training one
// at construction), so a background save never interleaves with training collectives.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/arg.h>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "comm/communicator.h"
#include "train_state/stateful.h"
#include "train_state/step_dir.h"

namespace fairscale::train_state {

struct CheckpointManagerOptions {
  explicit CheckpointManagerOptions(std::string root) : root_(std::move(root)) {}
  // The directory holding the step directories (created if missing).
  TORCH_ARG(std::string, root);
  // Retention: the newest keep_last (>= 1) complete checkpoints, plus every one whose step is a
  // multiple of keep_every (0: none). The newest complete one is never deleted.
  TORCH_ARG(int, keep_last) = 3;
  TORCH_ARG(int64_t, keep_every) = 0;
  // save() returns after the snapshot; the files are written in the background.
  TORCH_ARG(bool, async) = false;
  // restore() checks every file against the marker's size and checksum before loading.
  TORCH_ARG(bool, verify_on_restore) = true;
  // Bound on each exchange between the ranks during a save or restore (a rank that died or
  // hangs mid-save is reported after this, naming it).
  TORCH_ARG(double, timeout_s) = 600;
};

class CheckpointManager {
 public:
  // Collective (splits `comm`). Throws c10::Error for bad options or an unusable root.
  CheckpointManager(std::shared_ptr<comm::Communicator> comm, CheckpointManagerOptions options);
  // Waits for a save in flight; its error, if any, is logged (not thrown).
  ~CheckpointManager();
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;

  // Collective. Saves `state` as step `step` (> every complete step under root; throws
  // otherwise), with `metadata` (a JSON object) in the marker. Sync: returns once COMPLETE is
  // written. Async: returns after the snapshot. Throws c10::Error naming the rank, file and
  // step on failure (async: the failure of the previous save).
  void save(int64_t step, TrainState& state,
            const nlohmann::json& metadata = nlohmann::json::object());

  // Collective. Restores `state` from step `step`, or from the newest complete checkpoint when
  // `step` is nullopt; returns the step restored, or nullopt when root holds no complete
  // checkpoint (a fresh start; only when `step` is nullopt). Every item of `state` must be in the
  // checkpoint with the same kind, and every item of the checkpoint in `state`. Throws c10::Error
  // naming the file or item on a damaged or mismatching checkpoint; then nothing was changed.
  std::optional<int64_t> restore(TrainState& state, std::optional<int64_t> step = std::nullopt);

  // The marker of the checkpoint restore() loaded last (its metadata, world size, items).
  const std::optional<Marker>& restored_marker() const { return restored_; }

  // The newest complete step under root, and all complete steps (ascending); local reads.
  std::optional<int64_t> latest_complete() const;
  std::vector<int64_t> all_steps() const;

  // Waits for the save in flight (if any) on this rank; throws its error.
  void wait();
  // Whether a save is in flight on this rank.
  bool in_flight() const;

  const CheckpointManagerOptions& options() const { return options_; }

 private:
  struct Job;
  absl::Status RunSave(Job& job);
  absl::Status RunSaveUnchecked(Job& job);
  absl::Status WriteMarkerOnRank0(Job& job, const std::string& step_dir,
                                  const std::vector<std::string>& written,
                                  const std::vector<std::string>& finalized);
  absl::StatusOr<std::vector<std::string>> Exchange(const std::string& mine,
                                                    const std::string& what);
  absl::Status Agree(const absl::Status& mine, const std::string& what);
  // Exchange of this rank's status and, when OK, its JSON payload: every rank's payload, or an
  // error naming the first rank that failed (this rank's own error first).
  absl::StatusOr<std::vector<std::string>> ExchangeResults(const absl::Status& mine,
                                                           const nlohmann::json& payload,
                                                           const std::string& what,
                                                           const std::string& stage);

  std::shared_ptr<comm::Communicator> comm_;
  std::shared_ptr<comm::Communicator> own_;  // the manager's communicator
  CheckpointManagerOptions options_;
  std::optional<Marker> restored_;
  // Snapshots of the last save by item name, reused by the next.
  std::vector<std::pair<std::string, std::unique_ptr<Stateful::Snapshot>>> reuse_;

  mutable absl::Mutex mu_;
  std::thread worker_;
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status worker_status_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Job> job_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fairscale::train_state
