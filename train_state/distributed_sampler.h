// DistributedSampler: the data order of a data-parallel job as part of its saved state. Each rank
// builds one with the same dataset size, seed and options; together they hand out one global
// order per epoch, cut into rank-disjoint local batches, and the sampler's position (epoch, samples
// of the epoch handed out) is saved with the checkpoint. A run resumed from it sees exactly the
// batches the uninterrupted run would have seen; one resumed at another world size (or local batch
// size) continues the same global order, so no sample of the epoch is seen twice or skipped.
// Users: a training loop's torch::data::make_data_loader (it is a LibTorch Sampler) and the
// checkpoint that stores state_dict().
//
//   train_state::DistributedSampler sampler(dataset.size().value(), rank, world_size,
//                                           train_state::DistributedSamplerOptions().seed(1234));
//   if (resuming) sampler.load_state_dict(saved["sampler"]);
//   auto loader = torch::data::make_data_loader(dataset, sampler,
//                                               torch::data::DataLoaderOptions().batch_size(32));
//   while (sampler.epoch() < num_epochs) {
//     for (auto& batch : *loader) { ...; saved["sampler"] = sampler.state_dict(); }
//   }
//
// THE ORDER. Epoch e's global order is a permutation of [0, dataset_size): Fisher-Yates driven by
// splitmix64 seeded from (seed, e), both written in distributed_sampler.cc, so the order is the
// same on every platform, compiler and LibTorch version (std::shuffle and the std distributions
// are implementation-defined); the identity when shuffle is off. epoch_order() returns it.
//
// THE BATCHES. next(b) on every rank takes the next B = b * world_size entries of the order (the
// global batch) and rank r gets entries [r*b, (r+1)*b) of it: contiguous slices. This differs from
// PyTorch's DistributedSampler, which gives rank r the strided indices order[r::world_size]: there
// the sequence a rank sees, and which samples make up the first k batches, depend on world_size,
// so a run resumed at another world size cannot continue the same order. Here the concatenation of
// the global batches is the order itself whatever the world size, and the position (how much of
// the order has been handed out) means the same at every world size. All ranks compute the same
// thing; no communication.
//
// THE END OF AN EPOCH, when fewer than B samples are left:
//   drop_last = true:  the rest of the order is not handed out this epoch (next() returns nullopt).
//   drop_last = false: the last global batch is padded with the first entries of the epoch's
//                      order (wrapping as often as needed when B > dataset_size), so every rank
//                      gets a full local batch, as PyTorch pads; those padded samples repeat.
// The epoch ends when the batch that reaches it is handed out (or, with drop_last, when the rest
// is found to be shorter than the B of that batch or of the next request): the sampler then moves
// to (epoch + 1, position 0) at once, so epoch() and state_dict() say where the next batch comes
// from, and next() returns nullopt until reset() starts that epoch.
//
// EPOCHS AND reset(). LibTorch's DataLoader calls reset() at every begin(). reset() here never
// rewinds: it only lets next() hand out batches again after an epoch's end. So a fresh sampler, a
// restored one, or one whose loop stopped early continues from its position at the next begin();
// a loader loop that ran to the end continues with the next epoch. set_epoch(e) moves to the start
// of epoch e, unless the sampler is already in epoch e (then it keeps its position: PyTorch's
// idiom of calling set_epoch(epoch) before every epoch keeps a restored position).
//
// A HANDLE. make_data_loader takes its sampler by value and does not give it back, so copies of a
// DistributedSampler share one position (as copies of a torch::nn::Linear share one module): keep
// your copy to read epoch(), state_dict() and to load_state_dict(). Its methods are thread-safe.
//
// PREFETCH. With DataLoaderOptions().workers(0) (the default) the loader asks the sampler for a
// batch exactly when the loop asks for one, so state_dict() taken in the loop body is exact. With
// workers > 0 the loader requests up to max_jobs (default 2 * workers) batches ahead, and the
// position is that far ahead of what the loop consumed: a run resumed from it skips those batches.
//
// Errors are c10::Errors "train_state::DistributedSampler...: <CODE>: <message>" naming the
// argument or state field (//base:torch_error).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/arg.h>
#include <torch/data/samplers/base.h>

namespace fairscale::train_state {

struct DistributedSamplerOptions {
  // Seeds the shuffle; every rank must use the same.
  TORCH_ARG(uint64_t, seed) = 0;
  // false: every epoch's order is 0, 1, ..., dataset_size - 1.
  TORCH_ARG(bool, shuffle) = true;
  // See "THE END OF AN EPOCH" above.
  TORCH_ARG(bool, drop_last) = false;
};

// Epoch `epoch`'s global order: a permutation of [0, dataset_size) (the identity if !shuffle).
// Pinned: a test asserts literal values, so a change of generator is caught.
std::vector<size_t> epoch_order(size_t dataset_size, uint64_t seed, uint64_t epoch, bool shuffle);

class DistributedSampler : public torch::data::samplers::Sampler<std::vector<size_t>> {
 public:
  // 0 <= rank < world_size, dataset_size >= 1; c10::Error naming the argument otherwise.
  DistributedSampler(size_t dataset_size, int rank, int world_size,
                     DistributedSamplerOptions options = {});

  // Lets next() hand out batches again after an epoch's end; never rewinds (see above). new_size,
  // if given, must be dataset_size: another size is another order (build a new sampler for it).
  void reset(torch::optional<size_t> new_size = torch::nullopt) override;

  // This rank's local batch of `batch_size` (>= 1) dataset indices, or nullopt at the end of the
  // epoch (until reset()). Every rank must call it with the same batch_size.
  torch::optional<std::vector<size_t>> next(size_t batch_size) override;

  // {"seed", "shuffle", "drop_last", "dataset_size", "epoch", "position"}; the same on every rank.
  nlohmann::json state_dict() const;
  // Checks every field's type and range, and that seed, shuffle, drop_last and dataset_size are
  // this sampler's (the order or the epoch's end would differ otherwise); c10::Error naming the
  // field (and both values) otherwise, leaving this sampler unchanged. The world size and the
  // batch size may differ from the saving run's. position == dataset_size (not written by
  // state_dict) is read as the start of the next epoch.
  void load_state_dict(const nlohmann::json& state);

  // LibTorch's Sampler serialization: state_dict() as a JSON string under the key
  // "fairscale_distributed_sampler" (load() checks it as load_state_dict() does).
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // The epoch the next batch comes from, and how many samples of its order were handed out.
  uint64_t epoch() const;
  size_t position() const;
  // Moves to position 0 of `epoch` unless the sampler is already in it (see above).
  void set_epoch(uint64_t epoch);

  size_t dataset_size() const;
  int rank() const;
  int world_size() const;
  const DistributedSamplerOptions& options() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace fairscale::train_state
