// The files of a sharded FSDP checkpoint (//fsdp, internal; no LibTorch): one file per rank
// holding ranges of the flattened original tensors, and the JSON manifest that rank 0 writes
// last. sharded_checkpoint.cc maps models onto them; consolidate_checkpoint reads them offline.
//
// Rank file: "FSDPSHD1" | records (raw little-endian element bytes, back to back) | header JSON |
// u64 header length | u64 FNV-1a of the header | "FSDPSHD1". The header lists each record: its
// key ("p/<param>", "b/<buffer>", "o/<param>/<state>"), dtype, the whole tensor's shape, the
// [begin, end) elements of the flattened tensor it holds, where its bytes are and their FNV-1a. A reader opens the footer and
// header and then reads only the records it needs, checking each one's checksum.
//
// Every file is written through //base:atomic_file: to "<path>.tmp.<pid>", fsync'ed and renamed
// over `path` (then the directory is fsync'ed), so a crash never leaves a torn file under its
// final name.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/atomic_file.h"

namespace fairscale::fsdp::internal {

struct RecordMeta {
  std::string key;
  std::string dtype;            // c10 name: "Float", "Double", "BFloat16", ...
  std::vector<int64_t> shape;   // of the whole original tensor
  int64_t begin = 0;  // elements of the flattened tensor
  int64_t end = 0;
  int64_t offset = 0;  // bytes from the start of the file
  int64_t nbytes = 0;
  uint64_t fnv1a = 0;
};

struct ShardFileInfo {
  int rank = 0;
  int world_size = 0;
  std::vector<RecordMeta> records;
};

// Streams records into "<path>.tmp.<pid>"; Finish() writes the header and commits the file.
// Errors are base::AtomicFileWriter's: kDataLoss (kResourceExhausted for a full disk) naming the
// file and the OS error; a writer destroyed before Finish() leaves no file behind.
class ShardFileWriter {
 public:
  static absl::StatusOr<std::unique_ptr<ShardFileWriter>> Open(const std::string& path, int rank,
                                                               int world_size);
  ~ShardFileWriter();
  absl::Status Add(const std::string& key, const std::string& dtype,
                   const std::vector<int64_t>& shape, int64_t begin, int64_t end,
                   const void* data, int64_t nbytes);
  struct Summary {
    int64_t bytes = 0;
    uint64_t fnv1a = 0;         // of the whole file
    uint64_t header_fnv1a = 0;  // of the header JSON
  };
  absl::StatusOr<Summary> Finish();

 private:
  ShardFileWriter(base::AtomicFileWriter file, int rank, int world_size);
  absl::Status Write(const void* data, size_t n);
  base::AtomicFileWriter file_;
  ShardFileInfo info_;
  uint64_t fnv_;  // of the bytes written so far
};

// An open rank file whose leading magic, footer and header were read and checked against the
// manifest's `bytes` and `header_fnv1a`. Errors are kDataLoss naming the file.
class ShardFileReader {
 public:
  static absl::StatusOr<std::unique_ptr<ShardFileReader>> Open(const std::string& path,
                                                               int64_t bytes,
                                                               uint64_t header_fnv1a);
  ~ShardFileReader();
  const ShardFileInfo& info() const { return info_; }
  const std::string& path() const { return path_; }
  // The bytes of record `i`, checked against its checksum (kDataLoss naming file and key).
  absl::StatusOr<std::string> Read(size_t i);

 private:
  ShardFileReader(std::string path, std::FILE* file) : path_(std::move(path)), file_(file) {}
  std::string path_;
  std::FILE* file_;
  ShardFileInfo info_;
};

// The manifest ("manifest.json"), written by rank 0 after every rank file is committed.
struct Manifest {
  struct Tensor {
    std::string name;
    std::vector<int64_t> shape;
    std::string dtype;
    std::string alias_of;  // parameters: the primary name of a tied parameter, else ""
  };
  struct File {
    std::string name;  // relative to the checkpoint directory
    int64_t bytes = 0;
    uint64_t fnv1a = 0;
    uint64_t header_fnv1a = 0;
  };
  struct OptimParam {
    int64_t step = 0;
    std::vector<std::string> tensors;
  };
  struct OptimGroup {
    std::map<std::string, double> options;
    std::vector<std::string> params;
  };
  int world_size = 0;
  std::vector<std::string> units;
  std::vector<Tensor> params;   // unwrapped named_parameters() order
  std::vector<Tensor> buffers;  // unwrapped named_buffers() order
  bool has_optimizer = false;
  std::string optimizer_kind;
  std::vector<OptimGroup> param_groups;
  std::map<std::string, OptimParam> optimizer_state;
  std::vector<File> files;  // files[r]: rank r's
};

inline constexpr const char* kManifestName = "manifest.json";
std::string RankFileName(int rank);  // "rank00003.shard"

std::string ManifestToJson(const Manifest& manifest);
// kDataLoss naming `path` and the field when the JSON is malformed, incomplete or inconsistent:
// files[r] must be RankFileName(r) (nothing outside the directory), world_size >= 1 and the
// number of files, names unique, shapes non-negative with a numel that fits int64, dtypes ones a
// checkpoint holds (DtypeSize), alias_of an earlier untied parameter, optimizer state only of
// untied parameters.
absl::StatusOr<Manifest> ManifestFromJson(absl::string_view json, const std::string& path);

// Bytes per element of a dtype name a checkpoint may hold ("Float", "Double", "Half",
// "BFloat16"); 0 for any other name.
int64_t DtypeSize(absl::string_view dtype);

// A checkpoint directory's manifest and rank files, opened and cross-checked before anything is
// read (no LibTorch; sharded_checkpoint.cc copies the records into tensors). Beyond what
// ManifestFromJson and ShardFileReader::Open check: file r holds rank r of the manifest's world
// size; every record is of a tensor the manifest lists ("p/<param>", "b/<buffer>",
// "o/<param>/<state>"), with its shape (and, for parameters and buffers, its dtype) and
// (end - begin) * element size bytes; and the records of each tensor cover its elements exactly
// once (no gap, no overlap: a duplicated range would otherwise pass for a missing one).
// verify_whole_files: also check every file's size and whole-file FNV-1a. check_manifest, when
// set, runs on the parsed manifest before any rank file is opened (a loader checks its model
// against it there: a wrong model is reported as such, not as the files it does not fit).
// Errors are kDataLoss naming the file (and record) at fault, or check_manifest's.
struct CheckpointFiles {
  Manifest manifest;
  std::string manifest_path;
  std::vector<std::unique_ptr<ShardFileReader>> files;  // files[r]: rank r's
  // Per tensor key: (file, record index) of its records, in element order.
  std::map<std::string, std::vector<std::pair<size_t, size_t>>> index;
};
absl::StatusOr<CheckpointFiles> OpenCheckpointFiles(
    const std::string& dir, bool verify_whole_files,
    const std::function<absl::Status(const Manifest&)>& check_manifest = nullptr);

}  // namespace fairscale::fsdp::internal
