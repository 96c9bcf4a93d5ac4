// The checkpoint directory of the GPT job (//examples/gpt:checkpoint_dir): which checkpoints
// are complete, whether their files are intact, and which to delete. No LibTorch: the files
// themselves are written by the data-parallel mode (examples/gpt/parallel_model.h), each
// atomically. Two formats of step directory:
//
//   "fsdp_sharded" (fsdp mode; fsdp::save_sharded_checkpoint, loadable at any world size):
//          <root>/step_00000040/rank00000.shard ... rank{N-1}.shard + manifest.json
//          <root>/step_00000040/COMPLETE                     written last, by rank 0
//   "rank_files" (sdp mode, and fsdp checkpoints written before the sharded format: one
//          fsdp::save_local_checkpoint file per rank, loadable only at the same world size):
//          <root>/step_00000040/rank0.pt ... rank{N-1}.pt
//          <root>/step_00000040/COMPLETE
//
// A step directory counts only once COMPLETE exists: rank 0 writes it (tmp + fsync + rename)
// after a barrier that follows every rank's save, so a job killed mid-save leaves a directory
// without COMPLETE, which resume skips and the next prune deletes; the previous checkpoint is
// untouched. COMPLETE is JSON: {"step", "world_size", "format", "config", "trainer_state",
// "files": [{"name", "bytes", "fnv1a64"}]} ("format" absent = "rank_files"; "trainer_state" is
// the trainer's own state: loss scaler, full-parameter hash). The checksum is 64-bit FNV-1a over each rank file: it is there to catch
// truncation, a partially overwritten or bit-flipped file (accidents, not attacks), needs no
// library, and hashes a few MB in milliseconds; a cryptographic hash would buy nothing here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/fnv1a.h"

namespace fairscale::examples::gpt {

std::string StepDir(const std::string& root, int64_t step);        // <root>/step_%08d
std::string RankFile(const std::string& step_dir, int rank);        // <step_dir>/rank%d.pt
// "rank0.pt" ... "rank{world_size-1}.pt": the files of a one-file-per-rank checkpoint.
std::vector<std::string> RankFileNames(int world_size);
// "rank%05d.shard": the name fsdp::save_sharded_checkpoint gives rank `rank`'s file.
std::string ShardFileName(int rank);
inline constexpr char kShardManifestName[] = "manifest.json";  // fsdp's manifest
inline constexpr char kCompleteName[] = "COMPLETE";
inline constexpr char kFormatRankFiles[] = "rank_files";
inline constexpr char kFormatFsdpSharded[] = "fsdp_sharded";
// The largest world size a COMPLETE may state (a sanity bound on an untrusted field).
inline constexpr int kMaxWorldSize = 1 << 20;

// Writes `content` to "<path>.tmp.<pid>", fsyncs it and renames it over `path`.
absl::Status WriteFileAtomic(const std::string& path, const std::string& content);
absl::StatusOr<std::string> ReadFile(const std::string& path);

// 64-bit FNV-1a of `n` bytes, continuing from `h` (start: kFnv1a64Basis), so data can be hashed
// in pieces: //base:fnv1a, the repository's one implementation (the offload tier's chunk
// checksums use it too). The checksum COMPLETE records, and the parameter hashes of the job's
// metrics.
using base::Fnv1a64;
using base::kFnv1a64Basis;

struct FileDigest {
  std::string name;  // relative to the step directory
  uint64_t bytes = 0;
  uint64_t fnv1a64 = 0;
};
// kNotFound / kDataLoss naming the file.
absl::StatusOr<FileDigest> DigestFile(const std::string& dir, const std::string& name);

struct CompleteCheckpoint {
  std::string dir;  // the step directory
  int64_t step = 0;
  int world_size = 0;
  std::string format = kFormatRankFiles;
  nlohmann::json config;
  nlohmann::json trainer_state = nlohmann::json::object();
  std::vector<FileDigest> files;
};

// Digests rank0.pt .. rank{world_size-1}.pt in `step_dir` and writes COMPLETE atomically
// (format "rank_files").
absl::Status WriteComplete(const std::string& step_dir, int64_t step, int world_size,
                           const nlohmann::json& config);
// Digests `files` (names relative to `step_dir`) and writes COMPLETE atomically with `format`
// and `trainer_state`.
absl::Status WriteComplete(const std::string& step_dir, int64_t step, int world_size,
                           const std::string& format, const std::vector<std::string>& files,
                           const nlohmann::json& config, const nlohmann::json& trainer_state);

// The newest step directory under `root` that has COMPLETE (nullopt if none, or if `root` does
// not exist). Directories without COMPLETE are skipped. Nothing in COMPLETE is trusted: a marker
// that does not parse, a field of the wrong type or out of range (world_size in [1,
// kMaxWorldSize], step >= 0), a file name that is absolute, leaves the step directory ("..") or
// is listed twice, a file list that is not exactly the format's (rank_files, fsdp_sharded), or a
// config / trainer_state field the trainer reads with the wrong type is kDataLoss
// "corrupt checkpoint marker <dir>/COMPLETE: <field>: <what>", e.g. "files[1].name: ...".
absl::StatusOr<std::optional<CompleteCheckpoint>> FindLatestComplete(const std::string& root);

// Checks every rank file against COMPLETE: present, same size, same checksum. kDataLoss naming
// the first file that differs (kNotFound if missing).
absl::Status VerifyCheckpoint(const CompleteCheckpoint& checkpoint);

// kNotFound for --resume when `root` holds no complete checkpoint, saying how to start from
// step 0 or resume only when there is one.
absl::Status NoCompleteCheckpointError(const std::string& root);

// For a run that starts from step 0 (no --resume), which would delete every step directory under
// `root` (RemoveCheckpointsAfter(root, 0)): kFailedPrecondition when `root` holds a step directory
// with COMPLETE, naming the newest and saying how to continue from it (--resume), delete them
// (--overwrite_checkpoints) or keep them (another --out_dir). OK when there is none.
absl::Status RefuseToOverwriteCheckpoints(const std::string& root);

// `error` (about the newest complete checkpoint under `root`: damaged, unreadable) with what to do
// appended: which older complete checkpoint is intact (it verifies) and how to resume from it
// (move the damaged one aside), or that none is. Other errors come back unchanged.
absl::Status WithOlderCheckpointHint(const absl::Status& error, const std::string& root);

// Keeps the newest `keep` (>= 1) complete step directories; deletes older complete ones and
// every incomplete one older than the newest complete one (an interrupted save).
absl::Status PruneCheckpoints(const std::string& root, int keep);

// Deletes every step directory after `step`: a run that starts (or resumes) at `step` owns
// what comes later, and a stale COMPLETE from an older run must not vouch for new files.
absl::Status RemoveCheckpointsAfter(const std::string& root, int64_t step);

}  // namespace fairscale::examples::gpt
