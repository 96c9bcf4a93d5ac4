// The c10d store client against LibTorch's own TCPStore server (what torchrun's agent runs),
// and against fake servers that accept and never answer: every call is bounded by its timeout.
#include "comm/torch/c10d_store.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/status_matchers.h"
#include "comm/registry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::comm {
namespace {

using ::fairscale::base::testing::IsOk;
using ::fairscale::base::testing::StatusIs;
using ::testing::AllOf;
using ::testing::Contains;
using ::testing::HasSubstr;

// LibTorch's server on a free loopback port.
std::unique_ptr<c10d::TCPStore> StartServer() {
  c10d::TCPStoreOptions o;
  o.port = 0;
  o.isServer = true;
  o.waitWorkers = false;
  o.timeout = std::chrono::seconds(10);
  return std::make_unique<c10d::TCPStore>("127.0.0.1", o);
}

StoreClientOptions ClientOptions(int port, absl::Duration timeout = absl::Seconds(10)) {
  StoreClientOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  o.timeout = timeout;
  return o;
}

// A listening socket on a free loopback port that accepts connections (when `accept`) and
// never writes a byte.
class SilentServer {
 public:
  explicit SilentServer(bool accept) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    listen(fd_, 16);
    socklen_t len = sizeof(a);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    if (accept) {
      thread_ = std::thread([this] {
        while (!stop_) {
          const int c = ::accept(fd_, nullptr, nullptr);
          if (c < 0) break;
          accepted_.push_back(c);
        }
      });
    }
  }
  ~SilentServer() {
    stop_ = true;
    shutdown(fd_, SHUT_RDWR);
    close(fd_);
    if (thread_.joinable()) thread_.join();
    for (int c : accepted_) close(c);
  }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::vector<int> accepted_;
  std::thread thread_;
};

TEST(C10dStore, Registered) { EXPECT_THAT(LinkedStoreClients(), Contains("c10d")); }

TEST(C10dStore, StoreContract) {
  std::unique_ptr<c10d::TCPStore> server = StartServer();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Store> a,
                       CreateStoreClient("c10d", ClientOptions(server->getPort())));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Store> b,
                       CreateStoreClient("c10d", ClientOptions(server->getPort())));
  ASSERT_THAT(a->Set("k", std::string("v\0w", 3)), IsOk());
  EXPECT_EQ(*b->Get("k", absl::Seconds(5)), std::string("v\0w", 3));
  EXPECT_EQ(*b->Get("k", absl::ZeroDuration()), std::string("v\0w", 3));  // present: no wait
  // Set by the server's own client (as the agent would) is visible to ours.
  server->set("from_agent", {'x'});
  EXPECT_EQ(*a->Get("from_agent", absl::Seconds(5)), "x");
  EXPECT_EQ(*a->Add("n", 2), 2);
  EXPECT_EQ(*b->Add("n", -5), -3);
  EXPECT_EQ(*a->CompareSet("c", "", "first"), "first");
  EXPECT_EQ(*b->CompareSet("c", "wrong", "second"), "first");
  EXPECT_EQ(*b->CompareSet("c", "first", "second"), "second");
  EXPECT_EQ(*a->CompareSet("missing", "x", "y"), "");  // missing key, expected "x": no swap
  EXPECT_FALSE(*a->Check("missing"));
  EXPECT_TRUE(*a->Check("c"));
  EXPECT_TRUE(*a->Delete("c"));
  EXPECT_FALSE(*a->Delete("c"));
  EXPECT_FALSE(*a->Check("c"));

  // A Get parked until another client sets the key.
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(200));
    ASSERT_THAT(b->Set("late", "1"), IsOk());
  });
  EXPECT_EQ(*a->Get("late", absl::Seconds(10)), "1");
  setter.join();
  EXPECT_THAT(a->Wait({"late", "k"}, absl::Seconds(5)), IsOk());
}

TEST(C10dStore, MissingKeyTimesOutThenTheClientRecovers) {
  std::unique_ptr<c10d::TCPStore> server = StartServer();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Store> a,
                       CreateStoreClient("c10d", ClientOptions(server->getPort())));
  const absl::Time start = absl::Now();
  EXPECT_THAT(a->Get("never", absl::Milliseconds(300)).status(),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       AllOf(HasSubstr("c10d TCPStore 127.0.0.1:"), HasSubstr("get 'never'"))));
  EXPECT_THAT(a->Wait({"never", "nor"}, absl::Milliseconds(300)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("wait 'never, nor'")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // The late reply of the timed-out wait must not be read as the next request's.
  server->set("never", {'1'});
  ASSERT_THAT(a->Set("k", "v"), IsOk());
  EXPECT_EQ(*a->Add("counter", 7), 7);
  EXPECT_EQ(*a->Get("k", absl::Seconds(5)), "v");
}

// A server that accepts and never replies: Create fails within its timeout naming host:port.
TEST(C10dStore, ServerThatNeverAnswers) {
  for (bool accept : {true, false}) {
    SilentServer silent(accept);
    const absl::Time start = absl::Now();
    absl::StatusOr<std::unique_ptr<Store>> client =
        CreateStoreClient("c10d", ClientOptions(silent.port(), absl::Seconds(1)));
    const absl::Duration took = absl::Now() - start;
    EXPECT_THAT(client.status(),
                StatusIs(absl::StatusCode::kDeadlineExceeded,
                         AllOf(HasSubstr(absl::StrCat("127.0.0.1:", silent.port())),
                               HasSubstr("no answer within 1s"))))
        << "accept=" << accept;
    EXPECT_LT(took, absl::Seconds(8)) << "accept=" << accept;
    std::printf("silent server (accept=%d): failed after %s: %s\n", accept,
                absl::FormatDuration(took).c_str(), client.status().ToString().c_str());
  }
}

// Nothing listens: the connect retries until the timeout, then names host:port.
TEST(C10dStore, NoServer) {
  int port = 0;
  {
    SilentServer probe(false);
    port = probe.port();
  }
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<Store>> client =
      CreateStoreClient("c10d", ClientOptions(port, absl::Seconds(2)));
  const absl::Duration took = absl::Now() - start;
  EXPECT_THAT(client.status(), StatusIs(absl::StatusCode::kDeadlineExceeded,
                                        HasSubstr(absl::StrCat("127.0.0.1:", port))));
  EXPECT_LT(took, absl::Seconds(10));
  std::printf("no server: failed after %s: %s\n", absl::FormatDuration(took).c_str(),
              client.status().ToString().c_str());
}

}  // namespace
}  // namespace fairscale::comm
