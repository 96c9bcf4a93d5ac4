// The tcp backend (//comm/tcp): TcpTransport under the shared TransportCommunicator, registered
// as "tcp". Binaries choose it by linking this target (alwayslink) and calling
// CreateCommunicator("tcp", config), or CreateCommunicator("") when it is the highest-priority
// backend linked.
#include <memory>

#include "absl/status/statusor.h"
#include "base/status_macros.h"
#include "comm/algorithms/transport_communicator.h"
#include "comm/config.h"
#include "comm/registry.h"
#include "comm/tcp/tcp_transport.h"

namespace fairscale::comm {
namespace {

absl::StatusOr<std::shared_ptr<Communicator>> CreateTcp(const CommConfig& config) {
  // Reject unknown options before anyone connects, so a typo fails fast on every rank.
  FS_RETURN_IF_ERROR(ParseTcpOptions(config).status());
  return CreateTransportCommunicator("tcp", config, &CreateTcpTransport);
}

const BackendRegistration kRegistration("tcp", /*priority=*/10, &CreateTcp);

}  // namespace
}  // namespace fairscale::comm
