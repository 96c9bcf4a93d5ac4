// Parity of pipe::Pipe with the same model run un-pipelined in one process: the loss of every
// step and the accumulated gradient of every parameter within 1e-5 (f32), for 1 (no pipeline),
// 2, 3 and 4 stages x chunks 1, 3, 8 x both schedules x the three checkpoint modes. Two steps
// per run: the second has twice the rows (a layout change between the stages) and accumulates
// into the first's gradients.
#include <ATen/ops/scalar_tensor.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_matchers.h"
#include "gtest/gtest.h"
#include "pipe/pipe.h"
#include "pipe/test_util.h"

namespace fairscale::pipe {
namespace {

using base::testing::IsOk;

// Balances over MakeMlp's 7 layers.
std::vector<int64_t> BalanceFor(int stages) {
  switch (stages) {
    case 2:
      return {3, 4};
    case 3:
      return {2, 3, 2};
    default:
      return {};  // the even split: {2, 2, 2, 1}
  }
}

class ParityTest
    : public ::testing::TestWithParam<std::tuple<int, Schedule, CheckpointMode>> {};

TEST_P(ParityTest, LossAndGradientsMatchOneProcess) {
  const auto [stages, schedule, mode] = GetParam();
  const std::vector<at::Tensor> inputs = {testing::Inputs(24, 1), testing::Inputs(48, 2)};
  const std::vector<at::Tensor> targets = {testing::Targets(24, 3), testing::Targets(48, 4)};
  for (int64_t chunks : {1, 3, 8}) {
    const testing::Reference ref =
        testing::RunReference(testing::MakeMlp, inputs, targets, chunks, testing::Mse);
    const std::string what = absl::StrCat(stages, " stages, ", ScheduleName(schedule), ", ",
                                          CheckpointModeName(mode), ", chunks ", chunks);
    const PipeOptions options =
        PipeOptions().balance(BalanceFor(stages)).chunks(chunks).schedule(schedule).checkpoint(
            mode);
    std::vector<absl::Status> statuses =
        testing::RunParity(stages, testing::MakeMlp, options, inputs, targets, ref, what);
    for (int r = 0; r < stages; ++r) EXPECT_THAT(statuses[r], IsOk()) << what << " rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, ParityTest,
    ::testing::Combine(::testing::Values(1, 2, 3, 4),
                       ::testing::Values(Schedule::kGPipe, Schedule::k1F1B),
                       ::testing::Values(CheckpointMode::kAlways, CheckpointMode::kExceptLast,
                                         CheckpointMode::kNever)),
    [](const ::testing::TestParamInfo<ParityTest::ParamType>& info) {
      return absl::StrCat(std::get<0>(info.param), "stages_",
                          ScheduleName(std::get<1>(info.param)), "_",
                          CheckpointModeName(std::get<2>(info.param)));
    });

// Uneven micro-batches (10 rows in 3 chunks: 4, 3, 3): the loss is the mean of the micro-batch
// losses, as the reference computes it. Even balance by default.
TEST(PipeTest, UnevenMicroBatches) {
  const std::vector<at::Tensor> inputs = {testing::Inputs(10, 5)};
  const std::vector<at::Tensor> targets = {testing::Targets(10, 6)};
  const testing::Reference ref =
      testing::RunReference(testing::MakeMlp, inputs, targets, 3, testing::Mse);
  std::vector<absl::Status> statuses = testing::RunInproc(
      3, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        std::unique_ptr<Pipe> pipe =
            Pipe::Create(testing::MakeMlp(), comm, PipeOptions().chunks(3));
        if (pipe->balance() != std::vector<int64_t>{3, 2, 2}) {
          return absl::InternalError("even balance is not {3, 2, 2}");
        }
        at::Tensor loss = pipe->train_step(inputs[0], targets[0], testing::Mse);
        absl::Status s =
            testing::ExpectClose("loss", loss, at::scalar_tensor(ref.losses[0], at::kDouble), 1e-5);
        if (!s.ok()) return s;
        return testing::CheckStageGrads(*pipe, ref.grads, 1e-5, absl::StrCat("rank ", rank));
      });
  for (int r = 0; r < 3; ++r) EXPECT_THAT(statuses[r], IsOk()) << "rank " << r;
}

// CreateForStage: each rank holds only its layers; names follow the global indices.
TEST(PipeTest, CreateForStageMatchesCreate) {
  const std::vector<at::Tensor> inputs = {testing::Inputs(12, 7)};
  const std::vector<at::Tensor> targets = {testing::Targets(12, 8)};
  const testing::Reference ref =
      testing::RunReference(testing::MakeMlp, inputs, targets, 4, testing::Mse);
  std::vector<absl::Status> statuses = testing::RunInproc(
      2, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        torch::nn::Sequential full = testing::MakeMlp();
        torch::nn::Sequential mine;
        const int64_t first = rank == 0 ? 0 : 4;
        const int64_t end = rank == 0 ? 4 : 7;
        for (int64_t l = first; l < end; ++l) mine->push_back(*(full->begin() + l));
        std::unique_ptr<Pipe> pipe =
            Pipe::CreateForStage(mine, comm, PipeOptions().balance({4, 3}).chunks(4));
        if (pipe->first_layer() != first) return absl::InternalError("first_layer");
        at::Tensor loss = pipe->train_step(inputs[0], targets[0], testing::Mse);
        return testing::CheckStageGrads(*pipe, ref.grads, 1e-5, absl::StrCat("rank ", rank));
      });
  for (int r = 0; r < 2; ++r) EXPECT_THAT(statuses[r], IsOk()) << "rank " << r;
}

// eval_step: the reference loss on every rank, forwards only in the trace, no gradients.
TEST(PipeTest, EvalStepMatchesAndLeavesNoGradients) {
  const std::vector<at::Tensor> inputs = {testing::Inputs(12, 9)};
  const std::vector<at::Tensor> targets = {testing::Targets(12, 10)};
  const testing::Reference ref =
      testing::RunReference(testing::MakeMlp, inputs, targets, 4, testing::Mse);
  for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B}) {
    std::vector<absl::Status> statuses = testing::RunInproc(
        3, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
          std::unique_ptr<Pipe> pipe = Pipe::Create(
              testing::MakeMlp(), comm,
              PipeOptions().chunks(4).schedule(schedule).checkpoint(CheckpointMode::kAlways));
          at::Tensor loss = pipe->eval_step(inputs[0], targets[0], testing::Mse);
          absl::Status s = testing::ExpectClose(
              "eval loss", loss, at::scalar_tensor(ref.losses[0], at::kDouble), 1e-5);
          if (!s.ok()) return s;
          if (pipe->trace().size() != 4) return absl::InternalError("trace size");
          for (const PipeEvent& e : pipe->trace()) {
            if (e.phase != Phase::kForward) return absl::InternalError("a backward ran");
          }
          for (const at::Tensor& p : pipe->parameters()) {
            if (p.grad().defined()) return absl::InternalError("eval_step left a gradient");
          }
          return absl::OkStatus();
        });
    for (int r = 0; r < 3; ++r) EXPECT_THAT(statuses[r], IsOk()) << "rank " << r;
  }
}

}  // namespace
}  // namespace fairscale::pipe
