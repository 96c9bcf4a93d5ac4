#include "model_parallel/rng.h"

#include <ATen/Context.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>

#include <mutex>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/torch_error.h"

namespace fairscale::model_parallel {
namespace {

// Megatron-LM's offset between the data-parallel and tensor-parallel seeds.
constexpr uint64_t kParallelSeedOffset = 2718;

at::Generator Seeded(c10::Device device, uint64_t seed) {
  at::Generator gen = at::globalContext().defaultGenerator(device).clone();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(seed);
  return gen;
}

}  // namespace

ModelParallelRng::ModelParallelRng(uint64_t seed, const comm::Communicator& comm,
                                   c10::Device device)
    : replicated_(Seeded(device, seed)),
      parallel_(Seeded(device, seed + kParallelSeedOffset + static_cast<uint64_t>(comm.rank()))) {}

at::Tensor dropout(const at::Tensor& x, double p, bool train, at::Generator& gen) {
  if (!(p >= 0.0 && p <= 1.0)) {
    base::ThrowIfError(absl::InvalidArgumentError(absl::StrCat("p = ", p, " is not in [0, 1]")),
                       "model_parallel::dropout");
  }
  if (!train || p == 0.0) return x;
  if (p == 1.0) return x.mul(at::zeros_like(x));
  const at::Tensor keep = at::empty_like(x, at::MemoryFormat::Contiguous).bernoulli_(1.0 - p, gen);
  return x.mul(keep).mul(1.0 / (1.0 - p));
}

}  // namespace fairscale::model_parallel
