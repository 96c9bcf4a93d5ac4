// The offload tier (//offload:tier): where offloaded tensors live while they are not in compute
// memory. OffloadedAdam (optimizer state and f32 master weights) and OffloadModel (slice
// parameters and gradients) stream tensors through this interface one chunk at a time, so a new
// tier (CUDA pinned host memory, NVMe with O_DIRECT) slots in without touching them. DiskTier
// (disk_tier.h) is the implemented one: a checksummed file on local disk.
//
// A tier holds a fixed list of tensors (TensorSpec), each cut into chunks of chunk_elems()
// elements (the last one shorter). A chunk is the unit of transfer and of integrity checking.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace fairscale::offload {

struct TensorSpec {
  std::string name;
  c10::ScalarType dtype = c10::kFloat;
  std::vector<int64_t> shape;

  int64_t numel() const;
  int64_t nbytes() const { return numel() * static_cast<int64_t>(c10::elementSize(dtype)); }
  bool operator==(const TensorSpec& o) const {
    return name == o.name && dtype == o.dtype && shape == o.shape;
  }
};

// "name: Float[3, 4]", for error messages.
std::string DescribeSpec(const TensorSpec& spec);

class Tier {
 public:
  virtual ~Tier() = default;

  virtual const std::vector<TensorSpec>& specs() const = 0;
  virtual int64_t chunk_elems() const = 0;
  // What the tier is, for error messages (e.g. the file path).
  virtual const std::string& name() const = 0;

  int64_t num_chunks(size_t tensor) const;
  // Element range [begin, begin + count) of chunk `chunk` of tensor `tensor`.
  int64_t chunk_begin(int64_t chunk) const { return chunk * chunk_elems(); }
  int64_t chunk_count(size_t tensor, int64_t chunk) const;

  // Copies chunk `chunk` of tensor `tensor` to / from `count * element size` bytes at dst / src.
  // Reads verify the chunk (kDataLoss naming the tier, tensor and chunk). Threads: one thread
  // may read while one other thread writes and commits, on different chunks (OffloadModel reads
  // the next slice ahead while it writes the current one); any chunk order.
  virtual absl::Status ReadChunk(size_t tensor, int64_t chunk, void* dst) = 0;
  virtual absl::Status WriteChunk(size_t tensor, int64_t chunk, const void* src) = 0;
  // Makes the writes so far the tier's committed content (a file tier records its checksums and
  // a new generation). Call with no read or write in flight.
  virtual absl::Status Commit() = 0;
  // kFailedPrecondition when someone else has taken over the tier's storage since it was
  // created (another process rewrote the file). Cheap: called before every step.
  virtual absl::Status CheckOwnership() = 0;

  // Whole-tensor helpers over the chunk calls.
  absl::Status ReadTensor(size_t tensor, void* dst);
  absl::Status WriteTensor(size_t tensor, const void* src);
};

// Copies tensor `i` of `from` into tensor `i` of `to` (same dtype and size), chunk by chunk, so
// memory holds one chunk of each; the two tiers may use different chunk sizes.
absl::Status CopyTensor(Tier& from, Tier& to, size_t i);

}  // namespace fairscale::offload
