// TransportCommunicator: a complete Communicator over any Transport
// (//comm/algorithms:transport_communicator). The tcp, ucx and inproc backends are a Transport
// plus one call to CreateTransportCommunicator; the collective algorithms, the op queue, the
// worker thread, timeouts, error propagation and Split are written once, here.
//
// Execution model: each communicator owns one worker thread. Issued operations are queued and
// run in order on it; the worker drives the Transport (progress happens in Transport::Wait) and
// completes each Work. While idle it calls Transport::Poll() periodically, so a peer that dies
// between operations is noticed. The first error (transport error, timeout, mismatch, Abort)
// breaks the communicator: the worker calls Transport::Shutdown(error) so peers fail fast, and
// every pending and later operation fails with that error.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "comm/algorithms/transport.h"
#include "comm/communicator.h"
#include "comm/config.h"
#include "comm/store/store.h"

namespace fairscale::comm {

// Creates the Transport of one rank. `store` is already namespaced for this communicator (a
// PrefixStore unique to it and to each Split child); `config` gives bind_address, timeout (use it
// for the connection setup) and options.
using TransportFactory = std::function<absl::StatusOr<std::unique_ptr<Transport>>(
    std::shared_ptr<Store> store, int rank, int size, const CommConfig& config)>;

// Option keys in CommConfig::options consumed by the algorithms (all byte counts, decimal):
//   "algo.chunk_bytes"        pipeline segment size of ring/tree algorithms (default 512 KiB)
//   "algo.small_bytes"        at or below this message size all_reduce, reduce_scatter and
//                             all_gather use one direct exchange instead of a ring (default 16 KiB)
// Keys starting with "algo." that are unknown, or malformed values, are kInvalidArgument. Other
// keys belong to the transport factory.
absl::StatusOr<std::shared_ptr<Communicator>> CreateTransportCommunicator(
    std::string backend, const CommConfig& config, TransportFactory factory);

}  // namespace fairscale::comm
