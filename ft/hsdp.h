// ft::FaultTolerantHsdp: fault-tolerant HYBRID_SHARD the torchft way (//ft:hsdp; issue 25 item 1,
// the training half). Each replica group runs FSDP (FULL_SHARD, or any strategy without its own
// replicate group) over the group's own communicator; this layer does the cross-group gradient
// average over the replicate communicator of the current quorum (rank `shard` of every live
// group), which it replaces whenever the quorum's epoch changes, without touching FSDP. The
// survivors of a lost group keep training; a group that comes back gets the state of a live
// group by direct transfer (no checkpoint).
//
//   auto m = ft::Membership::Create(store, membership_options).value();
//   fsdp::FullyShardedDataParallel model(MyNet(), group_comm, fsdp::FsdpOptions());
//   torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
//   ft::FaultTolerantHsdp hsdp(model, opt, *m, ft::HsdpOptions().backend("tcp").comm_config(base));
//   while (hsdp.step() < num_steps) {
//     const ft::Quorum& q = hsdp.begin_step();   // a joiner's step() jumps to the source's here
//     opt.zero_grad();
//     auto loss = loss_fn(model(batch(hsdp.step(), q.group)));  // this group's batch
//     loss.backward();
//     hsdp.end_step();   // false: the step was discarded everywhere; the loop retries it
//   }
//
// Contract:
// * begin_step(): Membership::quorum(step()); when q.changed, the replicate communicator is
//   replaced (Membership::replicate_communicator). When q.joiners is not empty, the state moves
//   by Broadcasts per source group over the new replicate communicator, from the source's
//   replicate rank: every shard rank of a joining group receives, from the same shard rank of
//   its source group, (1) the step counter, (2) the model's parameters() (its FSDP flat shards,
//   what the optimizer steps) and buffers(), (3) one archive with the optimizer's state and
//   param groups (Optimizer::save/load), the default CPU generator's state (transfer_rng) and
//   every add_state() entry (the data position, a sampler's state, ...). Groups that are
//   neither source nor joiner take part in the broadcasts and discard what they get. After it
//   every live group holds the source's parameters, optimizer state, generator state and
//   added states bitwise.
// * A transfer that fails (a source or joiner rank died or was cut off during it): a joining
//   rank throws (its state is half-copied: the group must restart and join again); every
//   other rank records the error and its end_step() votes false without reducing, so the step
//   is discarded everywhere and retried at a new epoch without the dead group(s).
// * end_step(): after the user's backward, every parameter's gradient (an undefined one counts
//   as zeros) is summed over the replicate communicator and divided by q.groups.size(); FSDP
//   already averaged it over the group, so the result is HYBRID_SHARD's average over all live
//   ranks. Then Membership::should_commit(q, all reductions succeeded): on true the optimizer
//   steps and step() advances; on false (everywhere: a rank failed or died) the gradients are
//   zeroed, nothing changes and the next begin_step() retries the same step at a new epoch.
// * The effective batch of each step is q.groups.size() groups' batches: history() records it
//   per attempt (committed or not).
// * Errors: c10::Error "ft::FaultTolerantHsdp group G rank S/N step K: <what>: <status>"
//   (quorum timeouts, a rank left out of the quorum: its group must restart and come back as a
//   joiner, a joiner's failed transfer, no group left to copy the state from: every group of
//   the previous round died, the live state is lost and the job must restart from a
//   checkpoint, or they all finished and left before this group came back: NothingToRejoin). A failed gradient reduction, or a failed transfer on a rank that is not
//   joining, is not an error: the step is discarded. Methods in order begin_step, end_step, from the training loop's thread.
#pragma once

#include <c10/util/Exception.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/config.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "ft/membership.h"

namespace fairscale::ft {

// Thrown by begin_step() on a joining group when no group of the previous round is left to copy
// the state from and every one of them left cleanly (Membership::Leave: the run is over while
// this group was restarting): there is nothing to rejoin. A restarted group's process would exit
// 0 on it (the launcher then ends the job with the others' success). A c10::Error, so callers
// that do not care see the usual error.
class NothingToRejoin : public c10::Error {
 public:
  explicit NothingToRejoin(std::string message) : c10::Error(std::move(message), "") {}
};

struct HsdpOptions {
  // The backend of the replicate communicators ("" = the highest priority linked).
  TORCH_ARG(std::string, backend) = "";
  // Store, timeout, bind address and name prefix of the replicate communicators (rank and size
  // come from each quorum).
  TORCH_ARG(comm::CommConfig, comm_config);
  TORCH_ARG(absl::Duration, quorum_timeout) = absl::Seconds(60);
  TORCH_ARG(absl::Duration, commit_timeout) = absl::Seconds(60);
  // Bound of each gradient all-reduce and of each state broadcast.
  TORCH_ARG(absl::Duration, collective_timeout) = absl::Seconds(60);
  // A joiner also receives the default CPU generator's state (dropout masks, sampling), so it
  // draws what its source group draws next. Off: each rank keeps its own generator.
  TORCH_ARG(bool, transfer_rng) = true;
};

// One attempt of a step, as this rank saw it.
struct HsdpStepRecord {
  int64_t step = 0;
  int64_t epoch = 0;
  std::vector<int> groups;  // the effective batch: these groups' batches
  bool committed = false;
  bool received_state = false;  // this group joined here and got the state
  int source_group = -1;
  absl::Duration quorum_wait;     // begin_step's quorum() and communicator replacement
  absl::Duration transfer_time;   // the state broadcasts (zero when nobody joined)
  absl::Duration reduce_time;     // the gradient all-reduces
  std::string error;              // why the transfer or reduction failed (a discarded step)
};

class FaultTolerantHsdp {
 public:
  // `model` must shard over exactly this rank's group (world_size() == group_size, rank() ==
  // shard, no FSDP replicate group). `optimizer` steps model->parameters(); `membership` outlives
  // this object. No communication here.
  FaultTolerantHsdp(fsdp::FullyShardedDataParallel model, torch::optim::Optimizer& optimizer,
                    Membership& membership, HsdpOptions options = {});
  FaultTolerantHsdp(const FaultTolerantHsdp&) = delete;
  FaultTolerantHsdp& operator=(const FaultTolerantHsdp&) = delete;

  // State of the training loop beyond the model and optimizer (a data loader's position, a
  // scheduler's counters) that a joiner must receive: `save` runs on the source's ranks during a
  // transfer, `load` on the joiner's with those bytes. Every rank adds the same names in the
  // same order before its first begin_step() (a joiner whose names differ from its source's
  // fails the transfer naming them). Names must be unique and non-empty (c10::Error).
  void add_state(std::string name, std::function<std::string()> save,
                 std::function<void(const std::string&)> load);

  // The quorum of step(): replaces the replicate communicator and transfers state (see above).
  const Quorum& begin_step();
  // Averages the gradients over the quorum's groups, votes, steps the optimizer on commit.
  // Returns whether the step was committed.
  bool end_step();

  // The step the next begin_step() runs (the number of committed steps, or the source's after a
  // transfer).
  int64_t step() const { return step_; }
  const Quorum& quorum() const { return quorum_; }
  const std::shared_ptr<comm::Communicator>& replicate_communicator() const { return replicate_; }
  const std::vector<HsdpStepRecord>& history() const { return history_; }
  fsdp::FullyShardedDataParallel& model() { return model_; }
  const HsdpOptions& options() const { return options_; }

 private:
  struct AddedState {
    std::string name;
    std::function<std::string()> save;
    std::function<void(const std::string&)> load;
  };
  [[noreturn]] void Fail(const absl::Status& status, const std::string& what) const;
  // The broadcasts of begin_step(); an error on a rank that is not joining (see the contract).
  absl::Status Transfer();
  // The sender's archive bytes (optimizer, generator, added states) / the receiver's load.
  std::string SaveArchive();
  absl::Status LoadArchive(const std::string& bytes, int source);

  fsdp::FullyShardedDataParallel model_;
  torch::optim::Optimizer& optimizer_;
  Membership& membership_;
  HsdpOptions options_;
  std::shared_ptr<comm::Communicator> replicate_;
  Quorum quorum_;
  int64_t step_ = 0;
  bool in_step_ = false;
  absl::Status transfer_status_;  // this step's failed transfer (a non-joining rank)
  std::vector<AddedState> added_;
  std::vector<HsdpStepRecord> history_;
};

}  // namespace fairscale::ft
