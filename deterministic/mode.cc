#include "deterministic/mode.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "base/torch_error.h"

namespace fairscale::deterministic {
std::string DescribeMode(bool on, int64_t micro_batches) {
  if (!on) return "the default (non-deterministic) mode";
  // An optimizer (oss::OSS) has no micro-batch count of its own.
  if (micro_batches <= 0) return "deterministic mode";
  return absl::StrCat("deterministic mode with ", micro_batches, " micro-batches per step");
}

void CheckSameMode(comm::Communicator& comm, bool deterministic, int64_t micro_batches,
                   const std::string& what) {
  const int world = comm.size();
  const std::string ctx = absl::StrCat(what, " rank ", comm.rank(), "/", world);
  if (world == 1) return;
  std::vector<int64_t> mine = {deterministic ? 1 : 0, deterministic ? micro_batches : 0};
  std::vector<int64_t> all(2 * static_cast<size_t>(world));
  base::ThrowIfError(
      comm.AllGather(comm::ConstBuffer{mine.data(), 2, comm::DataType::kI64},
                     comm::Buffer{all.data(), all.size(), comm::DataType::kI64})
          .Wait(),
      absl::StrCat(ctx, ": checking the ranks' deterministic mode"));
  for (int r = 0; r < world; ++r) {
    if (all[2 * r] != mine[0] || all[2 * r + 1] != mine[1]) {
      TORCH_CHECK(false, ctx, ": ranks disagree on deterministic mode: this rank runs ",
                  DescribeMode(mine[0] != 0, mine[1]), ", rank ", r, " runs ",
                  DescribeMode(all[2 * r] != 0, all[2 * r + 1]),
                  "; every rank must be built with the same options");
    }
  }
}

void CheckThreads(const std::string& what) {
  const int threads = at::get_num_threads();
  TORCH_CHECK(threads == 1, what, ": deterministic mode needs LibTorch's CPU kernels on one "
              "intra-op thread (their reductions split the work by thread count), but "
              "at::get_num_threads() is ", threads, ": call at::set_num_threads(1) first (the "
              "main job does with --deterministic)");
}

}  // namespace fairscale::deterministic
