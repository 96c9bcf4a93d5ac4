#include "fsdp/internal/hybrid_groups.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"

namespace fairscale::fsdp::internal {
namespace {

constexpr size_t kHostBytes = 256;

absl::StatusOr<HybridGroups> SplitByColor(const std::shared_ptr<comm::Communicator>& world,
                                          int shard_color, int replicate_color) {
  const int rank = world->rank();
  absl::StatusOr<std::shared_ptr<comm::Communicator>> shard = world->Split(shard_color, rank);
  if (!shard.ok()) return shard.status();
  absl::StatusOr<std::shared_ptr<comm::Communicator>> replicate =
      world->Split(replicate_color, rank);
  if (!replicate.ok()) return replicate.status();
  return HybridGroups{*std::move(shard), *std::move(replicate)};
}

}  // namespace

absl::StatusOr<HybridGroups> SplitBySize(const std::shared_ptr<comm::Communicator>& world,
                                         int group_size) {
  const int n = world->size();
  if (group_size <= 0 || n % group_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("hybrid_shard_group_size ", group_size, " does not divide the world size ",
                     n, " (it must be a positive divisor)"));
  }
  const int rank = world->rank();
  return SplitByColor(world, rank / group_size, rank % group_size);
}

std::string ThisHost() {
  char name[kHostBytes] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "?";
  return name;
}

absl::StatusOr<HybridGroups> SplitByHost(const std::shared_ptr<comm::Communicator>& world,
                                         const std::string& host) {
  const int n = world->size();
  std::vector<uint8_t> mine(kHostBytes, 0);
  std::memcpy(mine.data(), host.data(), std::min(host.size(), kHostBytes - 1));
  std::vector<uint8_t> all(kHostBytes * n, 0);
  absl::Status s = world
                       ->AllGather(comm::MakeConstBuffer(mine.data(), mine.size()),
                                   comm::MakeBuffer(all.data(), all.size()))
                       .Wait();
  if (!s.ok()) return s;
  std::vector<std::string> hosts;
  for (int r = 0; r < n; ++r) hosts.emplace_back(reinterpret_cast<const char*>(all.data()) + r * kHostBytes);
  // Hosts numbered by first appearance; a rank's place on its host is its replicate color.
  std::map<std::string, int> index;
  std::map<std::string, int> count;
  std::vector<std::string> order;
  int place = 0;
  for (int r = 0; r < n; ++r) {
    if (index.emplace(hosts[r], static_cast<int>(order.size())).second) order.push_back(hosts[r]);
    if (r == world->rank()) place = count[hosts[r]];
    ++count[hosts[r]];
  }
  for (const std::string& h : order) {
    if (count[h] != count[order.front()]) {
      std::vector<std::string> counts;
      for (const std::string& o : order) counts.push_back(absl::StrCat(o, ": ", count[o]));
      return absl::InvalidArgumentError(absl::StrCat(
          "HYBRID_SHARD by host needs the same number of ranks on every host, the ",
          order.size(), " hosts of this world of ", n, " have [", absl::StrJoin(counts, ", "),
          "]; set FsdpOptions::hybrid_shard_group_size"));
    }
  }
  return SplitByColor(world, index[host.substr(0, kHostBytes - 1)], place);
}

namespace {

// The index behind SharedHybridGroups: which live pair of groups was split from which world
// communicator for which choice. It owns nothing. Each pair is owned by the holders of the
// HybridGroups handed out (the units of the user's models: aliasing shared_ptrs into one
// owner), and the owner's deleter takes its entry out, so the index lists exactly the pairs
// some unit still uses and a world communicator's pairs go with the last unit built over it.
// It is process-wide only because a unit has nothing else to find its siblings' groups by:
// nested units are built, each on its own, before the root that will contain them.
class HybridGroupsIndex {
 public:
  static HybridGroupsIndex& Get() {
    static HybridGroupsIndex* index = new HybridGroupsIndex();  // leaked: units may outlive main
    return *index;
  }

  // The live pair for (world, group_size), or null.
  std::shared_ptr<const HybridGroups> Find(const std::shared_ptr<comm::Communicator>& world,
                                           int group_size) {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find({world.get(), group_size});
    // The same address may be a new communicator after the old one died: compare owners.
    if (it == entries_.end() || it->second.world.lock() != world) return nullptr;
    return it->second.groups.lock();
  }

  // Makes `made` the pair for (world, group_size), owned by the returned pointer.
  std::shared_ptr<const HybridGroups> Insert(const std::shared_ptr<comm::Communicator>& world,
                                             int group_size, HybridGroups made) {
    const Key key{world.get(), group_size};
    std::shared_ptr<const HybridGroups> owner(
        new HybridGroups(std::move(made)), [this, key](const HybridGroups* groups) {
          Erase(key, groups);
          delete groups;  // replicate, then shard: each closes its connections in order
        });
    absl::MutexLock lock(&mu_);
    entries_[key] = Entry{world, owner, owner.get()};
    return owner;
  }

  size_t size() const {
    absl::MutexLock lock(&mu_);
    return entries_.size();
  }

 private:
  using Key = std::pair<const comm::Communicator*, int>;
  struct Entry {
    std::weak_ptr<comm::Communicator> world;
    std::weak_ptr<const HybridGroups> groups;
    const HybridGroups* raw = nullptr;  // identifies the owner once `groups` has expired
  };

  // Called by the owner's deleter; a newer pair made under the same key after this one expired
  // (and before this deleter ran) stays.
  void Erase(const Key& key, const HybridGroups* groups) {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it != entries_.end() && it->second.raw == groups) entries_.erase(it);
  }

  mutable absl::Mutex mu_;
  std::map<Key, Entry> entries_ ABSL_GUARDED_BY(mu_);
};

// A HybridGroups whose two pointers share the ownership of `owner`.
HybridGroups Share(const std::shared_ptr<const HybridGroups>& owner) {
  return HybridGroups{std::shared_ptr<comm::Communicator>(owner, owner->shard.get()),
                      std::shared_ptr<comm::Communicator>(owner, owner->replicate.get())};
}

}  // namespace

absl::StatusOr<HybridGroups> SharedHybridGroups(const std::shared_ptr<comm::Communicator>& world,
                                                int group_size) {
  HybridGroupsIndex& index = HybridGroupsIndex::Get();
  if (std::shared_ptr<const HybridGroups> owner = index.Find(world, group_size)) {
    return Share(owner);
  }
  // Split without holding the index: it blocks until the other ranks (other threads in tests)
  // arrive. Two threads of one rank building units over one world at once would both split;
  // a rank builds its units in order (the ranks must agree on the splits anyway).
  absl::StatusOr<HybridGroups> made =
      group_size > 0 ? SplitBySize(world, group_size) : SplitByHost(world, ThisHost());
  if (!made.ok()) return made.status();
  return Share(index.Insert(world, group_size, *std::move(made)));
}

size_t LiveSharedHybridGroupsForTesting() { return HybridGroupsIndex::Get().size(); }

absl::Status CheckHybridGroups(const std::shared_ptr<comm::Communicator>& world,
                               const HybridGroups& groups) {
  if (groups.shard == nullptr || groups.replicate == nullptr) {
    return absl::InvalidArgumentError(
        "hybrid_shard_groups: both the shard and the replicate communicator must be set");
  }
  const int s = groups.shard->size();
  const int r = groups.replicate->size();
  if (s * r != world->size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hybrid_shard_groups: the shard group has ", s, " ranks and the replicate group ", r,
        "; their product must be the world size ", world->size()));
  }
  std::vector<int32_t> shard_ranks(r, 0);
  const int32_t mine = groups.shard->rank();
  absl::Status st = groups.replicate
                        ->AllGather(comm::MakeConstBuffer(&mine, 1),
                                    comm::MakeBuffer(shard_ranks.data(), shard_ranks.size()))
                        .Wait();
  if (!st.ok()) return st;
  for (int i = 0; i < r; ++i) {
    if (shard_ranks[i] != mine) {
      return absl::InvalidArgumentError(absl::StrCat(
          "hybrid_shard_groups: the replicate group's rank ", i, " holds shard ", shard_ranks[i],
          " but rank ", groups.replicate->rank(), " holds shard ", mine,
          "; a replicate group must join the ranks that hold the same shard"));
    }
  }
  return absl::OkStatus();
}

}  // namespace fairscale::fsdp::internal
