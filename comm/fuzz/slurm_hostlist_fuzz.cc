// Fuzz target for the Slurm host-list parser (comm/slurm_hostlist.h), which reads
// SLURM_*NODELIST from the environment. Built two ways: //comm/fuzz:slurm_hostlist_fuzz_test
// (gcc; replays seeds plus deterministic mutations on every test run, slurm_hostlist_replay.cc)
// and run_libfuzzer.sh (clang, -fsanitize=fuzzer,address,undefined).
//
// For each input it checks that
//   * both functions return OK or kInvalidArgument, and agree: FirstSlurmHost is OK exactly when
//     the expansion is (or when the expansion only hit the host limit), and is its first host;
//   * the expansion is bounded (at most kFuzzMaxHosts names) and every host is non-empty
//     literal text (no '[', ']' or ',');
//   * the hosts, joined with ',', parse back to the same hosts.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "base/fuzz_check.h"
#include "comm/slurm_hostlist.h"

namespace {

constexpr size_t kFuzzMaxHosts = 4096;

bool IsOkOrInvalid(const absl::Status& s) {
  return s.ok() || s.code() == absl::StatusCode::kInvalidArgument;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view list(reinterpret_cast<const char*>(data), size);
  auto hosts = fairscale::comm::ExpandSlurmHostList(list, kFuzzMaxHosts);
  auto first = fairscale::comm::FirstSlurmHost(list);
  FS_FUZZ_CHECK(IsOkOrInvalid(hosts.status()));
  FS_FUZZ_CHECK(IsOkOrInvalid(first.status()));
  if (!hosts.ok()) {
    // Only a valid list longer than the limit may still have a first host.
    FS_FUZZ_CHECK(!first.ok() || absl::string_view(hosts.status().message()).find(
                                           " names more than ") != absl::string_view::npos);
    return 0;
  }
  FS_FUZZ_CHECK(first.ok());
  FS_FUZZ_CHECK(!hosts->empty());
  FS_FUZZ_CHECK(hosts->size() <= kFuzzMaxHosts);
  FS_FUZZ_CHECK(*first == hosts->front());
  for (const std::string& h : *hosts) {
    FS_FUZZ_CHECK(!h.empty());
    FS_FUZZ_CHECK(h.find_first_of("[],") == std::string::npos);
  }
  const std::string joined = absl::StrJoin(*hosts, ",");
  if (joined.size() <= fairscale::comm::kMaxHostListBytes) {
    auto again = fairscale::comm::ExpandSlurmHostList(joined, kFuzzMaxHosts);
    FS_FUZZ_CHECK(again.ok());
    FS_FUZZ_CHECK(*again == *hosts);
  }
  return 0;
}
