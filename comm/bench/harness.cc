#include "comm/bench/harness.h"

#include <stdlib.h>

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/subprocess.h"
#include "comm/config.h"
#include "comm/registry.h"
#include "comm/store/file_store.h"

namespace fairscale::comm::bench {

std::optional<BenchRank> RankFromEnv(absl::string_view prefix) {
  const char* rank = std::getenv(absl::StrCat(prefix, "_RANK").c_str());
  const char* size = std::getenv(absl::StrCat(prefix, "_SIZE").c_str());
  const char* dir = std::getenv(absl::StrCat(prefix, "_DIR").c_str());
  if (rank == nullptr || size == nullptr || dir == nullptr) return std::nullopt;
  BenchRank r;
  if (!absl::SimpleAtoi(rank, &r.rank) || !absl::SimpleAtoi(size, &r.size)) return std::nullopt;
  r.dir = dir;
  return r;
}

absl::StatusOr<std::shared_ptr<Communicator>> Connect(
    const BenchRank& rank, absl::string_view backend, absl::Duration timeout,
    const absl::flat_hash_map<std::string, std::string>& options) {
  CommConfig config;
  config.options = options;
  config.rank = rank.rank;
  config.size = rank.size;
  config.timeout = timeout;
  absl::StatusOr<std::unique_ptr<FileStore>> store = FileStore::Create(rank.dir + "/store");
  if (!store.ok()) return store.status();
  config.store = std::shared_ptr<Store>(*std::move(store));
  return CreateCommunicator(backend, config);
}

absl::StatusOr<std::string> RunRanks(absl::string_view prefix, int n,
                                     const std::vector<std::string>& args, absl::Duration timeout) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/fs_bench_XXXXXX");
  if (mkdtemp(dir.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp(", dir, ") failed"));
  }
  const std::string p(prefix);
  std::vector<absl::StatusOr<int>> results = base::RunSelfCopies(
      n, args,
      [&](int r) -> std::vector<std::string> {
        return {absl::StrCat(p, "_RANK=", r), absl::StrCat(p, "_SIZE=", n),
                absl::StrCat(p, "_DIR=", dir)};
      },
      timeout);
  std::vector<std::string> failed;
  for (int r = 0; r < n; ++r) {
    if (!results[r].ok() || *results[r] != 0) {
      failed.push_back(absl::StrCat("rank ", r, ": ",
                                    results[r].ok() ? absl::StrCat("exit code ", *results[r])
                                                    : results[r].status().ToString()));
    }
  }
  if (!failed.empty()) {
    return absl::InternalError(absl::StrCat(failed.size(), " of ", n, " ranks failed (",
                                            absl::StrJoin(failed, "; "), ")"));
  }
  return dir;
}

std::vector<std::string> ForwardFlags(const std::vector<std::string>& names) {
  std::vector<std::string> out;
  for (const std::string& name : names) {
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr) {
      std::fprintf(stderr, "ForwardFlags: this binary has no flag --%s\n", name.c_str());
      std::abort();
    }
    out.push_back(absl::StrCat("--", name, "=", flag->CurrentValue()));
  }
  return out;
}

}  // namespace fairscale::comm::bench
