// Membership options for the //ft tests: short heartbeats (kInterval, dead after kDeadAfter) so
// that a dead group is dropped in about a second. Testonly.
#pragma once

#include "absl/time/time.h"
#include "ft/membership.h"

namespace fairscale::ft::testing {

constexpr absl::Duration kInterval = absl::Milliseconds(100);
constexpr absl::Duration kDeadAfter = absl::Seconds(1);

// Rank `rank` of a job of num_groups groups x group_size ranks (group rank / group_size).
inline Membership::Options FastOptions(int num_groups, int group_size, int rank) {
  Membership::Options o;
  o.group = rank / group_size;
  o.shard = rank % group_size;
  o.num_groups = num_groups;
  o.group_size = group_size;
  o.heartbeat_interval = kInterval;
  o.dead_after = kDeadAfter;
  o.poll_interval = absl::Milliseconds(10);
  o.below_min_wait = absl::Milliseconds(500);
  return o;
}

}  // namespace fairscale::ft::testing
