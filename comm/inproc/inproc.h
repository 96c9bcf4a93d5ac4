// The "inproc" comm backend (//comm/inproc): every rank is a thread of one process, messages are
// memcpy'd between the ranks' buffers (InprocTransport) and the collectives are the shared
// algorithms of TransportCommunicator. Linking //comm/inproc registers it (priority 0, below
// every network backend); tests and single-process demos create it with
// CreateCommunicator("inproc", config) and a HashStore shared by the rank threads.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "comm/config.h"

namespace fairscale::comm {

// config.options may hold only "algo.*" keys (see transport_communicator.h).
absl::StatusOr<std::shared_ptr<Communicator>> CreateInproc(const CommConfig& config);

}  // namespace fairscale::comm
