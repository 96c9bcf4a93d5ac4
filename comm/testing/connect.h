// The communicator of the current rank of a RunProcesses/RunThreads body, checked against the
// rank and world size the body expects (a test that connects over a real backend).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/communicator.h"

namespace fairscale::comm::testing {

// CreateCommunicator(backend, RankConfig(timeout)); kInternal naming both when the result is not
// rank `rank` of `world`.
absl::StatusOr<std::shared_ptr<Communicator>> ConnectRank(absl::string_view backend, int rank,
                                                          int world, absl::Duration timeout);

}  // namespace fairscale::comm::testing
