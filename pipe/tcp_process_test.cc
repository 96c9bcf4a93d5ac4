// pipe::Pipe over the real network stack: the stages are separate processes
// (comm::testing::RunProcesses) talking over the "tcp" backend on 127.0.0.1. The inproc tests
// cover the schedules; this one catches what only a real transport and separate address spaces
// show (send buffers kept alive until delivery, the two split communicators, the loss broadcast).
// 3 stages, both schedules, 3 micro-batches, two steps, against the single-process reference.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/registry.h"
#include "comm/testing/rank_runner.h"
#include "gtest/gtest.h"
#include "pipe/pipe.h"
#include "pipe/test_util.h"

namespace fairscale::pipe {
namespace {

using base::testing::IsOk;

TEST(TcpProcessTest, ThreeStagesMatchOneProcess) {
  constexpr int kStages = 3;
  // Runs again in every child process (see rank_runner.h): cheap and without side effects.
  const std::vector<at::Tensor> inputs = {testing::Inputs(12, 1), testing::Inputs(9, 2)};
  const std::vector<at::Tensor> targets = {testing::Targets(12, 3), testing::Targets(9, 4)};
  const testing::Reference ref =
      testing::RunReference(testing::MakeMlp, inputs, targets, 3, testing::Mse);
  for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B}) {
    std::vector<absl::Status> statuses = comm::testing::RunProcesses(
        kStages,
        [&](int rank) -> absl::Status {
          FS_ASSIGN_OR_RETURN(
              std::shared_ptr<comm::Communicator> comm,
              comm::CreateCommunicator("tcp", comm::testing::RankConfig(absl::Seconds(20))));
          FS_ASSIGN_OR_RETURN(
              std::unique_ptr<Pipe> pipe,
              Pipe::Create(testing::MakeMlp(), comm, PipeOptions().chunks(3).schedule(schedule)));
          for (size_t step = 0; step < inputs.size(); ++step) {
            FS_ASSIGN_OR_RETURN(at::Tensor loss,
                                pipe->train_step(inputs[step], targets[step], testing::Mse));
            FS_RETURN_IF_ERROR(testing::ExpectClose(
                absl::StrCat("step ", step, " loss"), loss,
                at::scalar_tensor(ref.losses[step], at::kDouble), 1e-5));
          }
          FS_RETURN_IF_ERROR(
              testing::CheckStageGrads(*pipe, ref.grads, 1e-5, absl::StrCat("rank ", rank)));
          // No rank tears down its sockets while a peer may still be finishing.
          return comm->Barrier().Wait();
        },
        absl::Seconds(60));
    for (int r = 0; r < kStages; ++r) {
      EXPECT_THAT(statuses[r], IsOk()) << ScheduleName(schedule) << " rank " << r;
    }
  }
}

}  // namespace
}  // namespace fairscale::pipe
