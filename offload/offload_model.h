// OffloadModel (//offload): FairScale's experimental OffloadModel (L2L / ZeRO-Offload style) for
// LibTorch, with the disk tier as the offload device. A torch::nn::Sequential is cut into slices
// (by `balance`, or `num_slices` equal ones); every slice's parameters and gradients live in one
// file on the tier (disk_tier.h) and only the slice being computed is in memory (plus the next
// one, read ahead on an I/O thread). Adam state lives on the tier too (OffloadedAdam, one param
// group per slice), so parameters + gradients + optimizer state can exceed memory:
//
//   offload::OffloadModel model(seq, offload::OffloadModelOptions("/scratch/run1")
//                                        .num_slices(4).num_microbatches(2)
//                                        .checkpoint_activation(true),
//                               torch::optim::AdamOptions(1e-3));
//   for (...) {
//     model->zero_grad();
//     torch::Tensor loss = loss_fn(model(x), y);
//     loss.backward();     // slice by slice in reverse; gradients accumulate on the tier
//     model->step();       // per slice: parameters + gradients + Adam state streamed through
//   }
//
// forward(x) splits x into num_microbatches along dim 0 and runs slice by slice (each slice over
// all micro-batches while it is in memory); the output is the micro-batch outputs concatenated.
// Its backward (one autograd node) walks the slices in reverse, bringing each back, running the
// backward of its micro-batches and adding the parameter gradients to the tier. With
// checkpoint_activation every slice runs under //checkpoint's reentrant checkpoint(): only the
// slice-boundary activations are kept, the backward recomputes the slice (same RNG, so dropout
// matches). Without it each slice keeps its autograd graph (its activations) until backward, and
// the parameter memory the graph refers to is released and restored in place (storage level),
// so parameters still leave memory between forward and backward.
//
// Contracts: the modules map one tensor to one tensor; parameters are contiguous CPU tensors not
// shared between slices (tied weights are rejected); buffers (e.g. running statistics) stay in
// memory. Outside forward/backward/step() a slice's parameters are empty (0 elements) unless it
// is resident: read values with parameters_snapshot(), train with step() (not a torch optimizer
// over parameters()). The wrapped Sequential must not be used on its own afterwards.
// Errors (bad options, tier failures) raise c10::Error, "OffloadModel::<step>: <CODE>: <message>"
// for tier errors (naming the file, tensor and chunk; //base:torch_error), OffloadedAdam's own
// for the optimizer's (offloaded_optimizer.h).
#pragma once

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "offload/offloaded_optimizer.h"

namespace fairscale::offload {

class DiskTier;

struct OffloadModelOptions {
  OffloadModelOptions(std::string dir = "") : dir_(std::move(dir)) {}  // NOLINT
  // Directory of the disk tier. Files: "<dir>/<name>.fso" (parameters and gradients) and
  // "<dir>/<name>_optimizer.fso" (Adam state). Scratch, locked while in use.
  TORCH_ARG(std::string, dir);
  TORCH_ARG(std::string, name) = "model";
  TORCH_ARG(int64_t, num_slices) = 3;
  // Modules per slice (sums to the Sequential's size); overrides num_slices when not empty.
  TORCH_ARG(std::vector<int64_t>, balance) = {};
  TORCH_ARG(int64_t, num_microbatches) = 1;
  TORCH_ARG(bool, checkpoint_activation) = false;
  // Read the next slice (forward, step: i + 1; backward: i - 1) while the current one computes.
  TORCH_ARG(bool, prefetch) = true;
  // Chunk of the tier files (f32 bytes); also OffloadedAdam's chunk.
  TORCH_ARG(int64_t, chunk_bytes) = 4 << 20;
};

class OffloadModelImpl : public torch::nn::Module {
 public:
  // Adam (AdamOptions) or AdamW (AdamWOptions) on the tier. Moves the parameters to the tier
  // (raises c10::Error on bad options or tier errors).
  OffloadModelImpl(torch::nn::Sequential model, OffloadModelOptions options,
                   torch::optim::AdamOptions adam = {});
  OffloadModelImpl(torch::nn::Sequential model, OffloadModelOptions options,
                   torch::optim::AdamWOptions adamw);
  ~OffloadModelImpl() override;

  at::Tensor forward(const at::Tensor& x);
  // Clears the gradients on the tier (no I/O).
  void zero_grad(bool set_to_none = true) override;
  // One Adam step, slice by slice.
  void step();

  // Checkpoints in the wrapped Sequential's own archive layout: torch::save(offload_model, f)
  // writes what torch::save(sequential, f) would, and either loads the other's file. Both bring
  // the whole model into memory for the call. load() clears the gradients; after loading a model
  // with bf16 / f16 parameters, load the optimizer too (its f32 masters come from there).
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // Copies of the parameters (named like named_parameters()), read from the tier.
  std::vector<std::pair<std::string, at::Tensor>> parameters_snapshot();
  // Slice i covers modules [slice_begin(i), slice_begin(i + 1)).
  int64_t num_slices() const { return static_cast<int64_t>(slices_.size()); }
  int64_t slice_begin(int64_t i) const;
  // The optimizer (its param groups are the slices: set lr on every group).
  OffloadedAdam& optimizer() { return *adam_; }
  const OffloadModelOptions& options() const { return options_; }

  // Used by the autograd node; not part of the API.
  struct Pass;
  at::Tensor ForwardPass(Pass& pass, const at::Tensor& x);
  at::Tensor BackwardPass(Pass& pass, const at::Tensor& grad);

 private:
  struct Param;  // a parameter, its storage and its place on the tier
  struct Slice {
    int64_t begin = 0, end = 0;             // modules
    std::vector<size_t> params;             // indices into params_
    bool resident = false;
    std::future<absl::Status> prefetch;     // fills prefetched
    std::vector<c10::DataPtr> prefetched;
  };
  template <typename AdamOpts>
  void Init(torch::nn::Sequential model, AdamOpts adam);
  // Makes slice s resident (evicting the others), then reads ahead s + direction.
  absl::Status Ensure(int64_t s, int direction, bool evict_others = true);
  void Evict(int64_t s);
  absl::Status FlushGrads(int64_t s);
  at::Tensor RunSlice(int64_t s, const at::Tensor& x);

  OffloadModelOptions options_;
  torch::nn::Sequential seq_{nullptr};
  std::vector<Slice> slices_;
  std::vector<Param> params_;
  std::unique_ptr<DiskTier> tier_;
  std::unique_ptr<OffloadedAdam> adam_;
  std::unique_ptr<internal::IoWorker> io_;
};
TORCH_MODULE(OffloadModel);

}  // namespace fairscale::offload
