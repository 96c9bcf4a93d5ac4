// DiskTier (//offload:disk_tier): the offload tier as a file on local disk, read and written
// with pread/pwrite (not mmap: a file truncated underneath a mapping kills the process with
// SIGBUS; pread reports it as an error). Reads of a file that is in the page cache run at memory
// speed; OffloadedAdam and OffloadModel overlap them with compute on an I/O thread.
//
// File format (version 1, little-endian; offsets in bytes):
//   [0, 4096)      header: magic "FSOFFLD\0", version, session id, writer pid, generation,
//                  state (committed / writing), chunk_elems, tensor count, offsets and FNV-1a
//                  checksums of the layout and checksum-table sections, total file size, and the
//                  header's own FNV-1a.
//   layout         per tensor: name, dtype, shape, data offset.
//   table          one FNV-1a 64 per chunk of every tensor, in tensor order.
//   data           each tensor contiguous, 64-byte aligned.
// Protocol: the first write after a commit marks the header "writing"; Commit() writes the
// checksum table, then the header "committed" with generation + 1 (each followed by fdatasync
// when `sync`). A crash in between leaves a "writing" header, which Open() reports as an
// interrupted write; data written after the last commit also fails its chunk checksum.
// The file is locked (flock) while a DiskTier holds it: a second writer gets kFailedPrecondition.
//
// Errors (each names the file, and the tensor and chunk where there is one):
//   kNotFound            no such file;
//   kDataLoss            truncated file, wrong magic or version, header/layout/table/chunk
//                        checksum mismatch, interrupted (uncommitted) write, a header or layout
//                        whose fields are out of range (sections or tensors outside the file,
//                        unknown dtype, sizes that overflow);
//   kInvalidArgument     the file's tensors differ from the expected ones (name, dtype, shape);
//   kFailedPrecondition  the file is locked by another open tier, belongs to another session
//                        than the expected one (a stale file of another run), or was rewritten
//                        by another process while this one had it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "offload/tier.h"

namespace fairscale::offload {

class DiskTier final : public Tier {
 public:
  struct OpenOptions {
    // 0: any session. Otherwise the session the file must belong to (see session()).
    uint64_t expected_session = 0;
    // Verify every chunk's checksum at open (reads the whole file).
    bool verify_all = false;
  };

  // Creates (or replaces) the file at `path` holding zero-filled tensors; the header is committed
  // before this returns. `sync`: fdatasync at creation and at every Commit().
  static absl::StatusOr<std::unique_ptr<DiskTier>> Create(const std::string& path,
                                                          std::vector<TensorSpec> specs,
                                                          int64_t chunk_elems, bool sync);
  // Opens an existing committed file whose tensors must equal `expected` (in order).
  static absl::StatusOr<std::unique_ptr<DiskTier>> Open(const std::string& path,
                                                        const std::vector<TensorSpec>& expected,
                                                        OpenOptions options);
  ~DiskTier() override;

  const std::vector<TensorSpec>& specs() const override { return specs_; }
  int64_t chunk_elems() const override { return chunk_elems_; }
  const std::string& name() const override { return path_; }
  absl::Status ReadChunk(size_t tensor, int64_t chunk, void* dst) override;
  absl::Status WriteChunk(size_t tensor, int64_t chunk, const void* src) override;
  absl::Status Commit() override;
  absl::Status CheckOwnership() override;

  // Random id chosen at Create(), kept in the header for the file's life.
  uint64_t session() const { return session_; }
  uint64_t generation() const { return generation_; }
  // Closes the file (after a Commit(), it is complete; without one it stays "writing").
  absl::Status Close();

 private:
  DiskTier() = default;
  absl::Status WriteHeader(uint32_t state);
  int64_t ChunkOffset(size_t tensor, int64_t chunk) const;
  std::string Where(size_t tensor, int64_t chunk) const;

  std::string path_;
  int fd_ = -1;
  bool sync_ = false;
  std::vector<TensorSpec> specs_;
  int64_t chunk_elems_ = 0;
  uint64_t session_ = 0;
  uint64_t generation_ = 0;
  bool writing_ = false;  // a write since the last commit
  std::vector<int64_t> data_offset_;   // per tensor
  std::vector<int64_t> first_chunk_;   // per tensor: index of its first chunk in table_
  absl::Mutex mu_;  // table_: WriteChunk runs on the I/O thread while the caller reads
  std::vector<uint64_t> table_ ABSL_GUARDED_BY(mu_);  // per chunk checksum
  int64_t layout_offset_ = 0, layout_bytes_ = 0, table_offset_ = 0, file_bytes_ = 0;
  uint64_t layout_fnv_ = 0;
};

}  // namespace fairscale::offload
