// The scaffold of the multi-process benchmarks (//fsdp/bench, //oss/bench, //pipe/bench): the
// binary re-runs itself as n rank processes (base::RunSelfCopies) that meet over a FileStore in a
// fresh directory and talk tcp on 127.0.0.1; each rank writes its results into that directory,
// and the parent reads them once every rank has exited 0.
//
//   int main(int argc, char** argv) {
//     absl::ParseCommandLine(argc, argv);
//     if (std::optional<comm::bench::BenchRank> me = comm::bench::RankFromEnv("FS_OSS_BENCH")) {
//       return RunRank(*me);  // comm::bench::Connect(*me), write <me->dir>/rank<r>.tsv
//     }
//     absl::StatusOr<std::string> dir = comm::bench::RunRanks(
//         "FS_OSS_BENCH", n, comm::bench::ForwardFlags({"steps", "batch"}), absl::Hours(1));
//     ...  // read <dir>/rank<r>.tsv
//   }
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/communicator.h"

namespace fairscale::comm::bench {

// A rank process of RunRanks: its rank, the world size and the shared directory.
struct BenchRank {
  int rank = 0;
  int size = 1;
  std::string dir;
};

// This process's rank when it was started by RunRanks(prefix, ...) (<prefix>_RANK, _SIZE and
// _DIR set), else nullopt.
std::optional<BenchRank> RankFromEnv(absl::string_view prefix);

// The rank's communicator: `backend` over a FileStore in the shared directory, with `options`
// (CommConfig::options, e.g. {"tcp.cma_min_bytes", "0"}).
absl::StatusOr<std::shared_ptr<Communicator>> Connect(
    const BenchRank& rank, absl::string_view backend = "tcp",
    absl::Duration timeout = absl::Minutes(5),
    const absl::flat_hash_map<std::string, std::string>& options = {});

// Makes a fresh directory under $TEST_TMPDIR (else /tmp), runs n copies of this binary with
// `args` and <prefix>_RANK/_SIZE/_DIR, and returns the directory once all exited 0; otherwise
// an error naming every rank that failed (exit code or signal) or outlived `timeout`.
absl::StatusOr<std::string> RunRanks(absl::string_view prefix, int n,
                                     const std::vector<std::string>& args, absl::Duration timeout);

// "--name=<current value>" for each named absl flag of this binary, to pass to the ranks.
// An unknown name is a programming error (CHECK-style abort naming it).
std::vector<std::string> ForwardFlags(const std::vector<std::string>& names);

}  // namespace fairscale::comm::bench
