// The ucx backend (//comm/ucx): UcxTransport under the shared TransportCommunicator, registered
// as "ucx" with priority 5, below tcp (10), so CreateCommunicator("") keeps choosing tcp when both
// are linked. UCX picks its own transports (tcp, shared memory, ...) from UCX_TLS.
#include <memory>

#include "absl/status/statusor.h"
#include "comm/algorithms/transport_communicator.h"
#include "comm/config.h"
#include "comm/registry.h"
#include "comm/ucx/ucx_transport.h"

namespace fairscale::comm {
namespace {

absl::StatusOr<std::shared_ptr<Communicator>> CreateUcx(const CommConfig& config) {
  return CreateTransportCommunicator("ucx", config, &CreateUcxTransport);
}

const BackendRegistration kRegistration("ucx", /*priority=*/5, &CreateUcx);

}  // namespace
}  // namespace fairscale::comm
