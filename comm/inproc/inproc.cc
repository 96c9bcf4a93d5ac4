#include "comm/inproc/inproc.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/algorithms/transport_communicator.h"
#include "comm/inproc/inproc_transport.h"
#include "comm/registry.h"

namespace fairscale::comm {

absl::StatusOr<std::shared_ptr<Communicator>> CreateInproc(const CommConfig& config) {
  for (const auto& [key, value] : config.options) {
    if (!absl::StartsWith(key, "algo.")) {
      return absl::InvalidArgumentError(
          absl::StrCat("[inproc] unknown option ", key, " (inproc takes only algo.* options)"));
    }
  }
  return CreateTransportCommunicator(
      "inproc", config,
      [](std::shared_ptr<Store> store, int rank, int size, const CommConfig& cfg) {
        return CreateInprocTransport(std::move(store), rank, size, cfg.timeout);
      });
}

namespace {
const BackendRegistration kRegistration("inproc", /*priority=*/0, &CreateInproc);
}  // namespace

}  // namespace fairscale::comm
