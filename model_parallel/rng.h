// Random numbers for tensor-parallel models (//model_parallel): Megatron-LM's
// model_parallel_cuda_manual_seed / CudaRNGStatesTracker (FairScale's get_cuda_rng_tracker) as two
// explicit generators instead of a swapped global RNG state. Dropout applied to a replicated
// activation (the output of a RowParallelLinear, an embedding) must drop the same elements on
// every rank of the tensor-parallel group, or the replicas diverge; dropout applied to a
// parallel activation (a ColumnParallelLinear shard, attention heads) must drop different ones,
// or the shards of one full tensor share a mask pattern.
//
// * replicated(): seeded with `seed`, the same generator state on every tensor-parallel rank
//   (Megatron's default / data-parallel seed: give data-parallel replicas different seeds).
// * parallel(): seeded with seed + 2718 + comm.rank() (Megatron's tensor-model-parallel seed).
// * Generators are of `device`'s type (a clone of that device's default generator, re-seeded),
//   so masks are drawn on the tensors' device; torch's global generators are never touched, which
//   also makes it safe with ranks as threads of one process. Ranks must draw in the same order
//   for replicated() to stay identical.
// * Missing: FairScale's fork("name") for arbitrary named states and the checkpoint-replay
//   interplay (activation checkpointing re-running dropout needs the generator state saved).
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>

#include "comm/communicator.h"

namespace fairscale::model_parallel {

class ModelParallelRng {
 public:
  ModelParallelRng(uint64_t seed, const comm::Communicator& comm,
                   c10::Device device = c10::Device(c10::kCPU));
  at::Generator& replicated() { return replicated_; }
  at::Generator& parallel() { return parallel_; }

 private:
  at::Generator replicated_;
  at::Generator parallel_;
};

// Inverted dropout drawing its mask from `gen`: x * bernoulli(1 - p) / (1 - p) in training, x
// itself otherwise (and for p == 0). p in [0, 1] (else c10::Error); differentiable in x.
at::Tensor dropout(const at::Tensor& x, double p, bool train, at::Generator& gen);

}  // namespace fairscale::model_parallel
