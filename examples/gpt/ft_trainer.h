// One rank of the GPT job in fault-tolerant mode (TrainConfig::fault_tolerant, the flag
// --fault_tolerant; issue 25): the loop //examples:train_gpt runs instead of TrainRank when a
// rank's death must not stop the job.
//
//   absl::StatusOr<TrainResult> r = TrainFaultTolerantRank(config, context);
//
// The ranks form num_groups = world / S replica groups of S = hybrid_shard_group_size
// consecutive ranks: rank R is shard R % S of group R / S. There is no world communicator (a
// dead rank would break it, and a restarted group could not rejoin it): each group trains the
// job's Gpt (GptWrapPolicy units) with FSDP FULL_SHARD over its own communicator, and
// ft::FaultTolerantHsdp averages the gradients over the groups of each step's quorum
// (ft::Membership over the job's store), votes, and steps Adam. A group that loses a rank, or is
// left out of a quorum, fails (this function returns an error, after telling the peers through
// Membership::ReportFailure); the launcher restarts that group alone (--replica_group_size), and
// the new incarnation comes back as a joiner that receives the parameters, the Adam state and
// the step from a live group, directly (no checkpoint). The survivors keep stepping with fewer
// groups; the effective batch of a step is (live groups) x S x batch.
//
// The same data, schedule and clipping as TrainRank: rank R trains on the batch of (seed, step,
// R); the learning rate follows the committed step (FaultTolerantHsdp::step(), which a joiner
// takes over from its source); the gradient norm is clipped after the cross-group average, on
// the averaged gradient (the global norm, as in hybrid_shard), inside the optimizer step that
// FaultTolerantHsdp::end_step runs.
//
// Output: shard 0 of the lowest-numbered group of each step's quorum is the writer (rank 0 may be
// dead): the progress line ("groups 2/2"), and the metrics records, appended one whole line at a
// time (AppendMetricsRecord; the job's first writer starts the file afresh): "train" (with the
// writer's group's loss and "groups", the live count), "val", "membership" at every change of the
// group set ({"step", "epoch", "groups", "dropped", "joiners", "reasons", "quorum_wait_s",
// "transfer_s"}), "final" (with the membership history) and "sample". Shard 0 of a group that
// joined appends a "join" record (its catch-up time, split into process start, quorum wait and
// state transfer). Every rank prints one line to stderr when it starts (rank, group, shard,
// incarnation, pid) and, at the end, its full-parameter hash to stdout.
// Not supported (TrainConfig::Validate refuses them): checkpoints, resume, pipeline, tensor
// parallelism, experts, deterministic mode, loss scaling, optimizer offload, tracing.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "comm/config.h"
#include "comm/store/store.h"
#include "examples/gpt/trainer.h"

namespace fairscale::examples::gpt {

// What a fault-tolerant rank gets from its launcher (train_gpt.cc builds it from the
// environment with comm::CommConfigFromEnv).
struct FtRankContext {
  int rank = 0;        // RANK
  int world_size = 1;  // WORLD_SIZE
  // FS_RESTART_COUNT: how often the launcher restarted this rank's group (0: first incarnation).
  int incarnation = 0;
  // Rank RANK % S of the S ranks of group RANK / S, named FtGroupCommName(group, incarnation).
  std::shared_ptr<comm::Communicator> group;
  // The job's store, shared by every group and hosted by the launcher (it outlives every rank).
  std::shared_ptr<comm::Store> store;
  // Backend and config (store, timeout, bind address) of the replicate communicators.
  std::string backend;
  comm::CommConfig base;
};

// "ft/g<group>/i<incarnation>": a new incarnation of a group never meets the old one's keys.
std::string FtGroupCommName(int group, int incarnation);

// Runs the job on this rank until the committed step reaches config.steps (then
// Membership::Leave). Errors name the rank, group and step; the caller exits non-zero so that
// the launcher restarts the group. kCancelled: this (restarted) group came back after every
// other group had finished and left (ft::NothingToRejoin): the run is over, exit 0.
absl::StatusOr<TrainResult> TrainFaultTolerantRank(const TrainConfig& config,
                                                   const FtRankContext& context);

}  // namespace fairscale::examples::gpt
