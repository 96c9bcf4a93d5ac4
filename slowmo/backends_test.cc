// SlowMo / LocalSGD over the real network stack: ranks are separate processes
// (comm::testing::RunProcesses) talking over the "tcp" backend, and over the "ucx" backend with
// UCX's tcp transport and with its shared-memory transports, on 127.0.0.1. slowmo_test covers the
// algorithm with threads over inproc; this test checks that it composes with the backends (the
// asynchronous per-dtype-bucket all-reduces between separate address spaces). Each rank's
// parameters after several outer periods are compared with the single-process simulation of
// slowmo/test_util.h.
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "comm/communicator.h"
#include "comm/registry.h"
#include "comm/testing/rank_runner.h"
#include "gtest/gtest.h"
#include "slowmo/slowmo.h"
#include "slowmo/test_util.h"
#include "testing/c10_error.h"

namespace fairscale::slowmo {
namespace {

using testing::Config;
using testing::Opt;

constexpr double kTol = 1e-6;  // as slowmo_test

// LocalSGD and slow momentum, H = 2 and 3, SGD and Adam; 9 steps are 4 or 3 outer periods. The
// model has an f32 weight and an f64 bias: two dtype buckets, two all-reduces per period.
std::vector<Config> Configs(int world) {
  return {
      {world, Opt::kSgd, 2, 1.0, 0.0, 9},   // LocalSGD
      {world, Opt::kAdam, 3, 1.0, 0.0, 9},  // LocalSGD
      {world, Opt::kSgd, 3, 1.0, 0.5, 9},   // SlowMo
      {world, Opt::kAdam, 2, 0.7, 0.3, 9},  // SlowMo
  };
}

// "tcp", "ucx ucx.tls=tcp": for messages.
std::string Label(const std::string& backend,
                  const absl::flat_hash_map<std::string, std::string>& options) {
  auto it = options.find("ucx.tls");
  return it == options.end() ? backend : absl::StrCat(backend, " ucx.tls=", it->second);
}

// One rank: a communicator over `backend` (with `options`), then every configuration in turn on
// it. Prints this rank's max error (the parent shows it prefixed "[rank r]").
absl::Status RunRank(const std::string& backend,
                     const absl::flat_hash_map<std::string, std::string>& options, int rank,
                     int world, const std::vector<std::vector<std::vector<at::Tensor>>>& want) {
  comm::CommConfig config = comm::testing::RankConfig(absl::Seconds(20));
  config.options = options;
  FS_ASSIGN_OR_RETURN(std::shared_ptr<comm::Communicator> comm,
                      comm::CreateCommunicator(backend, config));
  FS_RETURN_IF_ERROR(
      comm::testing::Check(comm->rank() == rank && comm->size() == world,
                           absl::StrCat("communicator is rank ", comm->rank(), "/", comm->size())));
  const std::vector<Config> configs = Configs(world);
  for (size_t i = 0; i < configs.size(); ++i) {
    const Config& c = configs[i];
    FS_RETURN_IF_ERROR(fairscale::testing::CatchErrors([&]() -> absl::Status {
      testing::Worker m(c.opt);
      SlowMo slowmo(
          m.params(), comm,
          SlowMoOptions().frequency(c.h).slowmo_lr(c.alpha).slowmo_momentum(c.beta).base_lr(
              testing::kLr));
      for (int step = 0; step < c.steps; ++step) {
        testing::Backward(m, rank, step);
        m.opt->step();
        slowmo.step_completed();
      }
      return testing::Close(m.params(), want[i][rank], kTol,
                            absl::StrCat(Label(backend, options), " ", c.Name()));
    }));
  }
  std::cout << Label(backend, options) << " world " << world << ": max |error| "
            << testing::TakeMaxError() << "\n";
  // No rank tears down its connections while a peer may still be finishing its last operation.
  return comm->Barrier().Wait();
}

void RunBackend(const std::string& backend,
                const absl::flat_hash_map<std::string, std::string>& options) {
  for (int world : {2, 3}) {
    // Runs again in every child process (see rank_runner.h): cheap and without side effects.
    std::vector<std::vector<std::vector<at::Tensor>>> want;
    for (const Config& c : Configs(world)) want.push_back(testing::Simulate(c));
    comm::testing::ExpectAllOk(
        comm::testing::RunProcesses(
            world, [&](int rank) { return RunRank(backend, options, rank, world, want); },
            absl::Seconds(40)),
        absl::StrCat(Label(backend, options), " world ", world));
  }
}

TEST(BackendsTest, TcpProcessesMatchSimulation) { RunBackend("tcp", {}); }

// UCX's transports chosen per communicator (the option overrides UCX_TLS), as the comm/ucx
// conformance tests choose them: tcp, and shared memory.

TEST(BackendsTest, UcxTcpProcessesMatchSimulation) { RunBackend("ucx", {{"ucx.tls", "tcp"}}); }

TEST(BackendsTest, UcxSharedMemoryProcessesMatchSimulation) {
  RunBackend("ucx", {{"ucx.tls", "posix,sysv,self"}});
}

}  // namespace
}  // namespace fairscale::slowmo
