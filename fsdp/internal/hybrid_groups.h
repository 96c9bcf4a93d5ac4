// The shard and replicate groups of HYBRID_SHARD (//fsdp, internal): made from the model's
// communicator with Communicator::Split by group size or by host, checked when the user passes
// them, and shared by every unit built over the same communicator with the same choice (owned
// by those units; see SharedHybridGroups).
// Used by FullyShardedDataParallelImpl's constructor; no LibTorch.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/communicator.h"

namespace fairscale::fsdp::internal {

struct HybridGroups {
  std::shared_ptr<comm::Communicator> shard;      // the ranks that shard a flat parameter
  std::shared_ptr<comm::Communicator> replicate;  // the ranks holding the same shard
};

// Groups of `group_size` consecutive ranks (must divide world->size(); kInvalidArgument naming
// both otherwise). Collective (two Splits).
absl::StatusOr<HybridGroups> SplitBySize(const std::shared_ptr<comm::Communicator>& world,
                                         int group_size);

// One group per distinct `host` (this rank's host name; the ranks exchange theirs). Every host
// must hold the same number of ranks (kInvalidArgument listing the hosts' counts otherwise).
// Collective.
absl::StatusOr<HybridGroups> SplitByHost(const std::shared_ptr<comm::Communicator>& world,
                                         const std::string& host);

// This machine's host name (gethostname).
std::string ThisHost();

// SplitBySize (group_size > 0) or SplitByHost(ThisHost()) (group_size == 0), made once per live
// `world` communicator and choice, and shared: every call for the same world object and group
// size returns the same two communicators while some caller still holds either of them (the
// units of a model, and of any other model built over that world meanwhile). The returned
// pointers own the pair together; when the last of them goes, both communicators are destroyed
// (replicate, then shard: an orderly close the peers see as such) and a later call splits anew.
// Nothing else keeps them: the process-wide index behind this holds weak references only and
// forgets a pair when it is destroyed, so a world communicator's groups end with the last unit
// built over it, never with the process. A new communicator at a dead one's address gets
// groups of its own. Collective when it splits (ranks agree: they build and destroy their units
// in the same order). Thread-safe.
absl::StatusOr<HybridGroups> SharedHybridGroups(const std::shared_ptr<comm::Communicator>& world,
                                                int group_size);

// How many pairs SharedHybridGroups currently shares, over every world communicator of the
// process (for the tests of its lifetime rules).
size_t LiveSharedHybridGroupsForTesting();

// Checks user-given groups against `world`: both set, sizes multiplying to the world size, and
// the ranks of each replicate group holding the same shard rank. Collective (one all-gather on
// `replicate`).
absl::Status CheckHybridGroups(const std::shared_ptr<comm::Communicator>& world,
                               const HybridGroups& groups);

}  // namespace fairscale::fsdp::internal
