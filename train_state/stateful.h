// What a CheckpointManager saves and restores (//train_state): a TrainState is a named collection
// of Stateful items, each knowing how to save and load itself. items.h has the built-in ones
// (an FSDP model with its optimizer, a replicated module and optimizer, a sampler's position,
// the loss scaler, RNG states, user JSON); a user's own item implements Stateful.
//
// Saving is in two phases so that a save can run in the background while training goes on:
//   snapshot()  on the training thread, at the same point on every rank (it may communicate on
//               the training communicator): copies what this rank saves into host memory;
//   write()     on any thread, with no communication: writes this rank's files, each
//               atomically, into the item's directory; then, on every rank and after every
//               rank's write() succeeded, finalize() writes what needs every rank's result
//               (FSDP's manifest, on rank 0; a pipeline stage's, on the stage's first rank).
// Restoring is staged: restore() reads and checks everything (collectively if it must) without
// changing the item and returns the function that applies it; the manager applies the items
// only once every item on every rank has staged successfully, so a bad checkpoint changes
// nothing.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"

namespace fairscale::train_state {

// What one rank's write() produced.
struct WriteResult {
  // Written into the item's directory: relative paths of plain names (CheckRelativePath).
  std::vector<std::string> files;
  nlohmann::json info;  // handed to every rank's finalize() (null if unused)
};

struct SaveContext {
  int64_t step = 0;
  int rank = 0;
  int world_size = 1;
};

struct RestoreContext {
  int rank = 0;
  int world_size = 1;
  std::string dir;  // the item's directory in the step directory
  int64_t step = 0;
  int saved_world_size = 0;  // of the run that saved it
  std::vector<std::string> files;  // the item's files, as the marker lists them
};

class Stateful {
 public:
  virtual ~Stateful() = default;

  // Recorded in the marker; a restore into an item of another kind is an error naming both.
  virtual std::string kind() const = 0;

  class Snapshot {
   public:
    virtual ~Snapshot() = default;
    // Any thread, no communication. Errors (kDataLoss, kResourceExhausted for a full disk)
    // name the file.
    virtual absl::StatusOr<WriteResult> write(const std::string& dir) = 0;
    // Every rank, after every rank's write() succeeded; results[r] is rank r's. Returns the
    // names of the files this rank wrote into `dir` (none, for most items and ranks).
    virtual absl::StatusOr<std::vector<std::string>> finalize(
        const std::string& dir, const std::vector<WriteResult>& results) {
      (void)dir;
      (void)results;
      return std::vector<std::string>();
    }
  };

  // Training thread, same point on every rank. `reuse`: this item's snapshot from the previous
  // save (null on the first), whose host buffers may be reused. Throws c10::Error.
  virtual std::unique_ptr<Snapshot> snapshot(const SaveContext& context,
                                             std::unique_ptr<Snapshot> reuse) = 0;

  // Training thread, same point on every rank. Reads and checks; throws c10::Error naming the
  // file (or what differs) without changing the item; returns what applies it.
  virtual std::function<void()> restore(const RestoreContext& context) = 0;
};

// The named items of the training state, in the order they are snapshotted and restored.
class TrainState {
 public:
  // `name`: a plain name ([A-Za-z0-9_.-]), the item's directory in a step directory; unique.
  // Throws c10::Error otherwise.
  TrainState& add(const std::string& name, std::shared_ptr<Stateful> item);
  const std::vector<std::pair<std::string, std::shared_ptr<Stateful>>>& items() const {
    return items_;
  }

 private:
  std::vector<std::pair<std::string, std::shared_ptr<Stateful>>> items_;
};

}  // namespace fairscale::train_state
