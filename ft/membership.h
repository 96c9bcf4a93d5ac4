// Membership: who is alive in a job of replica groups, and a per-step quorum of the live groups
// that every rank agrees on (//ft; issue 25 item 1, the torchft-like layer under in-process
// recovery). The training loop of every rank calls quorum() at each step boundary and, when the
// quorum changed, replaces its replicate communicator (replicate_communicator()). No LibTorch:
// store logic only.
//
//   Membership::Options options;  // group, shard, num_groups, group_size, timings
//   FS_ASSIGN_OR_RETURN(std::unique_ptr<Membership> m, Membership::Create(store, options));
//   for (int64_t step = start;; ++step) {
//     FS_ASSIGN_OR_RETURN(Quorum q, m->quorum(step, absl::Seconds(60)));
//     if (q.changed) FS_ASSIGN_OR_RETURN(comm, m->replicate_communicator(q, comm, "tcp", base));
//     if (q.joining) { /* receive state from group q.source_group; step = q.max_step */ }
//     ... forward, backward, AllReduce over comm (averages cover q.groups only) ...
//     FS_ASSIGN_OR_RETURN(bool commit, m->should_commit(q, all_reduce_status.ok(), timeout));
//     if (!commit) { --step; continue; }  // discarded everywhere: retried in the next round
//     optimizer.step();
//   }
//   m->Leave();  // clean exit: peers drop this group at once instead of after dead_after
//
// The job: num_groups replica groups of group_size ranks (HYBRID_SHARD: a group is one shard
// group; the replicate group of shard index s is rank s of every group in the quorum). Each rank
// knows its (group, shard).
//
// Contract:
// * Liveness. Each rank writes "hb/g<g>/s<s>" = "<nonce>:<count>" every `heartbeat_interval` on
//   a thread of its own (the nonce is new per Membership, so a restarted rank is a new
//   incarnation), and on the same thread reads every rank's key. A rank is dead in this rank's
//   view when its value did not change for `dead_after` of successful reads (a rank whose key
//   never appeared, still starting: `start_timeout`; a reader whose own reads stalled judges
//   nobody), when it reported a failure (ReportFailure) or left (Leave).
//   A group is dead when any of its ranks is. Before declaring a group dead, quorum() and
//   should_commit() re-read every heartbeat key (a fresh sample, not the heartbeat thread's
//   last one, which may predate a restarted group's first beat).
// * Quorum rounds. quorum() calls are numbered by rounds: a member of round r calls round r + 1
//   next; a new Membership (a group starting or coming back) reads the latest decided round and
//   announces itself for the one after. Every caller announces "arrive/<r>/g<g>/s<s>" = step and
//   polls. Round r is decided, by whichever caller first sees it decidable, with one CompareSet
//   on "round/<r>"; every caller of round r returns that one decision, so all ranks of all
//   groups in it get the same answer. Round r is decidable when every group of round r - 1 (for
//   round 0: every group of the job) has either fully arrived or is dead; its groups are the
//   groups that fully arrived. Joiners: the groups of round r that were not in round r - 1, and
//   those with a rank that was not a member of round r - 1 (a new incarnation: a group whose
//   processes were restarted faster than its peers judged it dead is still listed in round
//   r - 1, but lost its state). Sources: the other groups (healthy: every rank a member of
//   round r - 1); none left (every group of round r - 1 died): source -1. A group that arrives
//   after the decision is in a later round.
// * Epoch: 0 at round 0; +1 exactly when a round's group set differs from the previous round's,
//   when it has joiners, or when the previous round's step was discarded by should_commit() (a
//   collective failed: the communicators of that epoch are suspect even when every group is
//   still alive).
// * Bounds: a group that dies before or at a step boundary is dropped from that boundary's
//   round within dead_after + heartbeat_interval + poll_interval (measured in ft/README.md). A
//   group that comes back is admitted at the first round after all its ranks announced,
//   flagged as joining, with a source group (a member of the previous round, round-robin) to
//   copy the state from, and max_step to catch up to.
// * Errors, never hangs: fewer than min_groups fully arrived when the round is otherwise
//   decidable, and still so after below_min_wait: kUnavailable naming the dead groups and why.
//   A rank whose group was in round r - 1 but left out of round r (its peers judged it dead):
//   kAborted (the group must restart and come back as a joiner). quorum() past its timeout:
//   kDeadlineExceeded naming the groups waited for. The store not answering the heartbeat thread
//   for dead_after: kUnavailable naming the store. Every store call is bounded.
// * Threads: quorum() and replicate_communicator() from one thread (the training loop); the
//   others are thread-safe.
// * Store cost: per rank, one Set and num_groups * group_size Gets per heartbeat_interval; per
//   quorum(), a few keys per rank per round. The keys of a round are deleted 16 rounds later
//   (by shard 0 of the round's first group), so the store holds a bounded number whatever the
//   job's length; a rank coming back after a pruned round skips to the latest one.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/config.h"
#include "comm/store/store.h"

namespace fairscale::ft {

// One round's decision, as seen by one rank.
struct Quorum {
  int64_t round = 0;
  int64_t epoch = 0;
  // The step this rank passed to quorum().
  int64_t step = 0;
  // Sorted ids of the groups in this round: the step's effective batch is groups.size() times
  // the per-group batch.
  std::vector<int> groups;
  // This rank's place in its replicate group (rank `shard` of every group in `groups`).
  int replicate_rank = 0;
  int replicate_size = 0;
  // The epoch differs from the previous round's (the group set changed, or the previous step was
  // discarded); always true in round 0 and for a joiner. Replace the replicate communicator.
  bool changed = false;
  // Groups new in this round (not in the previous round), which need the state, and for each
  // the group to receive it from (-1: no group of the previous round is left).
  std::vector<int> joiners;
  std::vector<int> sources;
  // Whether this rank's group is a joiner, and its source.
  bool joining = false;
  int source_group = -1;
  // The largest step passed to quorum() by the ranks of this round.
  int64_t max_step = 0;
  // Groups of the previous round (or, in round 0, of the job) left out, with the reason
  // ("group 1: rank 1 missed heartbeats for 1.2s").
  std::vector<int> dropped;
  std::vector<std::string> dropped_reasons;
  // Whom this rank is (copied from the options, for replicate_communicator()).
  int group = 0;
  int shard = 0;
};

// A record of each round this rank took part in (for the job's log).
struct QuorumRecord {
  int64_t round = 0;
  int64_t epoch = 0;
  int64_t step = 0;
  std::vector<int> groups;
  std::vector<int> joiners;
  std::vector<int> dropped;
  // How long this rank's quorum() call took.
  absl::Duration wait;
};

class Membership {
 public:
  struct Options {
    int group = 0;
    int shard = 0;
    int num_groups = 1;
    int group_size = 1;
    absl::Duration heartbeat_interval = absl::Milliseconds(500);
    absl::Duration dead_after = absl::Seconds(5);
    // How long a rank that never sent a heartbeat (its process still starting, at the job's
    // start) counts as alive: round 0 waits this long for a slow group before going on without
    // it (which then joins later, taking the state of the others).
    absl::Duration start_timeout = absl::Seconds(60);
    // How often quorum() polls the store while waiting.
    absl::Duration poll_interval = absl::Milliseconds(20);
    int min_groups = 1;
    // How long a round that would have fewer than min_groups waits for groups to come back.
    absl::Duration below_min_wait = absl::Seconds(5);
    // Store namespace of this job's membership (several jobs may share a store).
    std::string name = "ft";
    // Called after each quorum() whose group set changed (on the calling thread).
    std::function<void(const Quorum&)> on_change;
  };

  // Validates the options, announces this incarnation and starts the heartbeat thread.
  static absl::StatusOr<std::unique_ptr<Membership>> Create(std::shared_ptr<comm::Store> store,
                                                            Options options);
  // Stops beating without marking anything: to the peers this looks like a dead process.
  ~Membership();
  Membership(const Membership&) = delete;
  Membership& operator=(const Membership&) = delete;

  // The quorum of this step boundary (see the contract above). Waits at most `timeout`.
  absl::StatusOr<Quorum> quorum(int64_t step, absl::Duration timeout);

  // The commit vote of a step (torchft's should_commit): every rank of q.groups calls it after
  // its step's collectives with whether they succeeded; returns true on every rank when all of
  // them voted true, false on every rank when one voted false or died before voting (judged as
  // in quorum(); one CompareSet on "commit/<round>" makes the verdict the same everywhere). A
  // rank applies its optimizer step only on true; on false every rank of the round discards the
  // step and retries it in the next round, so the groups' (and a group's shards') steps never
  // diverge. Errors as quorum()'s.
  absl::StatusOr<bool> should_commit(const Quorum& q, bool ok, absl::Duration timeout);

  // Releases `old` (may be null) and creates this rank's replicate communicator of `q`
  // (comm::ReplaceCommunicator under q.epoch; name "<base.name>replicate/s<shard>", rank
  // q.replicate_rank, size q.replicate_size). A quorum older than an epoch already started:
  // kFailedPrecondition (stale).
  absl::StatusOr<std::shared_ptr<comm::Communicator>> replicate_communicator(
      const Quorum& q, std::shared_ptr<comm::Communicator> old, absl::string_view backend,
      const comm::CommConfig& base) const;

  // Tells the peers this rank failed (its group is dropped at the next round without waiting for
  // dead_after) and stops beating. Best effort.
  void ReportFailure(const absl::Status& why);
  // A clean exit: the peers drop this group at the next round. Stops beating.
  void Leave();

  // The groups whose every rank is beating in this rank's heartbeat view (its last sample, at
  // most heartbeat_interval old; a rank silent for dead_after, failed or left is not), sorted.
  // For progress lines and for waiting until a restarted group is back; the quorum decides who
  // trains.
  std::vector<int> live_groups() const;

  // The rounds this rank took part in, oldest first.
  std::vector<QuorumRecord> history() const;
  const Options& options() const { return options_; }

 private:
  struct State;
  Membership(std::shared_ptr<comm::Store> store, Options options);
  std::shared_ptr<comm::Store> store_;
  Options options_;
  std::shared_ptr<State> state_;
};

}  // namespace fairscale::ft
