// Rank runners: run one test body as the `n` ranks of a job, either as threads of the test
// process (fast; the ranks share a HashStore) or as real processes (the test binary re-executes
// itself once per rank; the ranks share a FileStore). The comm conformance suite
// (//comm/testing:conformance) and the multi-rank tests of the feature packages (fsdp, oss, ...)
// use them; both runners collect one absl::Status per rank and never hang.
//
//   TEST(Oss, MatchesSingleProcessReference) {
//     std::vector<absl::Status> statuses = RunProcesses(4, [&](int rank) -> absl::Status {
//       FS_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm,
//                           CreateCommunicator("tcp", RankConfig(absl::Seconds(20))));
//       ...  // return an error instead of using EXPECT_* (see below)
//       return absl::OkStatus();
//     }, absl::Seconds(60));
//     ExpectAllOk(statuses, "reference");  // one EXPECT per rank, naming it
//   }
//
// Rules for rank bodies:
// * Report failures by returning a non-OK status. A failed EXPECT_*/ASSERT_* in a child process
//   is printed in its output and turns an OK return into kInternal, but the parent cannot show
//   which check failed; with threads, gtest records it as usual.
// * RunProcesses re-runs the current test in each child (`--gtest_filter=<this test>`): the code
//   of the test before the RunProcesses call runs again in every child, so keep it cheap and free
//   of side effects outside the process. The k-th RunProcesses call of a test runs the body of the
//   k-th call in the children; earlier calls return all-OK there without running anything.
// * A body must finish well within `timeout`. A rank still running then is reported as
//   kDeadlineExceeded: a child process is SIGKILLed; a thread cannot be killed, so it is detached
//   and keeps running (it must not touch objects that the test destroys; design tests so that
//   this never happens).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/config.h"
#include "comm/store/store.h"

namespace fairscale::comm::testing {

// The body of one rank; returns that rank's verdict.
using RankBody = std::function<absl::Status(int rank)>;

// Runs body(0) ... body(n-1) on n threads that share a fresh HashStore. Each thread sets
// base::ScopedLogRank(rank, n). Returns one status per rank: the body's, kInternal if it threw,
// or kDeadlineExceeded if it was still running after `timeout` (that thread is detached).
std::vector<absl::Status> RunThreads(int n, RankBody body, absl::Duration timeout);

// Runs body(r) in n child processes of this test binary, spawned with posix_spawn (never fork:
// the parent may run threads) and rendezvousing through a FileStore in a fresh directory under
// $TEST_TMPDIR. Children get FS_TEST_RANK, FS_TEST_WORLD_SIZE and FS_TEST_STORE_DIR (plus runner
// bookkeeping variables) and die with the parent. Waits at most `timeout`, SIGKILLs the children
// still running then and reports them as kDeadlineExceeded. Returns one status per rank: the
// body's (code and message cross the process boundary), kInternal "killed by signal N" for a
// child that died of a signal, kInternal for one that exited without reporting. The children's
// output is printed afterwards, each line prefixed "[rank r] ". Must be called from inside a
// gtest test body (outside one, every rank gets kFailedPrecondition).
std::vector<absl::Status> RunProcesses(int n, RankBody body, absl::Duration timeout);

enum class RunnerKind { kThreads, kProcesses };
absl::string_view RunnerKindName(RunnerKind kind);  // "threads", "processes"

// RunThreads or RunProcesses.
std::vector<absl::Status> RunRanks(RunnerKind kind, int n, RankBody body, absl::Duration timeout);

// The rank a body is running as. Valid on the thread that runs the body (not on threads the body
// starts) for the duration of the body.
struct RankInfo {
  int rank = 0;
  int size = 1;
  RunnerKind runner = RunnerKind::kThreads;
  // The store shared by every rank of this run, empty when the run starts.
  std::shared_ptr<Store> store;
};

// The current rank, or nullptr outside a rank body.
const RankInfo* CurrentRank();

// A CommConfig for the current rank: rank, size, the shared store and `timeout` (the default
// timeout of the communicator's operations and rendezvous). Aborts with a message when called
// outside a rank body. Several communicators created in one run need distinct `name`s.
CommConfig RankConfig(absl::Duration timeout);

// Expects every rank's status to be OK: one gtest failure per failed rank, "<what> rank r/n:
// <status>". (The counterpart of the runners: rank bodies return statuses, the test asserts
// after the join.)
void ExpectAllOk(const std::vector<absl::Status>& statuses, absl::string_view what = "");

// A check inside a rank body: OK if `ok`, else kInternal with `what`.
//   FS_RETURN_IF_ERROR(Check(got == want, absl::StrCat("step ", s, ": ", got, " != ", want)));
absl::Status Check(bool ok, absl::string_view what);

// True in a child process started by RunProcesses (also before the body runs, e.g. in the part
// of the test that precedes the RunProcesses call).
bool IsRankProcess();

}  // namespace fairscale::comm::testing
