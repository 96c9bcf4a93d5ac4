// Link-time backend choice, shown: one source, three binaries that differ only in their deps.
//
//   ./bazelw run //examples/backends:which_backend_tcp   # deps //comm/tcp
//   ./bazelw run //examples/backends:which_backend_ucx   # deps //comm/ucx
//   ./bazelw run //examples/backends:which_backend_all   # deps //comm:all_backends
//   FS_COMM_BACKEND=inproc ./bazelw run //examples/backends:which_backend_all
//
// It prints the backends linked into it (highest priority first), creates 2 ranks' communicators
// with the backend named by FS_COMM_BACKEND (the variable CreateCommunicatorFromEnv reads; unset
// = the highest-priority linked one) and runs one all-reduce on each. The ranks are threads of
// this process sharing an in-memory store, so the in-process backend ("inproc") works too. Naming
// a backend that is not linked fails with the registry's kNotFound, which lists the linked ones.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "base/flags.h"
#include "base/status_macros.h"
#include "comm/communicator.h"
#include "comm/config.h"
#include "comm/registry.h"
#include "comm/store/hash_store.h"

namespace fairscale::examples {
namespace {

constexpr int kRanks = 2;

absl::Status RunRank(const std::string& backend, std::shared_ptr<comm::Store> store, int rank,
                     std::string* chosen) {
  comm::CommConfig config;
  config.rank = rank;
  config.size = kRanks;
  config.store = std::move(store);
  config.timeout = absl::Seconds(60);
  FS_ASSIGN_OR_RETURN(std::shared_ptr<comm::Communicator> comm,
                      comm::CreateCommunicator(backend, config));
  *chosen = std::string(comm->backend());
  // Rank r contributes {r + 1, 10 (r + 1)}: the sum is {3, 30}.
  std::vector<float> x = {rank + 1.0f, 10.0f * (rank + 1)}, y(2);
  FS_RETURN_IF_ERROR(comm->AllReduce(comm::MakeConstBuffer(x.data(), 2),
                                     comm::MakeBuffer(y.data(), 2), comm::ReduceOp::kSum)
                         .Wait(absl::Seconds(60)));
  if (y[0] != 3.0f || y[1] != 30.0f) {
    return absl::InternalError(
        absl::StrCat("rank ", rank, ": all_reduce gave {", y[0], ", ", y[1], "}, want {3, 30}"));
  }
  return absl::OkStatus();
}

int Main() {
  std::vector<std::string> linked = comm::LinkedBackends();
  std::printf("linked backends (highest priority first): %s\n",
              linked.empty() ? "(none)" : absl::StrJoin(linked, ", ").c_str());
  const char* env = std::getenv("FS_COMM_BACKEND");
  const std::string backend = env == nullptr ? "" : env;
  std::printf("FS_COMM_BACKEND=%s\n", env == nullptr ? "(unset: highest priority)" : env);

  std::fflush(stdout);  // before the ranks' errors on stderr

  auto store = std::make_shared<comm::HashStore>();
  std::vector<absl::Status> results(kRanks);
  std::vector<std::string> chosen(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] { results[r] = RunRank(backend, store, r, &chosen[r]); });
  }
  for (std::thread& t : threads) t.join();
  int failed = 0;
  for (int r = 0; r < kRanks; ++r) {
    if (!results[r].ok()) {
      std::fprintf(stderr, "which_backend: rank %d: %s\n", r, results[r].ToString().c_str());
      ++failed;
    }
  }
  if (failed > 0) return 1;
  std::printf("chosen backend: %s\n", chosen[0].c_str());
  std::printf("all_reduce over %d ranks [%s]: {3, 30} OK\n", kRanks, chosen[0].c_str());
  return 0;
}

}  // namespace
}  // namespace fairscale::examples

int main(int argc, char** argv) {
  fairscale::base::ParseCommandLine(
      argc, argv,
      "prints the comm backends linked into this binary, then runs one all-reduce\n"
      "over 2 ranks (threads) with the one FS_COMM_BACKEND names (unset: the highest priority).\n"
      "\n"
      "  FS_COMM_BACKEND=inproc which_backend_all\n"
      "\n"
      "Environment read: FS_COMM_BACKEND.");
  return fairscale::examples::Main();
}
