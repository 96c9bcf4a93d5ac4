// CommConfig: what every backend needs to create one rank's communicator (//comm:config).
#pragma once

#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "comm/store/store.h"

namespace fairscale::comm {

struct CommConfig {
  int rank = 0;
  int size = 1;
  // Rendezvous. Required by every network backend; each communicator uses its own namespace
  // inside it (so several communicators may share one store).
  std::shared_ptr<Store> store;
  // Default timeout of every operation and of the rendezvous itself.
  absl::Duration timeout = absl::Minutes(10);
  // Address that listening backends bind to and publish. Loopback unless told otherwise
  // (CreateCommunicatorFromEnv chooses one from FS_SOCKET_IFNAME or the route to MASTER_ADDR).
  std::string bind_address = "127.0.0.1";
  // The network interface bind_address was chosen by (FS_SOCKET_IFNAME); "" = none. Backends
  // that pick their own devices keep to it (ucx: UCX_NET_DEVICES, nccl: NCCL_SOCKET_IFNAME,
  // unless that is set).
  std::string network_interface;
  // Store namespace of this communicator ("" = "default"). Ranks must agree.
  std::string name;
  // Backend-specific knobs, e.g. {"algo.chunk_bytes", "1048576"}; unknown keys are
  // kInvalidArgument.
  absl::flat_hash_map<std::string, std::string> options;
};

}  // namespace fairscale::comm
