// OffloadedAdam (//offload): Adam / AdamW whose state lives on the offload tier instead of in
// memory, DeepSpeed's ZeRO-Offload / ZeRO-Infinity "offload_optimizer" for LibTorch. The state
// (exp_avg, exp_avg_sq, step) and, for parameters that are not f32 (e.g. bf16), an f32 master copy
// of each parameter live in one file on the disk tier (disk_tier.h). step() streams them through
// memory one chunk at a time: while chunk k is updated, an I/O thread reads chunk k + 1 and writes
// chunk k - 1 back, so compute memory holds three chunks of state, not the whole state.
//
//   offload::OffloadedAdam adam(
//       {torch::optim::OptimizerParamGroup(model->parameters())},
//       torch::optim::AdamOptions(1e-3),            // AdamWOptions: decoupled weight decay
//       offload::OffloadOptions("/scratch/run1").name("rank0"));   // -> /scratch/run1/rank0.fso
//   loss.backward(); adam.step(); adam.zero_grad();
//
// Semantics equal torch::optim::Adam / AdamW (same update expressions, applied per chunk), and:
//   - group options are read at every step, so LR schedulers that set group lr work;
//   - a parameter without a gradient is skipped (its step count does not advance);
//   - for non-f32 parameters the update runs on the f32 master (initialised from the parameter
//     at construction) and the parameter receives the master rounded to its dtype. Changing such
//     a parameter by hand afterwards is overwritten at its next step (load a checkpoint instead);
//   - parameters must be contiguous CPU tensors whose shapes do not change (INVALID_ARGUMENT).
// amsgrad is not supported (INVALID_ARGUMENT at construction).
//
// Errors raise c10::Error (//base:torch_error) whose message is "<what>: <CODE>: <message>",
// e.g. "OffloadedAdam::load: DATA_LOSS: /ckpt/adam.fso: truncated ...": the constructor
// ("OffloadedAdam"), step(), step_group(), save() and load() alike; the code names are those of
// disk_tier.h. A failed step leaves the parameters partially updated and the tier file
// uncommitted ("writing"); the optimizer cannot be trusted after that and should be rebuilt from
// a checkpoint.
//
// Checkpoints, two ways (both spelled save / load, like torch::optim's):
//   - save(path) / load(path): the tier format (disk_tier.h), written to "<path>.tmp", fsynced
//     and renamed; streamed chunk by chunk, so they fit the same memory budget as step(). load
//     verifies every checksum and the tensor layout (DATA_LOSS / INVALID_ARGUMENT naming the
//     file and tensor) and restores the group hyper-parameters. Not torch::save's format: a file
//     of one kind given to the other's load is an error, never a silent misread.
//   - save(archive) / load(archive) (so torch::save(adam, path) / torch::load(adam, path)):
//     exactly torch::optim::Adam's (or AdamW's) archive layout, so a job can switch between the
//     in-memory and the offloaded optimizer across a resume. These materialise the whole state in
//     memory for the duration of the call.
//
// Thread-compatible. Owns one I/O thread.
#pragma once

#include <torch/arg.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace fairscale::offload {

class Tier;
namespace internal {
class IoWorker;
}

struct OffloadOptions {
  OffloadOptions(std::string dir = "") : dir_(std::move(dir)) {}  // NOLINT: implicit like torch
  // Directory of the disk tier (created if missing). The state file is "<dir>/<name>.fso"; it
  // is scratch (rewritten at construction, locked while in use): give every rank its own name.
  TORCH_ARG(std::string, dir);
  TORCH_ARG(std::string, name) = "optimizer";
  // Bytes of f32 state per chunk, the unit streamed through memory (rounded down to elements;
  // at least 1 element). Three chunks of each state tensor are in memory during step().
  TORCH_ARG(int64_t, chunk_bytes) = 4 << 20;
  // Read chunk k + 1 and write chunk k - 1 on the I/O thread while chunk k is updated.
  TORCH_ARG(bool, prefetch) = true;
  // fdatasync the state file at every step (not needed for a scratch tier: checkpoints are made
  // with save(path), which always syncs).
  TORCH_ARG(bool, sync) = false;
};

class OffloadedAdam : public torch::optim::Optimizer {
 public:
  // Adam (coupled weight decay). Group options must be torch::optim::AdamOptions. Creates the
  // state file; raises c10::Error ("OffloadedAdam: ...") on a bad parameter, option or file.
  OffloadedAdam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                torch::optim::AdamOptions defaults, OffloadOptions options);
  // AdamW (decoupled weight decay). Group options must be torch::optim::AdamWOptions.
  OffloadedAdam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                torch::optim::AdamWOptions defaults, OffloadOptions options);

  ~OffloadedAdam() override;

  // torch::optim::Optimizer: one Adam step over every group; raises c10::Error on failure.
  torch::Tensor step(LossClosure closure = nullptr) override;
  // Steps only the parameters of group `group` (OffloadModel steps one slice at a time).
  void step_group(size_t group);

  // The tier format (see above); raise c10::Error.
  void save(const std::string& path) const;
  void load(const std::string& path);
  // torch::optim::Adam's (AdamW's) archive layout; raise c10::Error.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  bool decoupled_weight_decay() const { return decoupled_; }
  const OffloadOptions& offload_options() const { return options_; }
  // The state file ("<dir>/<name>.fso").
  const std::string& path() const;
  // The step count of parameter `index` (groups in order, parameters in order), 0 before its
  // first step.
  int64_t step_count(size_t index) const { return steps_.at(index); }

 private:
  struct Param {  // where a parameter's state lives on the tier
    at::Tensor tensor;
    size_t group = 0;
    size_t exp_avg = 0, exp_avg_sq = 0;  // tier tensor indices
    int64_t master = -1;                 // tier index of the f32 master; -1: the parameter is f32
  };
  OffloadedAdam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                std::unique_ptr<torch::optim::OptimizerOptions> defaults, bool decoupled,
                OffloadOptions options);
  // Everything the constructors do after the base class: validates, creates the tier file.
  absl::Status Init();
  absl::Status StepGroups(const std::vector<size_t>& groups);
  absl::Status CheckParam(size_t index) const;
  absl::Status WriteStepsAndHyper(Tier& tier) const;
  absl::Status SaveTier(const std::string& path) const;
  absl::Status LoadTier(const std::string& path);

  bool decoupled_;
  OffloadOptions options_;
  std::vector<Param> params_;    // flattened over groups
  std::vector<size_t> group_begin_;  // index of each group's first parameter in params_
  std::vector<int64_t> steps_;   // per parameter
  std::unique_ptr<Tier> tier_;
  std::unique_ptr<internal::IoWorker> io_;
};

}  // namespace fairscale::offload
