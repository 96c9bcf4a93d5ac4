// RunInprocRanks (testonly): the thread rank runner with a fresh "inproc" communicator per rank,
// for the feature packages' multi-rank tests (fsdp, oss, amp, pipe, checkpoint), which all need
// the same preamble: create the communicator, run the body, and keep the communicator alive
// until every rank is done with it.
//
//   ExpectAllOk(RunInprocRanks(4, [&](int rank, int world, std::shared_ptr<Communicator> comm)
//                                  -> absl::Status { ...; return absl::OkStatus(); }),
//               "parity");
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "comm/communicator.h"

namespace fairscale::comm::testing {

using InprocRankBody =
    std::function<absl::Status(int rank, int world, std::shared_ptr<Communicator> comm)>;

// Runs body(rank, world, comm) on `world` threads (RunThreads), each over its own inproc
// communicator (operation timeout `timeout`), then a barrier on it, also after a failed body:
// a rank that returned would destroy its communicator while a peer may still be finishing its
// last operation, or not have joined yet (a body without collectives). Returns one status per
// rank: the body's (or the communicator's creation or the barrier's); an exception becomes
// kInternal with its message; a rank still running `timeout` + 30 s after the start is reported
// as kDeadlineExceeded.
std::vector<absl::Status> RunInprocRanks(int world, const InprocRankBody& body,
                                         absl::Duration timeout = absl::Seconds(30));

}  // namespace fairscale::comm::testing
