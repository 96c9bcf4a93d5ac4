#include "fsdp/internal/hybrid_groups.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

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

absl::StatusOr<HybridGroups> SharedHybridGroups(const std::shared_ptr<comm::Communicator>& world,
                                                int group_size) {
  // The cache holds the groups weakly. The pointers handed out share the ownership of both
  // communicators (aliasing shared_ptrs into one owner), so the pair lives while any unit holds
  // either and is destroyed, replicate then shard, each closing its connections in order
  // (peers see an orderly shutdown, not a vanished rank), when the last unit goes: a leaked
  // strong reference here outlived the job's units and its sockets were closed only by exit.
  struct Entry {
    std::weak_ptr<comm::Communicator> world;
    std::weak_ptr<const HybridGroups> owner;
  };
  auto share = [](const std::shared_ptr<const HybridGroups>& owner) {
    return HybridGroups{std::shared_ptr<comm::Communicator>(owner, owner->shard.get()),
                        std::shared_ptr<comm::Communicator>(owner, owner->replicate.get())};
  };
  static std::mutex mu;
  static auto* cache = new std::map<std::pair<const comm::Communicator*, int>, Entry>();
  {
    std::lock_guard<std::mutex> lock(mu);
    for (auto it = cache->begin(); it != cache->end();) {
      it = it->second.world.expired() || it->second.owner.expired() ? cache->erase(it)
                                                                     : std::next(it);
    }
    auto it = cache->find({world.get(), group_size});
    if (it != cache->end() && it->second.world.lock() == world) {
      if (std::shared_ptr<const HybridGroups> owner = it->second.owner.lock()) return share(owner);
    }
  }
  // Split outside the lock: it blocks until the other ranks (other threads in tests) arrive.
  absl::StatusOr<HybridGroups> made =
      group_size > 0 ? SplitBySize(world, group_size) : SplitByHost(world, ThisHost());
  if (!made.ok()) return made.status();
  auto owner = std::make_shared<const HybridGroups>(*std::move(made));
  std::lock_guard<std::mutex> lock(mu);
  (*cache)[{world.get(), group_size}] = Entry{world, owner};
  return share(owner);
}

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
