#include "comm/testing/inproc_ranks.h"

#include "absl/status/statusor.h"
#include "comm/registry.h"
#include "comm/testing/rank_runner.h"

namespace fairscale::comm::testing {

std::vector<absl::Status> RunInprocRanks(int world, const InprocRankBody& body,
                                         absl::Duration timeout) {
  return RunThreads(
      world,
      [body, world, timeout](int rank) -> absl::Status {
        absl::StatusOr<std::shared_ptr<Communicator>> comm =
            CreateCommunicator("inproc", RankConfig(timeout));
        if (!comm.ok()) return comm.status();
        absl::Status status;
        try {
          status = body(rank, world, *comm);
        } catch (const std::exception& e) {
          status = absl::InternalError(e.what());
        }
        absl::Status barrier = (*comm)->Barrier().Wait();
        return status.ok() ? barrier : status;
      },
      timeout + absl::Seconds(30));
}

}  // namespace fairscale::comm::testing
