// Slurm host lists (//comm:slurm_hostlist): the compressed node-list syntax of
// SLURM_JOB_NODELIST / SLURM_NODELIST / SLURM_STEP_NODELIST, e.g. "node[01-04,07]",
// "a[1-2],b3", "gpu-[9-11]x", "rack[1-2]-n[1-3]". ParseEnv (//comm:registry) takes the first
// host as the rendezvous address of a job started by srun when MASTER_ADDR is unset.
//
// Grammar: a list is comma-separated hosts; a host is literal text (letters, digits, '-', '.',
// '_') and bracket groups; a group is comma-separated numbers and ranges "lo-hi" (lo <= hi).
// A range whose lo has leading zeros is zero-padded to lo's width ("[01-10]" gives 01 .. 10),
// as Slurm writes them. Several groups in one host expand to their product, leftmost slowest.
// No nesting, no whitespace, numbers of at most 18 digits.
//
// Bounded: the text is at most kMaxHostListBytes, and ExpandSlurmHostList produces at most
// `max_hosts` names (kInvalidArgument beyond, before building them). Errors are
// kInvalidArgument naming the offending piece and its offset; callers prefix the variable.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fairscale::comm {

inline constexpr size_t kMaxHostListBytes = 64 << 10;

// Every host of `list`, in order.
absl::StatusOr<std::vector<std::string>> ExpandSlurmHostList(absl::string_view list,
                                                             size_t max_hosts = 1 << 16);

// The first host of `list` (validates the whole list, expands nothing else).
absl::StatusOr<std::string> FirstSlurmHost(absl::string_view list);

}  // namespace fairscale::comm
