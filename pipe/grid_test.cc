// Pipeline x data parallel on a 2 x 2 grid (4 ranks): each replica pipes its half of the batch
// through 2 stages, then the stage groups average their gradients; every gradient equals the
// un-pipelined full-batch one and each replica's loss its half's. Both schedules.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipe/grid.h"
#include "pipe/pipe.h"
#include "pipe/test_util.h"

namespace fairscale::pipe {
namespace {

using base::testing::IsOk;

TEST(GridTest, TwoByTwoMatchesOneProcess) {
  const at::Tensor x = testing::Inputs(24, 1);
  const at::Tensor y = testing::Targets(24, 2);
  // 6 micro-batches of 4 rows over the whole batch = 3 per replica: the same mean of means.
  const testing::Reference ref = testing::RunReference(testing::MakeMlp, {x}, {y}, 6, testing::Mse);
  std::vector<testing::Reference> halves;
  for (int k = 0; k < 2; ++k) {
    halves.push_back(testing::RunReference(testing::MakeMlp, {x.narrow(0, 12 * k, 12)},
                                           {y.narrow(0, 12 * k, 12)}, 3, testing::Mse));
  }
  for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B}) {
    std::vector<absl::Status> statuses = testing::RunInproc(
        4, [&](int rank, std::shared_ptr<comm::Communicator> world) -> absl::Status {
          const PipeGrid grid = MakePipeGrid(world, 2);
          if (grid.stage != rank % 2 || grid.replica != rank / 2 || grid.pipe->size() != 2 ||
              grid.data->size() != 2 || grid.pipe->rank() != grid.stage) {
            return absl::InternalError("grid layout");
          }
          std::unique_ptr<Pipe> pipe =
              Pipe::Create(testing::MakeMlp(), grid.pipe,
                           PipeOptions().balance({3, 4}).chunks(3).schedule(schedule));
          const int64_t k = grid.replica;
          const at::Tensor loss =
              pipe->train_step(x.narrow(0, 12 * k, 12), y.narrow(0, 12 * k, 12), testing::Mse);
          FS_RETURN_IF_ERROR(testing::ExpectClose(
              "replica loss", loss, at::scalar_tensor(halves[k].losses[0], at::kDouble), 1e-5));
          all_reduce_gradients(pipe->parameters(), *grid.data);
          return testing::CheckStageGrads(*pipe, ref.grads, 1e-5,
                                          absl::StrCat(ScheduleName(schedule), " rank ", rank));
        });
    for (int r = 0; r < 4; ++r) EXPECT_THAT(statuses[r], IsOk()) << "rank " << r;
  }
}

TEST(GridTest, StagesMustDivideTheWorld) {
  std::vector<absl::Status> statuses = testing::RunInproc(
      3, [&](int rank, std::shared_ptr<comm::Communicator> world) -> absl::Status {
        MakePipeGrid(world, 2);
        return absl::OkStatus();
      });
  for (int r = 0; r < 3; ++r) {
    // The c10::Error's message (RunInproc returns it as a Status).
    EXPECT_FALSE(statuses[r].ok()) << "rank " << r;
    EXPECT_THAT(std::string(statuses[r].message()),
                ::testing::HasSubstr(absl::StrCat("pipe::MakePipeGrid (rank ", r,
                                                  "/3): INVALID_ARGUMENT: 2 stages do not divide "
                                                  "3 ranks")));
  }
}

}  // namespace
}  // namespace fairscale::pipe
