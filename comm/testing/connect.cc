#include "comm/testing/connect.h"

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "comm/registry.h"
#include "comm/testing/rank_runner.h"

namespace fairscale::comm::testing {

absl::StatusOr<std::shared_ptr<Communicator>> ConnectRank(absl::string_view backend, int rank,
                                                          int world, absl::Duration timeout) {
  FS_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm,
                      CreateCommunicator(backend, RankConfig(timeout)));
  if (comm->size() != world || comm->rank() != rank) {
    return absl::InternalError(absl::StrCat("communicator is rank ", comm->rank(), "/",
                                            comm->size(), ", expected ", rank, "/", world));
  }
  return comm;
}

}  // namespace fairscale::comm::testing
