// Helpers of the TCPStore tests (//comm/store:tcp_store_test_util, testonly): a server and a
// client with the tests' timeout, and a raw loopback socket for playing a hostile client.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/store/tcp_store.h"
#include "comm/store/wire.h"

namespace fairscale::comm::testing {

inline constexpr absl::Duration kStoreTestTimeout = absl::Seconds(10);

// A server on an OS-assigned port (options.is_server is set; timeout kStoreTestTimeout unless
// `options` says otherwise).
absl::StatusOr<std::unique_ptr<TCPStore>> StartTestServer(TCPStoreOptions options = {});
// A client of the server on `port` (timeout kStoreTestTimeout unless `options` says otherwise).
absl::StatusOr<std::unique_ptr<TCPStore>> ConnectTestClient(int port,
                                                            TCPStoreOptions options = {});

// A raw loopback TCP socket connected to `port`, or -1.
int RawConnect(int port);

// Reads what the server sends on `fd` until it closes the connection or `timeout` passes;
// returns whether it closed. The replies decoded on the way go to *replies when given.
bool ClosedByPeer(int fd, absl::Duration timeout, std::vector<wire::Message>* replies = nullptr);

// Sends as much of `bytes` as the peer takes (it may hang up: that can be the point).
void SendAll(int fd, absl::string_view bytes);

}  // namespace fairscale::comm::testing
