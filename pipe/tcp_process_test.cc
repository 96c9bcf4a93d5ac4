// pipe::Pipe over the real network stack: the stages are separate processes
// (comm::testing::RunProcesses) talking over the "tcp" backend on 127.0.0.1. The inproc tests
// cover the schedules; this one catches what only a real transport and separate address spaces
// show (send buffers kept alive until delivery, the per-link communicators, the loss broadcast).
// 3 stages, GPipe, 1F1B and interleaved 1F1B (2 virtual stages per rank), 3 micro-batches, two
// steps, against the single-process reference; and a stage process that dies mid-step.
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/registry.h"
#include "comm/testing/rank_runner.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipe/pipe.h"
#include "pipe/test_util.h"
#include "testing/c10_error.h"

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
  // Interleaved: 3 ranks x 2 virtual stages of MakeMlp's 7 layers, the wrap-around link 2 -> 0
  // and every link's own communicators over tcp.
  for (const auto& [schedule, v] : {std::make_pair(Schedule::kGPipe, int64_t{1}),
                                    std::make_pair(Schedule::k1F1B, int64_t{1}),
                                    std::make_pair(Schedule::kInterleaved1F1B, int64_t{2})}) {
    std::vector<absl::Status> statuses = comm::testing::RunProcesses(
        kStages,
        [&](int rank) -> absl::Status {
          FS_ASSIGN_OR_RETURN(
              std::shared_ptr<comm::Communicator> comm,
              comm::CreateCommunicator("tcp", comm::testing::RankConfig(absl::Seconds(20))));
          // The pipe raises c10::Error: reported as this rank's Status (without the backtrace).
          return fairscale::testing::CatchErrors([&]() -> absl::Status {
            std::unique_ptr<Pipe> pipe =
                Pipe::Create(testing::MakeMlp(), comm,
                             PipeOptions().chunks(3).schedule(schedule).virtual_stages(v));
            for (size_t step = 0; step < inputs.size(); ++step) {
              at::Tensor loss = pipe->train_step(inputs[step], targets[step], testing::Mse);
              FS_RETURN_IF_ERROR(
                  testing::ExpectClose(absl::StrCat("step ", step, " loss"), loss,
                                       at::scalar_tensor(ref.losses[step], at::kDouble), 1e-5));
            }
            FS_RETURN_IF_ERROR(
                testing::CheckStageGrads(*pipe, ref.grads, 1e-5, absl::StrCat("rank ", rank)));
            // No rank tears down its sockets while a peer may still be finishing.
            return comm->Barrier().Wait();
          });
        },
        absl::Seconds(60));
    for (int r = 0; r < kStages; ++r) {
      EXPECT_THAT(statuses[r], IsOk()) << ScheduleName(schedule) << " rank " << r;
    }
  }
}

// Identity; when armed, exits the process in the forward of its second micro-batch.
class DieImpl : public torch::nn::Module {
 public:
  explicit DieImpl(bool armed) : armed_(armed) {}
  at::Tensor forward(const at::Tensor& x) {
    if (armed_ && ++forwards_ == 2) std::_Exit(3);
    return x;
  }

 private:
  bool armed_;
  int forwards_ = 0;
};
TORCH_MODULE(Die);

// Stage 1 of 3 dies in the middle of the forwards: both other stages fail (no hang) with an
// error that names stage 1 (the link they were waiting on). Interleaved (2 virtual stages per
// rank, balance {1, 3, 1, 1, 1, 1}): the Die layer is in virtual stage 1 on rank 1.
TEST(TcpProcessTest, DeadStageFailsTheOthers) {
  for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B, Schedule::kInterleaved1F1B}) {
    const bool interleaved = schedule == Schedule::kInterleaved1F1B;
    std::vector<absl::Status> statuses = comm::testing::RunProcesses(
        3,
        [&](int rank) -> absl::Status {
          FS_ASSIGN_OR_RETURN(
              std::shared_ptr<comm::Communicator> comm,
              comm::CreateCommunicator("tcp", comm::testing::RankConfig(absl::Seconds(20))));
          torch::nn::Sequential mlp = testing::MakeMlp();
          torch::nn::Sequential model;
          for (size_t l = 0; l < mlp->size(); ++l) {
            if (l == 3) model->push_back(Die(rank == 1));  // stage 1 gets layers 3, 4, 5
            model->push_back(*(mlp->begin() + l));
          }
          return fairscale::testing::CatchErrors([&]() -> absl::Status {
            std::unique_ptr<Pipe> pipe =
                Pipe::Create(model, comm,
                             PipeOptions()
                                 .balance(interleaved ? std::vector<int64_t>{1, 3, 1, 1, 1, 1}
                                                      : std::vector<int64_t>{3, 3, 2})
                                 .chunks(3)
                                 .schedule(schedule)
                                 .virtual_stages(interleaved ? 2 : 1));
            pipe->train_step(testing::Inputs(12, 1), testing::Targets(12, 2), testing::Mse);
            return absl::InternalError("train_step succeeded");
          });
        },
        absl::Seconds(60));
    EXPECT_FALSE(statuses[1].ok());
    for (int r : {0, 2}) {
      EXPECT_FALSE(statuses[r].ok()) << ScheduleName(schedule) << " rank " << r;
      // Neither the runner's timeout nor the pipe's: the dead peer is noticed at once.
      EXPECT_NE(statuses[r].code(), absl::StatusCode::kDeadlineExceeded)
          << ScheduleName(schedule) << " rank " << r << ": " << statuses[r];
      EXPECT_THAT(std::string(statuses[r].message()),
                  ::testing::AllOf(::testing::HasSubstr("pipe::Pipe::train_step: "),
                                   ::testing::Not(::testing::HasSubstr("DEADLINE_EXCEEDED")),
                                   ::testing::HasSubstr("stage 1")))
          << ScheduleName(schedule) << " rank " << r;
    }
  }
}

}  // namespace
}  // namespace fairscale::pipe
