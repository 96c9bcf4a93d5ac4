// InprocTransport: a Transport between ranks that are threads of one process
// (//comm/inproc:inproc_transport). The "inproc" backend (inproc.h) wraps it in a
// TransportCommunicator; tests use it to run every collective without sockets.
//
// Rendezvous: rank 0 creates a domain with a random id in a process-global registry and
// publishes the id in the store; the other ranks read it and join. Each ordered pair of ranks
// has a FIFO of posted sends and one of posted receives; whichever side posts second copies the
// message straight from the sender's buffer into the receiver's (one copy) and completes both
// requests. A send therefore completes only once the receiver has posted the matching receive.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "comm/algorithms/transport.h"
#include "comm/store/store.h"

namespace fairscale::comm {

// Joins (rank 0: creates) the domain named in `store`, waiting up to `timeout` for rank 0.
absl::StatusOr<std::unique_ptr<Transport>> CreateInprocTransport(std::shared_ptr<Store> store,
                                                                 int rank, int size,
                                                                 absl::Duration timeout);

}  // namespace fairscale::comm
