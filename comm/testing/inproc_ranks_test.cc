// RunInprocRanks: a communicator per rank of the right rank and size, statuses per rank, thrown
// exceptions reported, and a body without collectives (ranks returning at once) that still
// finds its peers; CountingCommunicator counts what passes through it.
#include "comm/testing/inproc_ranks.h"

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/communicator.h"
#include "comm/testing/counting_communicator.h"
#include "comm/testing/rank_runner.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::comm::testing {
namespace {

using ::fairscale::base::testing::IsOk;
using ::fairscale::base::testing::StatusIs;
using ::testing::HasSubstr;

TEST(RunInprocRanks, GivesEachRankItsCommunicator) {
  for (int world = 1; world <= 4; ++world) {
    ExpectAllOk(RunInprocRanks(
                    world,
                    [](int rank, int w, std::shared_ptr<Communicator> comm) -> absl::Status {
                      FS_RETURN_IF_ERROR(Check(
                          comm->rank() == rank && comm->size() == w && comm->backend() == "inproc",
                          absl::StrCat("rank ", comm->rank(), "/", comm->size())));
                      const int32_t mine = rank + 1;
                      int32_t v = 0;
                      FS_RETURN_IF_ERROR(comm->AllReduce(MakeConstBuffer(&mine, 1),
                                                         MakeBuffer(&v, 1), ReduceOp::kSum)
                                             .Wait());
                      return Check(v == w * (w + 1) / 2, absl::StrCat("sum ", v));
                    }),
                absl::StrCat("world ", world));
  }
}

TEST(RunInprocRanks, ReportsEachRanksStatusAndExceptions) {
  std::vector<absl::Status> statuses =
      RunInprocRanks(3, [](int rank, int, std::shared_ptr<Communicator>) -> absl::Status {
        if (rank == 1) return absl::NotFoundError("rank 1's own error");
        if (rank == 2) throw std::runtime_error("rank 2 threw");
        return absl::OkStatus();
      });
  ASSERT_EQ(statuses.size(), 3u);
  EXPECT_THAT(statuses[0], IsOk());
  EXPECT_THAT(statuses[1], StatusIs(absl::StatusCode::kNotFound, "rank 1's own error"));
  EXPECT_THAT(statuses[2], StatusIs(absl::StatusCode::kInternal, HasSubstr("rank 2 threw")));
}

TEST(CountingCommunicator, CountsOpsAndBytesPerType) {
  ExpectAllOk(
      RunInprocRanks(2, [](int rank, int, std::shared_ptr<Communicator> inner) -> absl::Status {
        auto counting = std::make_shared<CountingCommunicator>(inner);
        std::vector<float> v(5, 1.0f);
        for (int i = 0; i < 2; ++i) {
          FS_RETURN_IF_ERROR(counting
                                 ->AllReduce(MakeConstBuffer(v.data(), v.size()),
                                             MakeBuffer(v.data(), v.size()), ReduceOp::kSum)
                                 .Wait());
        }
        FS_RETURN_IF_ERROR(counting->Barrier().Wait());
        const CountingCommunicator::Count all_reduce = counting->count(OpType::kAllReduce);
        FS_RETURN_IF_ERROR(Check(
            all_reduce.ops == 2 && all_reduce.bytes == 2 * 5 * 4,
            absl::StrCat("all_reduce ", all_reduce.ops, " ops ", all_reduce.bytes, " bytes")));
        FS_RETURN_IF_ERROR(Check(counting->count(OpType::kBarrier).ops == 1, "barrier"));
        FS_RETURN_IF_ERROR(Check(counting->count(OpType::kAllGather).ops == 0, "all_gather"));
        counting->Reset();
        return Check(counting->count(OpType::kAllReduce).ops == 0, "after Reset");
      }));
}

}  // namespace
}  // namespace fairscale::comm::testing
