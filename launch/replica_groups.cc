#include "launch/replica_groups.h"

#include "absl/strings/str_cat.h"

namespace fairscale::launch {

ReplicaGroups::ReplicaGroups(const LaunchOptions& o)
    : size_(o.replica_group_size),
      max_restarts_(o.max_restarts),
      first_rank_(o.node_rank * o.nproc_per_node),
      first_group_(size_ > 0 ? first_rank_ / size_ : 0),
      states_(size_ > 0 ? o.nproc_per_node / size_ : 0) {}

std::string ReplicaGroups::RanksOf(int group) const {
  const int first = group * size_;
  return size_ == 1 ? absl::StrCat("rank ", first)
                    : absl::StrCat("ranks ", first, "-", first + size_ - 1);
}

std::vector<int> ReplicaGroups::LocalRanksOf(int group) const {
  state(group);  // checks that the group is this node's
  std::vector<int> local;
  for (int i = 0; i < size_; ++i) local.push_back(group * size_ + i - first_rank_);
  return local;
}

void ReplicaGroups::BeginRestart(int group, absl::Time kill_at) {
  State& s = state(group);
  ++s.restarts;
  s.restarting = true;
  s.killed = false;
  s.kill_at = kill_at;
}

bool ReplicaGroups::KillDue(int group, absl::Time now) const {
  const State& s = state(group);
  return s.restarting && !s.killed && now >= s.kill_at;
}

void ReplicaGroups::EndRestart(int group) {
  State& s = state(group);
  s.restarting = false;
  s.killed = false;
  s.kill_at = absl::InfiniteFuture();
}

std::vector<int> ReplicaGroups::Restarting() const {
  std::vector<int> groups;
  for (size_t i = 0; i < states_.size(); ++i) {
    if (states_[i].restarting) groups.push_back(first_group_ + static_cast<int>(i));
  }
  return groups;
}

ReplicaGroups::State& ReplicaGroups::state(int group) {
  return states_.at(static_cast<size_t>(group - first_group_));
}

const ReplicaGroups::State& ReplicaGroups::state(int group) const {
  return states_.at(static_cast<size_t>(group - first_group_));
}

}  // namespace fairscale::launch
