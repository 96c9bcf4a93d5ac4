// Sharded checkpoints of a FullyShardedDataParallel model and its optimizer on disk (//fsdp),
// loadable at any world size. Saving is collective and gathers nothing: each rank writes one
// file with the ranges of the original (unwrapped) parameters and of their optimizer state that
// its shards hold, and rank 0 then writes a manifest (JSON: world size, units, every parameter's
// name, shape and dtype, the optimizer's kind, groups and steps, and each file's size and
// checksum), after all files are committed; every file is written atomically (tmp, fsync,
// rename), so a directory with a manifest holds a complete checkpoint.
//
//   fsdp::save_sharded_checkpoint(model, &opt, "/ckpt/step_1000");   // at 4 ranks
//   ...
//   fsdp::load_sharded_checkpoint(model, &opt, "/ckpt/step_1000");   // at 1, 2, 3, 4, 8... ranks
//
// Loading reads the manifest and the headers of the files, then only the records that overlap
// this rank's shards, each checked against its checksum, and builds its shards and optimizer
// state. Everything is checked on every rank (and the ranks agree) before any model or optimizer
// changes: a missing, truncated or corrupt file is DATA_LOSS naming the file (and the tensor); a
// model or optimizer that does not match (names, shapes, dtypes, kind, groups) is
// INVALID_ARGUMENT naming the tensor. The model must have the same parameters (names, shapes)
// as the saved one; its wrapping (units) and world size may differ.
//
// consolidate_sharded_checkpoint (and the //fsdp:consolidate_checkpoint tool) turns a sharded
// checkpoint into a full state dict offline, without ranks.
//
// Saving in phases, for asynchronous checkpointing (a checkpoint manager overlapping the writing
// with training); save_sharded_checkpoint is these phases composed, so both write the same bytes:
//
//   auto snap = fsdp::snapshot_sharded_checkpoint(model, &opt, &previous);  // 1: training thread
//   auto summary = snap.write(dir);            // 2: any thread, no communication; dir must exist
//   ... every rank's write succeeded (the caller agrees on that over its own communicator) ...
//   if (rank == 0) fsdp::write_sharded_manifest(snap, summaries, dir);     // 3: rank 0, last
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/state_dict.h"

namespace fairscale::fsdp {
namespace internal {
struct Manifest;
struct SnapshotAccess;
}  // namespace internal

// Collective. `optimizer` may be null (model only); it must step model->parameters().
// Creates `dir` if needed; rank 0 removes an old manifest there first (a manifest must not vouch
// for the files being replaced); then snapshot_sharded_checkpoint (without copying host tensors:
// the save is synchronous), write, an all-gather of the files' summaries, and
// write_sharded_manifest. Raises c10::Error on every rank if any rank failed.
void save_sharded_checkpoint(FullyShardedDataParallel& model,
                             const torch::optim::Optimizer* optimizer, const std::string& dir);

// What rank 0's manifest records about one rank's committed file.
struct ShardFileSummary {
  std::string name;  // relative to the checkpoint directory: "rank00003.shard"
  int64_t bytes = 0;
  uint64_t fnv1a = 0;         // of the whole file
  uint64_t header_fnv1a = 0;  // of its header JSON
};

// This rank's part of a sharded checkpoint, copied into host memory (save phase 1): the records
// of its file in file order and, on rank 0, the manifest without its files. It shares no memory
// with the model or the optimizer, so training may go on while another thread writes it.
// Move-only. A default-constructed snapshot is empty (world_size() 0): a `reuse` before the first
// save.
class ShardedCheckpointSnapshot {
 public:
  // One record of the rank file: elements [begin, end) of the flattened tensor `key`.
  struct Record {
    std::string key;             // "p/<param>", "o/<param>/<state>", "b/<buffer>"
    std::vector<int64_t> shape;  // of the whole original tensor
    int64_t begin = 0;
    int64_t end = 0;
    at::Tensor value;  // on the CPU, 1-D, end - begin elements; its dtype is the record's
  };

  ShardedCheckpointSnapshot();
  ~ShardedCheckpointSnapshot();
  ShardedCheckpointSnapshot(ShardedCheckpointSnapshot&&) noexcept;
  ShardedCheckpointSnapshot& operator=(ShardedCheckpointSnapshot&&) noexcept;

  // Phase 2. Any thread, no communication, never throws: writes this rank's file
  // (RankFileName: "rank%05d.shard") into `dir`, which must exist, atomically (tmp, fsync,
  // rename, fsync of the directory; //base:atomic_file), and returns what rank 0's manifest
  // needs about it. On failure an error naming the file and the errno's text: kDataLoss (a
  // missing or read-only directory, an I/O error), kResourceExhausted for a full disk or quota
  // ("No space left on device"); nothing is left under the file's final name nor its tmp name
  // ("<file>.tmp.<pid>"). kFailedPrecondition for an empty snapshot. The snapshot must not be a
  // `reuse` of a snapshot being taken meanwhile; concurrent write()s of one snapshot are fine.
  absl::StatusOr<ShardFileSummary> write(const std::string& dir) const;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int64_t bytes() const;  // host memory held by the records' values
  const std::vector<Record>& records() const { return records_; }

 private:
  friend struct internal::SnapshotAccess;
  int rank_ = 0;
  int world_size_ = 0;
  std::vector<Record> records_;
  std::unique_ptr<internal::Manifest> manifest_;  // rank 0: the manifest without `files`
};

// Phase 1, on the training thread. Not collective: the layout (units, shards, owned ranges), the
// optimizer state and groups are all local to the rank. Copies (never aliases: training goes on
// and updates parameters and optimizer state in place) this rank's owned pieces of the
// parameters and of their optimizer state, and on rank 0 the buffers, into host tensors (for a
// CUDA model the device-to-host copy is synchronous). `optimizer` as in save_sharded_checkpoint.
// `reuse`: a previous snapshot of the same model, left empty; record i reuses its value tensor
// when dtype and size match (on the steady state every record does: no allocation). It must not
// be being written meanwhile. Raises c10::Error (an optimizer over other tensors, an unsupported
// kind: INVALID_ARGUMENT).
ShardedCheckpointSnapshot snapshot_sharded_checkpoint(FullyShardedDataParallel& model,
                                                      const torch::optim::Optimizer* optimizer,
                                                      ShardedCheckpointSnapshot* reuse = nullptr);

// Phase 3, rank 0 only, after every rank's write() succeeded (and, when `dir` held an earlier
// checkpoint, after its manifest was removed before any rank wrote): writes manifest.json into
// `dir` atomically from rank 0's snapshot and every rank's summary (summaries[r]: rank r's).
// Never throws: kFailedPrecondition for another rank's snapshot, kInvalidArgument for summaries
// that are not one per rank with the rank files' names, kDataLoss naming the file on I/O errors
// (kResourceExhausted for a full disk or quota).
absl::Status write_sharded_manifest(const ShardedCheckpointSnapshot& rank0,
                                    const std::vector<ShardFileSummary>& summaries,
                                    const std::string& dir);

// Collective. With a non-null `optimizer`, the checkpoint must hold optimizer state of the same
// kind and grouping; the groups' hyper-parameters are restored too.
void load_sharded_checkpoint(FullyShardedDataParallel& model, torch::optim::Optimizer* optimizer,
                             const std::string& dir);

// load_sharded_checkpoint in two steps (for train_state, which stages every item of a training
// state before applying any): reads and checks everything and agrees with the other ranks
// (collective; throws as load_sharded_checkpoint does, nothing changed), and returns what
// applies it to `model` and `optimizer` (local; call it once, on every rank).
std::function<void()> stage_sharded_checkpoint(FullyShardedDataParallel& model,
                                               torch::optim::Optimizer* optimizer,
                                               const std::string& dir);

struct ConsolidatedCheckpoint {
  int world_size = 0;  // of the run that saved it
  StateDict state_dict;
  bool has_optimizer = false;
  FullOptimState optimizer;
};
// Reads every file whole (checking the manifest's per-file checksums as well) and assembles the
// full tensors. kDataLoss / kInvalidArgument naming the file and tensor.
absl::StatusOr<ConsolidatedCheckpoint> consolidate_sharded_checkpoint(const std::string& dir);

}  // namespace fairscale::fsdp
