// C10dStoreClient (//comm/torch:c10d_store): our Store interface over a client of PyTorch's
// c10d TCPStore, the rendezvous store torchrun's agent hosts (TORCHELASTIC_USE_AGENT_STORE=True).
// Linking the target registers it as the "c10d" store client (comm/registry.h), which
// CreateCommunicatorFromEnv uses under torchrun; //comm itself stays free of LibTorch.
//
// Behaviour, measured against LibTorch 1.13's client (see c10d_store_test.cc):
// * c10d's client has no per-request deadline: a request waits for its reply as long as its
//   socket's receive timeout, which only TCPStore::wait() sets. So Create checks that the
//   server answers (an empty wait, one round trip, within options.timeout) and every request
//   runs with a socket timeout: Get/Wait their own, the others options.timeout. A server that
//   accepts and never replies gives kDeadlineExceeded naming host:port, never a hang.
// * After a timed-out request the connection's replies are out of step with its requests (c10d
//   would read the late reply as the next one's), so the next call reconnects.
// * Calls are serialized (one connection); a Get parked on the server delays other threads'
//   calls on this store until it returns.
// * Exceptions (c10::Error, c10d::TimeoutError, std::exception) become absl::Status naming the
//   operation, host:port and c10d's message: kDeadlineExceeded for timeouts, kUnavailable
//   otherwise.
// * Differences from our TCPStore kept by c10d's server: Add on a key holding something that
//   is not an integer makes torchrun's server throw (our store: kInvalidArgument), so use Add
//   only on counters.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "comm/registry.h"
#include "comm/store/store.h"

namespace fairscale::comm {

// Connects to the c10d TCPStore at options.host:port (a host name or an address), retrying until
// options.timeout. kDeadlineExceeded / kUnavailable name host:port.
absl::StatusOr<std::unique_ptr<Store>> CreateC10dStoreClient(const StoreClientOptions& options);

}  // namespace fairscale::comm
