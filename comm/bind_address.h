// Which local address a rank listens on and advertises to its peers (//comm:bind_address).
// CreateCommunicatorFromEnv calls ChooseBindAddress to fill CommConfig::bind_address; the tcp
// backend's mesh listens there, and the ucx backend restricts its devices to the named
// interface. GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME are the models:
//
//   FS_SOCKET_IFNAME=eth0   the IPv4 address of interface eth0 (an unknown interface, or one
//                           without an IPv4 address, is kInvalidArgument listing the interfaces)
//   unset                   127.0.0.1 when every rank is on this host (or no MASTER_ADDR, or a
//                           loopback one); otherwise the address this host would use to reach
//                           MASTER_ADDR (the kernel's route: a UDP socket connect() and
//                           getsockname(); no packet is sent)
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fairscale::comm {

// This host's network interfaces and their IPv4 addresses ("" when it has none), in the order
// getifaddrs lists them, each interface once.
std::vector<std::pair<std::string, std::string>> ListInterfaces();

// The (first) IPv4 address of `interface`, e.g. "10.77.0.1". kInvalidArgument naming it and
// listing the interfaces that exist when it does not exist or has no IPv4 address.
absl::StatusOr<std::string> InterfaceIpv4Address(absl::string_view interface);

// The local address the kernel would use as the source of a connection to `host` (a numeric
// address or a name, resolved; IPv4 or IPv6). kInvalidArgument when `host` does not resolve,
// kUnavailable when there is no route to it.
absl::StatusOr<std::string> SourceAddressToward(absl::string_view host);

// Whether every address `host` resolves to is a loopback address (127.0.0.0/8, ::1).
// False when it does not resolve.
bool IsLoopbackHost(absl::string_view host);

struct BindAddressInputs {
  std::string socket_ifname;  // FS_SOCKET_IFNAME; "" = unset
  std::string master_addr;    // MASTER_ADDR (or what stands for it); "" = none
  bool single_node = false;   // every rank of the job is known to run on this host
};

struct BindAddressChoice {
  std::string address;    // what to bind to and advertise
  std::string interface;  // the interface, when chosen by name (FS_SOCKET_IFNAME)
  std::string reason;     // for logs: "FS_SOCKET_IFNAME=eth0", "route to MASTER_ADDR=..."
};

// The rule in the header comment. Errors name the variable at fault.
absl::StatusOr<BindAddressChoice> ChooseBindAddress(const BindAddressInputs& inputs);

}  // namespace fairscale::comm
