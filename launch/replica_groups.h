// The replica groups of one node's launcher (LaunchOptions::replica_group_size = S > 0): the
// bookkeeping the launcher (launch/launcher.cc) keeps so that a failed rank costs only its own
// group a restart, not the job.
//
// Group g is the consecutive global ranks [g*S, (g+1)*S); S divides nproc_per_node, so a group
// lies within one node and each node's launcher restarts its own groups. Each group has its own
// restart count (FS_RESTART_COUNT of its ranks), at most max_restarts. While a group is being
// restarted its ranks have had SIGTERM (SIGKILL at kill_at) and are reaped one by one; once all
// are, the launcher starts them again. This class holds state only: it signals, spawns and
// waits for nothing.
//
// Thread-compatible.
#pragma once

#include <string>
#include <vector>

#include "absl/time/time.h"
#include "launch/launcher.h"

namespace fairscale::launch {

class ReplicaGroups {
 public:
  // Validated options (ValidateLaunchOptions).
  explicit ReplicaGroups(const LaunchOptions& o);

  // Whether ranks are restarted per group (replica_group_size > 0); when false, no other
  // method may be called.
  bool enabled() const { return size_ > 0; }

  // The group of a global rank.
  int GroupOf(int rank) const { return rank / size_; }
  // "rank 4" or "ranks 2-3": the global ranks of group g, for messages.
  std::string RanksOf(int group) const;
  // The local ranks of group g, which must be one of this node's groups.
  std::vector<int> LocalRanksOf(int group) const;

  // Restarts group g has had so far (its ranks' FS_RESTART_COUNT).
  int restarts(int group) const { return state(group).restarts; }
  bool HasRestartsLeft(int group) const { return restarts(group) < max_restarts_; }

  // Group g's ranks are being stopped for a restart (counted at once): SIGKILL is due at
  // kill_at for those still running.
  void BeginRestart(int group, absl::Time kill_at);
  bool restarting(int group) const { return state(group).restarting; }
  // Whether SIGKILL is due now for the group being restarted (true once: MarkKilled).
  bool KillDue(int group, absl::Time now) const;
  void MarkKilled(int group) { state(group).killed = true; }
  // Its ranks were started again.
  void EndRestart(int group);
  // The groups of this node being restarted.
  std::vector<int> Restarting() const;

 private:
  struct State {
    int restarts = 0;
    bool restarting = false;
    bool killed = false;
    absl::Time kill_at = absl::InfiniteFuture();
  };
  State& state(int group);
  const State& state(int group) const;

  const int size_;
  const int max_restarts_;
  // This node's first global rank, and its first group.
  const int first_rank_;
  const int first_group_;
  // One entry per group of this node.
  std::vector<State> states_;
};

}  // namespace fairscale::launch
