// The step directories of a CheckpointManager (//train_state:step_dir; no LibTorch): names, the
// COMPLETE marker, listing, retention. The manager (checkpoint_manager.h) is the only writer.
//
//   <root>/step_00000040/<item>/...      each item's files (rank files, a manifest, ...)
//   <root>/step_00000040/COMPLETE        written last, by rank 0, after every rank's files
//
// A step directory counts only once COMPLETE exists. COMPLETE is JSON (format version
// kMarkerFormat): {"format", "step", "world_size", "items": {"<name>": {"kind", "files":
// [{"name", "bytes", "fnv1a64"}]}}, "metadata": {...}} with every file's size and 64-bit FNV-1a
// (it catches truncated, partially overwritten or bit-flipped files: accidents, not attacks).
// Nothing in a marker is trusted: a field of the wrong type or range, an item or file name that
// is not a plain name inside its directory, a duplicate is kDataLoss
// "corrupt checkpoint marker <path>: <field>: <what>".
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/atomic_file.h"

namespace fairscale::train_state {

inline constexpr char kMarkerName[] = "COMPLETE";
inline constexpr char kMarkerFormat[] = "fairscale.train_state.v1";
inline constexpr int kMaxWorldSize = 1 << 20;

std::string StepDirName(int64_t step);                            // "step_00000040"
std::string StepDir(const std::string& root, int64_t step);        // <root>/step_00000040

// kInvalidArgument unless `name` is a plain directory entry name ([A-Za-z0-9_.-], not "." or
// "..", at most 128 characters): item names and the files items write.
absl::Status CheckPlainName(absl::string_view name, absl::string_view what);
// kInvalidArgument unless `path` is 1 to 4 plain names joined by '/' (a file inside an item's
// directory, e.g. "stage1/rank00000.shard": nothing absolute, no "." or "..").
absl::Status CheckRelativePath(absl::string_view path, absl::string_view what);

struct FileDigest {
  std::string name;  // relative to its item's directory (CheckRelativePath)
  uint64_t bytes = 0;
  uint64_t fnv1a64 = 0;
  bool operator==(const FileDigest& o) const {
    return name == o.name && bytes == o.bytes && fnv1a64 == o.fnv1a64;
  }
};
// Size and FNV-1a of dir/name: kNotFound if missing, kDataLoss naming the file if unreadable.
absl::StatusOr<FileDigest> DigestFile(const std::string& dir, const std::string& name);

struct Marker {
  int64_t step = 0;
  int world_size = 0;
  struct Item {
    std::string kind;
    std::vector<FileDigest> files;
  };
  std::map<std::string, Item> items;
  nlohmann::json metadata = nlohmann::json::object();
};

std::string MarkerToJson(const Marker& marker);
// kDataLoss "corrupt checkpoint marker <path>: <field>: <what>".
absl::StatusOr<Marker> MarkerFromJson(absl::string_view json, const std::string& path);
// Reads <step_dir>/COMPLETE and checks its step against the directory's.
absl::StatusOr<Marker> ReadMarker(const std::string& step_dir, int64_t step);
// Writes <step_dir>/COMPLETE atomically (tmp, fsync, rename, fsync of the directory).
absl::Status WriteMarker(const std::string& step_dir, const Marker& marker);
// Checks every file the marker lists against its size and checksum: kDataLoss naming the first
// that differs, kNotFound naming a missing one.
absl::Status VerifyFiles(const std::string& step_dir, const Marker& marker);

// The step directories under `root` (name "step_<digits>"), newest first, with whether COMPLETE
// exists. Empty if `root` does not exist.
struct StepEntry {
  int64_t step = 0;
  std::string dir;
  bool complete = false;
};
std::vector<StepEntry> ListSteps(const std::string& root);

// Retention: which step directories to delete. Keeps the newest `keep_last` (>= 1) complete
// ones, every complete one whose step is a multiple of `keep_every` (0: none), and never the
// newest complete one; deletes the other complete ones and every incomplete one older than the
// newest complete one (an interrupted save). Incomplete ones newer than it are kept (a save may
// be writing them).
std::vector<StepEntry> StepsToDelete(const std::vector<StepEntry>& steps, int keep_last,
                                     int64_t keep_every);
// rm -r of a step directory; kDataLoss naming what could not be removed.
absl::Status RemoveStepDir(const std::string& dir);

// The step directories' files are written and read through //base:atomic_file
// ("<path>.tmp.<pid>", fsync, rename, fsync of the directory; kDataLoss / kResourceExhausted for
// a full disk, naming the file; ReadFile: kNotFound when missing).
using ::fairscale::base::ReadFile;
using ::fairscale::base::WriteFileAtomic;

}  // namespace fairscale::train_state
