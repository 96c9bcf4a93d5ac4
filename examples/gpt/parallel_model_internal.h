// Shared by the trainer's parallel modes (parallel_model.cc: fsdp, sdp; pipe_model.cc: pipeline):
// flag parsing and hashing written once. Not part of the trainer's API.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>
#include <torch/optim/adam.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/fnv1a.h"
#include "comm/communicator.h"
#include "examples/gpt/model.h"
#include "examples/gpt/parallel_model.h"
#include "examples/gpt/trainer.h"
#include "fsdp/fsdp_options.h"
#include "oss/oss.h"
#include "pipe/pipe.h"

namespace fairscale::examples::gpt::internal {

// --strategy, --precision (nullopt: fp32), --oss_partition, --pipeline_schedule, and
// --checkpoint_activations in pipeline mode; kInvalidArgument naming the flag otherwise.
absl::StatusOr<fsdp::ShardingStrategy> ParseStrategy(const std::string& s);
absl::StatusOr<c10::optional<c10::ScalarType>> ParsePrecision(const std::string& p);
absl::StatusOr<oss::PartitionMode> ParsePartition(const std::string& p);
absl::StatusOr<pipe::Schedule> ParseSchedule(const std::string& s);
absl::StatusOr<pipe::CheckpointMode> ParsePipeCheckpoint(const std::string& s);

// Sum of `value` over `comm` (collective); throws naming `what` on failure.
double AllReduceSum(comm::Communicator& comm, double value, const char* what);

using base::Fnv1a64;
using base::kFnv1a64Basis;

// FNV-1a 64 of a tensor's bytes (and of its name first), continuing from `h`.
uint64_t HashTensor(const at::Tensor& t, uint64_t h);
uint64_t HashNamed(const std::string& name, const at::Tensor& t, uint64_t h);

// The pipeline mode (config.pipeline_stages > 1): pipe_model.cc.
absl::StatusOr<std::unique_ptr<ParallelModel>> MakePipeModel(
    const TrainConfig& config, const GptConfig& model_config,
    std::shared_ptr<comm::Communicator> comm, const torch::optim::AdamOptions& adam);

// The tensor-parallel mode (config.tensor_parallel > 1): tp_parallel_model.cc.
absl::StatusOr<std::unique_ptr<ParallelModel>> MakeTpModel(
    const TrainConfig& config, const GptConfig& model_config,
    std::shared_ptr<comm::Communicator> comm, const torch::optim::AdamOptions& adam);

}  // namespace fairscale::examples::gpt::internal
