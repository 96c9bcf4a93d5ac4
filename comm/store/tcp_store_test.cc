// TCPStore beyond the Store contract (store_test.cc): several processes, a server that dies,
// hostile clients, connect deadlines and wait_for_workers.
//
// Child processes are this binary re-executed (posix_spawn of /proc/self/exe); main() runs the
// child role named by argv[1] instead of the tests.
#include "comm/store/tcp_store.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_matchers.h"
#include "base/subprocess.h"
#include "comm/store/tcp_store_test_util.h"
#include "comm/store/wire.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::comm {
namespace {

using ::fairscale::base::SpawnSelf;
using ::fairscale::base::WaitChild;
using ::fairscale::base::testing::IsOk;
using ::fairscale::base::testing::StatusIs;
using ::testing::HasSubstr;

using testing::ClosedByPeer;
using testing::RawConnect;
using testing::SendAll;

constexpr absl::Duration kTimeout = testing::kStoreTestTimeout;

absl::StatusOr<std::unique_ptr<TCPStore>> StartServer() { return testing::StartTestServer(); }

absl::StatusOr<std::unique_ptr<TCPStore>> Connect(int port, absl::Duration timeout = kTimeout) {
  TCPStoreOptions o;
  o.timeout = timeout;
  return testing::ConnectTestClient(port, o);
}

// ---- child roles ------------------------------------------------------------------------------

// "adder <port> <n>": n Adds of 1 to "counter", then Set "done/<pid>".
int ChildAdder(int port, int n) {
  auto store = Connect(port);
  if (!store.ok()) {
    std::fprintf(stderr, "adder: %s\n", store.status().ToString().c_str());
    return 2;
  }
  for (int i = 0; i < n; ++i) {
    absl::StatusOr<int64_t> r = (*store)->Add("counter", 1);
    if (!r.ok()) {
      std::fprintf(stderr, "adder: %s\n", r.status().ToString().c_str());
      return 3;
    }
  }
  return (*store)->Set(absl::StrCat("done/", getpid()), "1").ok() ? 0 : 4;
}

// "server <fd>": hosts a server, writes its port to fd, then idles until killed (30 s at most).
int ChildServer(int fd) {
  auto store = StartServer();
  if (!store.ok()) return 2;
  const std::string port = absl::StrCat((*store)->port(), "\n");
  if (write(fd, port.data(), port.size()) != static_cast<ssize_t>(port.size())) return 3;
  close(fd);
  absl::SleepFor(absl::Seconds(30));
  return 0;
}

// ---- tests ------------------------------------------------------------------------------------

TEST(TCPStore, ReportsTheOsAssignedPort) {
  ASSERT_OK_AND_ASSIGN(auto server, StartServer());
  EXPECT_GT(server->port(), 0);
  EXPECT_TRUE(server->is_server());
  EXPECT_EQ(server->host(), "127.0.0.1");
}

TEST(TCPStore, ConcurrentAddsFromSeveralProcesses) {
  ASSERT_OK_AND_ASSIGN(auto server, StartServer());
  constexpr int kChildren = 3;
  constexpr int kAdds = 200;
  std::vector<pid_t> pids;
  for (int i = 0; i < kChildren; ++i) {
    ASSERT_OK_AND_ASSIGN(pid_t pid, SpawnSelf({"adder", absl::StrCat(server->port()),
                                               absl::StrCat(kAdds)}));
    pids.push_back(pid);
  }
  for (int i = 0; i < kAdds; ++i) ASSERT_OK(server->Add("counter", 1));
  std::vector<std::string> done;
  for (pid_t pid : pids) {
    ASSERT_OK_AND_ASSIGN(int code, WaitChild(pid, absl::Seconds(20)));
    EXPECT_EQ(code, 0) << "child " << pid;
    done.push_back(absl::StrCat("done/", pid));
  }
  ASSERT_OK(server->Wait(done, absl::Seconds(1)));
  ASSERT_OK_AND_ASSIGN(std::string total, server->Get("counter", absl::Seconds(1)));
  EXPECT_EQ(total, absl::StrCat((kChildren + 1) * kAdds));
}

TEST(TCPStore, ClientOfAKilledServerGetsUnavailableNotAHang) {
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  ASSERT_OK_AND_ASSIGN(pid_t pid, SpawnSelf({"server", "3"}, /*env=*/{}, {{pipe_fds[1], 3}}));
  close(pipe_fds[1]);
  std::string port_text;
  char c;
  pollfd p{pipe_fds[0], POLLIN, 0};
  while (poll(&p, 1, 10000) == 1 && read(pipe_fds[0], &c, 1) == 1 && c != '\n') port_text += c;
  close(pipe_fds[0]);
  int port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(port_text, &port)) << "child sent '" << port_text << "'";

  ASSERT_OK_AND_ASSIGN(auto client, Connect(port));
  ASSERT_OK(client->Set("alive", "1"));
  absl::Status parked;
  std::thread waiter([&] { parked = client->Get("never", kTimeout).status(); });
  absl::SleepFor(absl::Milliseconds(50));

  const absl::Time killed = absl::Now();
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  waiter.join();
  const absl::Duration took = absl::Now() - killed;
  EXPECT_THAT(parked, StatusIs(absl::StatusCode::kUnavailable,
                               HasSubstr(absl::StrCat("127.0.0.1:", port))));
  EXPECT_LT(took, absl::Seconds(2));
  // Later calls fail at once.
  const absl::Time start = absl::Now();
  EXPECT_THAT(client->Set("k", "v"), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(client->Get("alive", kTimeout), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  ASSERT_OK_AND_ASSIGN(int code, WaitChild(pid, absl::Seconds(5)));
  EXPECT_EQ(code, 128 + SIGKILL);
}

TEST(TCPStore, DestroyingTheServerReleasesParkedClients) {
  ASSERT_OK_AND_ASSIGN(auto server, StartServer());
  ASSERT_OK_AND_ASSIGN(auto client, Connect(server->port()));
  absl::Status parked;
  std::thread waiter([&] { parked = client->Wait({"never"}, kTimeout); });
  absl::SleepFor(absl::Milliseconds(50));
  const absl::Time start = absl::Now();
  server.reset();
  waiter.join();
  EXPECT_THAT(parked, StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

TEST(TCPStore, HostileClientsAreDroppedAndOthersUnaffected) {
  ASSERT_OK_AND_ASSIGN(auto server, StartServer());
  ASSERT_OK_AND_ASSIGN(auto good, Connect(server->port()));
  ASSERT_OK(good->Set("before", "1"));
  // A parked request of the good client must survive the hostile ones.
  absl::StatusOr<std::string> parked;
  std::thread waiter([&] { parked = good->Get("after", kTimeout); });

  // Plain garbage.
  int fd = RawConnect(server->port());
  ASSERT_GE(fd, 0);
  SendAll(fd, "GET / HTTP/1.1\r\nHost: store\r\n\r\n");
  EXPECT_TRUE(ClosedByPeer(fd, absl::Seconds(5)));
  close(fd);

  // A valid header announcing a 2^60-byte value: dropped before any body byte arrives.
  fd = RawConnect(server->port());
  ASSERT_GE(fd, 0);
  std::string header(wire::kWireMagic, 4);
  header += std::string("\x01\x01\0\0", 4);      // version 1, set, reserved
  header += std::string("\x07\0\0\0", 4);        // request id
  header += std::string("\x01\0\0\0", 4);        // key_len 1
  header += std::string("\0\0\0\0\0\0\0\x10", 8);  // value_len 2^60
  SendAll(fd, header);
  EXPECT_TRUE(ClosedByPeer(fd, absl::Seconds(5)));
  close(fd);

  // A client that vanishes in the middle of a frame, and one that sends a reply frame.
  fd = RawConnect(server->port());
  ASSERT_GE(fd, 0);
  std::string frame;
  ASSERT_OK(wire::EncodeSet(1, "half", std::string(1000, 'x'), &frame));
  SendAll(fd, absl::string_view(frame).substr(0, 500));
  close(fd);
  fd = RawConnect(server->port());
  ASSERT_GE(fd, 0);
  frame.clear();
  wire::EncodeOk(1, &frame);
  SendAll(fd, frame);
  EXPECT_TRUE(ClosedByPeer(fd, absl::Seconds(5)));
  close(fd);

  // The server still serves, old and new clients alike.
  ASSERT_OK_AND_ASSIGN(auto late, Connect(server->port()));
  ASSERT_OK(late->Set("after", "still here"));
  waiter.join();
  ASSERT_OK(parked);
  EXPECT_EQ(*parked, "still here");
  ASSERT_OK_AND_ASSIGN(bool half, good->Check("half"));
  EXPECT_FALSE(half);
}

TEST(TCPStore, ConnectGivesUpAtTheDeadlineNamingHostAndPort) {
  // A port nobody listens on: bind one, note it, close it.
  int port = 0;
  {
    ASSERT_OK_AND_ASSIGN(auto server, StartServer());
    port = server->port();
  }
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<TCPStore>> client = Connect(port, absl::Milliseconds(300));
  const absl::Duration took = absl::Now() - start;
  EXPECT_THAT(client.status(),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr(absl::StrCat("127.0.0.1:", port))));
  EXPECT_GE(took, absl::Milliseconds(250));
  EXPECT_LT(took, absl::Seconds(2));
}

// A client started without its server (a rank alone) says what it waits for after 5 s.
TEST(TCPStore, AClientWaitingForItsServerSaysSo) {
  int port = 0;
  {
    ASSERT_OK_AND_ASSIGN(auto server, StartServer());
    port = server->port();
  }
  ::testing::internal::CaptureStderr();
  absl::StatusOr<std::unique_ptr<TCPStore>> client = Connect(port, absl::Seconds(6));
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(client.status(), StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(log, HasSubstr(absl::StrCat("TCPStore: no server at 127.0.0.1:", port,
                                          " yet (Connection refused); it is hosted by the "
                                          "launcher or rank 0")));
  EXPECT_THAT(log, HasSubstr("giving up after 6s"));
}

TEST(TCPStore, ConnectRetriesUntilTheServerComesUp) {
  // Reserve a port number, release it, and start the server there a little later.
  int port = 0;
  {
    ASSERT_OK_AND_ASSIGN(auto probe, StartServer());
    port = probe->port();
  }
  std::unique_ptr<TCPStore> server;
  std::thread starter([&] {
    absl::SleepFor(absl::Milliseconds(200));
    TCPStoreOptions o;
    o.is_server = true;
    o.port = port;
    o.timeout = kTimeout;
    auto s = TCPStore::Create(o);
    ASSERT_OK(s);
    server = std::move(*s);
  });
  absl::StatusOr<std::unique_ptr<TCPStore>> client = Connect(port, absl::Seconds(5));
  starter.join();
  ASSERT_OK(client);
  ASSERT_OK((*client)->Set("k", "v"));
  client->reset();
}

TEST(TCPStore, WaitForWorkers) {
  TCPStoreOptions o;
  o.is_server = true;
  o.timeout = kTimeout;
  o.num_workers = 3;
  o.wait_for_workers = true;
  // Pick the port first so the workers know where to go.
  int port = 0;
  {
    ASSERT_OK_AND_ASSIGN(auto probe, StartServer());
    port = probe->port();
  }
  o.port = port;
  absl::StatusOr<std::unique_ptr<TCPStore>> server;
  std::thread host([&] { server = TCPStore::Create(o); });
  std::vector<std::unique_ptr<TCPStore>> workers;
  for (int i = 0; i < 2; ++i) {
    TCPStoreOptions w;
    w.port = port;
    w.timeout = kTimeout;
    w.num_workers = 3;
    ASSERT_OK_AND_ASSIGN(auto worker, TCPStore::Create(w));
    workers.push_back(std::move(worker));
  }
  host.join();
  ASSERT_OK(server);
  workers.clear();
}

TEST(TCPStore, WaitForWorkersTimesOutCountingThem) {
  TCPStoreOptions o;
  o.is_server = true;
  o.timeout = absl::Milliseconds(200);
  o.num_workers = 2;
  o.wait_for_workers = true;
  EXPECT_THAT(TCPStore::Create(o).status(),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("only 1 of 2 workers")));
}

TEST(TCPStore, BadOptionsAreInvalidArgument) {
  TCPStoreOptions o;
  o.port = 0;  // A client needs the port.
  EXPECT_THAT(TCPStore::Create(o).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  o.port = 70000;
  EXPECT_THAT(TCPStore::Create(o).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  o.port = 1234;
  o.timeout = absl::ZeroDuration();
  EXPECT_THAT(TCPStore::Create(o).status(), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(TCPStore, ManyThreadsShareOneClient) {
  ASSERT_OK_AND_ASSIGN(auto server, StartServer());
  ASSERT_OK_AND_ASSIGN(auto client, Connect(server->port()));
  constexpr int kThreads = 8;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Each thread waits for the key its neighbour sets, so the requests interleave.
      ASSERT_OK(client->Set(absl::StrCat("t", t), absl::StrCat(t)));
      absl::StatusOr<std::string> v =
          client->Get(absl::StrCat("t", (t + 1) % kThreads), kTimeout);
      ASSERT_OK(v);
      EXPECT_EQ(*v, absl::StrCat((t + 1) % kThreads));
      for (int i = 0; i < 50; ++i) ASSERT_OK(client->Add("sum", 1));
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_OK_AND_ASSIGN(std::string sum, server->Get("sum", kTimeout));
  EXPECT_EQ(sum, absl::StrCat(kThreads * 50));
}

// ---- job token -----------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<TCPStore>> StartServerWithToken(const std::string& token) {
  TCPStoreOptions o;
  o.is_server = true;
  o.timeout = kTimeout;
  o.token = token;
  return TCPStore::Create(o);
}

absl::StatusOr<std::unique_ptr<TCPStore>> ConnectWithToken(int port, const std::string& token,
                                                           absl::Duration timeout) {
  TCPStoreOptions o;
  o.port = port;
  o.timeout = timeout;
  o.token = token;
  return TCPStore::Create(o);
}

TEST(TCPStoreToken, TheRightTokenIsAdmitted) {
  ASSERT_OK_AND_ASSIGN(auto server, StartServerWithToken("0123456789abcdef"));
  ASSERT_OK_AND_ASSIGN(auto client,
                       ConnectWithToken(server->port(), "0123456789abcdef", kTimeout));
  ASSERT_OK(client->Set("k", "v"));
  ASSERT_OK_AND_ASSIGN(std::string v, server->Get("k", kTimeout));
  EXPECT_EQ(v, "v");
}

// A wrong or missing token is an immediate kUnauthenticated, not a connect retried until the
// deadline: the client's timeout is far beyond the bound checked here.
TEST(TCPStoreToken, AWrongOrMissingTokenFailsFastWithAClearError) {
  ASSERT_OK_AND_ASSIGN(auto server, StartServerWithToken("0123456789abcdef"));
  const std::string expected = absl::StrCat("TCPStore 127.0.0.1:", server->port(),
                                            " rejected this client: wrong or missing job token "
                                            "(FS_STORE_TOKEN)");
  for (const std::string token : {"0123456789abcdeX", "", "0123456789abcdef0"}) {
    const absl::Time start = absl::Now();
    EXPECT_THAT(ConnectWithToken(server->port(), token, absl::Minutes(10)).status(),
                StatusIs(absl::StatusCode::kUnauthenticated, expected))
        << "token '" << token << "'";
    EXPECT_LT(absl::Now() - start, absl::Minutes(5)) << "token '" << token << "'";
  }
  // The server keeps serving its own client and admits the right token afterwards.
  ASSERT_OK(server->Set("still", "up"));
  ASSERT_OK_AND_ASSIGN(auto good, ConnectWithToken(server->port(), "0123456789abcdef", kTimeout));
  ASSERT_OK_AND_ASSIGN(std::string v, good->Get("still", kTimeout));
  EXPECT_EQ(v, "up");
}

// A raw client that skips the hello gets an unauthenticated error reply, then the connection
// closes; its request is not applied.
TEST(TCPStoreToken, ARequestWithoutHelloIsRejectedAndNotApplied) {
  ASSERT_OK_AND_ASSIGN(auto server, StartServerWithToken("secret"));
  const int fd = RawConnect(server->port());
  ASSERT_GE(fd, 0);
  std::string frame;
  ASSERT_OK(wire::EncodeSet(5, "intruder", "x", &frame));
  SendAll(fd, frame);
  wire::Decoder decoder(wire::Decoder::Direction::kReplies);
  std::vector<wire::Message> replies;
  char buf[4096];
  bool closed = false;
  const absl::Time deadline = absl::Now() + kTimeout;
  while (!closed && absl::Now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) {
      closed = true;
    } else {
      ASSERT_OK(decoder.Feed(absl::string_view(buf, n), &replies));
    }
  }
  close(fd);
  EXPECT_TRUE(closed);
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].request_id, 5u);
  EXPECT_THAT(wire::ErrorStatus(replies[0]),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("FS_STORE_TOKEN")));
  ASSERT_OK_AND_ASSIGN(bool present, server->Check("intruder"));
  EXPECT_FALSE(present);
}

TEST(TCPStoreToken, AServerWithoutATokenAdmitsEveryone) {
  ASSERT_OK_AND_ASSIGN(auto server, StartServer());
  ASSERT_OK_AND_ASSIGN(auto with, ConnectWithToken(server->port(), "anything", kTimeout));
  ASSERT_OK_AND_ASSIGN(auto without, ConnectWithToken(server->port(), "", kTimeout));
  ASSERT_OK(with->Set("a", "1"));
  ASSERT_OK_AND_ASSIGN(std::string v, without->Get("a", kTimeout));
  EXPECT_EQ(v, "1");
}

}  // namespace
}  // namespace fairscale::comm

int main(int argc, char** argv) {
  if (argc >= 2) {
    const std::string role = argv[1];
    int a = 0;
    int b = 0;
    if (role == "adder" && argc == 4 && absl::SimpleAtoi(argv[2], &a) &&
        absl::SimpleAtoi(argv[3], &b)) {
      return fairscale::comm::ChildAdder(a, b);
    }
    if (role == "server" && argc == 3 && absl::SimpleAtoi(argv[2], &a)) {
      return fairscale::comm::ChildServer(a);
    }
  }
  ::testing::InitGoogleMock(&argc, argv);
  return RUN_ALL_TESTS();
}
