// TCPStore's server against unauthenticated, oversized, half-open and descriptor-starving
// clients (TCPStoreServerLimits), and the flood measurement of issue 19: 1000 unauthenticated
// connections against a server in a child process, its RSS growth and a legitimate client's
// latency meanwhile (printed; run with --test_output=all to see the numbers).
//
// Child processes are this binary re-executed (posix_spawn of /proc/self/exe); main() runs the
// child role named by argv[1] instead of the tests.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "base/status_matchers.h"
#include "base/subprocess.h"
#include "comm/store/tcp_store.h"
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
constexpr char kToken[] = "0123456789abcdef0123456789abcdef";

absl::StatusOr<std::unique_ptr<TCPStore>> StartServer(const TCPStoreServerLimits& limits,
                                                      const std::string& token = kToken) {
  TCPStoreOptions o;
  o.token = token;
  o.server_limits = limits;
  return testing::StartTestServer(o);
}

absl::StatusOr<std::unique_ptr<TCPStore>> Connect(int port, const std::string& token = kToken) {
  TCPStoreOptions o;
  o.token = token;
  return testing::ConnectTestClient(port, o);
}

std::string Hello(const std::string& token = kToken) {
  std::string frame;
  EXPECT_OK(wire::EncodeHello(1, token, &frame));
  return frame;
}

// A request header announcing a Set of `value_len` bytes (key "k"), without the body.
std::string SetHeader(uint32_t id, uint64_t value_len) {
  std::string frame;
  EXPECT_OK(wire::EncodeSet(id, "k", "", &frame));
  frame.resize(wire::kHeaderBytes);
  for (int i = 0; i < 8; ++i) frame[16 + i] = static_cast<char>(value_len >> (8 * i));
  return frame + "k";
}

// Field `name` ("VmRSS") of /proc/<pid>/status in KiB, or -1.
int64_t ProcStatusKb(pid_t pid, absl::string_view name) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (!absl::StartsWith(line, absl::StrCat(name, ":"))) continue;
    std::vector<std::string> parts = absl::StrSplit(line, ' ', absl::SkipEmpty());
    int64_t kb = -1;
    if (parts.size() >= 2 && absl::SimpleAtoi(parts[1], &kb)) return kb;
  }
  return -1;
}

// CPU time (user + system) of `pid` so far, from /proc/<pid>/stat.
absl::Duration CpuTime(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
  const size_t close_paren = stat.rfind(')');
  if (close_paren == std::string::npos) return absl::ZeroDuration();
  std::vector<std::string> f = absl::StrSplit(stat.substr(close_paren + 2), ' ');
  int64_t utime = 0;
  int64_t stime = 0;
  if (f.size() < 13 || !absl::SimpleAtoi(f[11], &utime) || !absl::SimpleAtoi(f[12], &stime)) {
    return absl::ZeroDuration();
  }
  return absl::Seconds(static_cast<double>(utime + stime) / sysconf(_SC_CLK_TCK));
}

// Starts this binary as `role ...` with fd 3 = the write end of a pipe (and fd 2 = `stderr_fd`
// when >= 0), reads the port the child writes there.
absl::StatusOr<std::pair<pid_t, int>> SpawnServerChild(std::vector<std::string> args,
                                                       int stderr_fd = -1) {
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) return absl::InternalError("pipe");
  // Applied in order: stderr first, in case `stderr_fd` is 3.
  std::vector<std::pair<int, int>> fds;
  if (stderr_fd >= 0) fds.push_back({stderr_fd, 2});
  fds.push_back({pipe_fds[1], 3});
  absl::StatusOr<pid_t> pid = SpawnSelf(args, /*env=*/{}, fds);
  close(pipe_fds[1]);
  if (!pid.ok()) {
    close(pipe_fds[0]);
    return pid.status();
  }
  std::string port_text;
  char c;
  pollfd p{pipe_fds[0], POLLIN, 0};
  while (poll(&p, 1, 10000) == 1 && read(pipe_fds[0], &c, 1) == 1 && c != '\n') port_text += c;
  close(pipe_fds[0]);
  int port = 0;
  if (!absl::SimpleAtoi(port_text, &port)) {
    kill(*pid, SIGKILL);
    (void)WaitChild(*pid, absl::Seconds(5));
    return absl::InternalError(absl::StrCat("child sent '", port_text, "'"));
  }
  return std::make_pair(*pid, port);
}

// ---- child roles ------------------------------------------------------------------------------

// "token_server <max_unauthenticated>": a server with kToken; writes its port to fd 3, then
// idles until killed (60 s at most).
int ChildTokenServer(int max_unauthenticated) {
  TCPStoreServerLimits limits;
  limits.max_unauthenticated_connections = max_unauthenticated;
  auto store = StartServer(limits);
  if (!store.ok()) return 2;
  const std::string port = absl::StrCat((*store)->port(), "\n");
  if (write(3, port.data(), port.size()) != static_cast<ssize_t>(port.size())) return 3;
  close(3);
  absl::SleepFor(absl::Seconds(60));
  return 0;
}

// "fd_limited_server": a server without a token whose process may open only 3 more
// descriptors; writes its port to fd 3, then idles until killed (60 s at most).
int ChildFdLimitedServer() {
  auto store = StartServer(TCPStoreServerLimits(), /*token=*/"");
  if (!store.ok()) return 2;
  const std::string port = absl::StrCat((*store)->port(), "\n");
  // Lower the limit just past the highest descriptor open now, fill every free number below
  // it, then free 3: exactly 3 are left for accepted connections.
  int highest = 0;
  for (int fd = 0; fd < 4096; ++fd) {
    if (fcntl(fd, F_GETFD) != -1) highest = fd;
  }
  rlimit lim;
  getrlimit(RLIMIT_NOFILE, &lim);
  lim.rlim_cur = highest + 1 + 3;
  if (setrlimit(RLIMIT_NOFILE, &lim) != 0) return 4;
  std::vector<int> fillers;
  for (int fd; (fd = open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;) fillers.push_back(fd);
  if (errno != EMFILE || fillers.size() < 3) return 5;
  for (int i = 0; i < 3; ++i) {
    close(fillers.back());
    fillers.pop_back();
  }
  if (write(3, port.data(), port.size()) != static_cast<ssize_t>(port.size())) return 3;
  absl::SleepFor(absl::Seconds(60));
  return 0;
}

// ---- handshake --------------------------------------------------------------------------------

TEST(TCPStoreLimits, AClientThatNeverSendsAHelloIsClosedAtTheHandshakeDeadline) {
  TCPStoreServerLimits limits;
  limits.handshake_timeout = absl::Milliseconds(300);
  ASSERT_OK_AND_ASSIGN(auto server, StartServer(limits));
  const absl::Time start = absl::Now();
  const int silent = RawConnect(server->port());
  ASSERT_GE(silent, 0);
  // One that sends half a hello and stops is no better off.
  const int half = RawConnect(server->port());
  ASSERT_GE(half, 0);
  SendAll(half, Hello().substr(0, 30));
  EXPECT_TRUE(ClosedByPeer(silent, absl::Seconds(5)));
  EXPECT_TRUE(ClosedByPeer(half, absl::Seconds(5)));
  const absl::Duration took = absl::Now() - start;
  EXPECT_GE(took, absl::Milliseconds(290));
  EXPECT_LT(took, absl::Seconds(3));
  close(silent);
  close(half);
  // A client that says hello at once is unaffected, however long it then stays idle.
  ASSERT_OK_AND_ASSIGN(auto client, Connect(server->port()));
  absl::SleepFor(absl::Milliseconds(600));
  ASSERT_OK(client->Set("k", "v"));
}

// The header of a 60 MiB Set from a client without the token closes the connection at once,
// answered with kUnauthenticated under the request's id; the body is never buffered. The server
// runs in a child process so that its RSS is its own.
TEST(TCPStoreLimits, AHugeSetBeforeTheHelloIsDroppedAtTheHeader) {
  ASSERT_OK_AND_ASSIGN(auto child, SpawnServerChild({"token_server", "128"}));
  const auto [pid, port] = child;
  const int64_t rss_before = ProcStatusKb(pid, "VmRSS");
  for (int i = 0; i < 8; ++i) {
    const int fd = RawConnect(port);
    ASSERT_GE(fd, 0);
    SendAll(fd, SetHeader(40 + i, 60 << 20));
    std::vector<wire::Message> replies;
    // Then as much of the body as the server takes before it hangs up.
    std::thread sender([fd] { SendAll(fd, std::string(8 << 20, 'x')); });
    EXPECT_TRUE(ClosedByPeer(fd, absl::Seconds(5), &replies));
    sender.join();
    close(fd);
    ASSERT_EQ(replies.size(), 1u);
    EXPECT_EQ(replies[0].request_id, 40u + i);
    EXPECT_THAT(wire::ErrorStatus(replies[0]),
                StatusIs(absl::StatusCode::kUnauthenticated,
                         HasSubstr("wrong or missing job token (FS_STORE_TOKEN): store wire: "
                                   "malformed frame at stream offset 0: set before the hello")));
  }
  const int64_t rss_after = ProcStatusKb(pid, "VmRSS");
  std::printf("huge Set before hello x8: server VmRSS %lld -> %lld KiB\n",
              static_cast<long long>(rss_before), static_cast<long long>(rss_after));
  EXPECT_LT(rss_after - rss_before, 4 << 10) << "KiB";
  // It still serves.
  ASSERT_OK_AND_ASSIGN(auto client, Connect(port));
  ASSERT_OK(client->Set("k", "v"));
  client.reset();
  kill(pid, SIGKILL);
  (void)WaitChild(pid, absl::Seconds(5));
}

// Beyond max_unauthenticated_connections, the oldest connection still without a hello is
// closed; a legitimate client still gets in.
TEST(TCPStoreLimits, UnauthenticatedConnectionsAreCapped) {
  TCPStoreServerLimits limits;
  limits.max_unauthenticated_connections = 4;
  ASSERT_OK_AND_ASSIGN(auto server, StartServer(limits));
  std::vector<int> fds;
  for (int i = 0; i < 6; ++i) {
    fds.push_back(RawConnect(server->port()));
    ASSERT_GE(fds.back(), 0);
    absl::SleepFor(absl::Milliseconds(20));  // Accepted in this order.
  }
  EXPECT_TRUE(ClosedByPeer(fds[0], absl::Seconds(3)));
  EXPECT_TRUE(ClosedByPeer(fds[1], absl::Seconds(3)));
  for (int i = 2; i < 6; ++i) {
    EXPECT_FALSE(ClosedByPeer(fds[i], absl::Milliseconds(100))) << "connection " << i;
  }
  // A client with the token connects (evicting the oldest waiting one) and is served.
  ASSERT_OK_AND_ASSIGN(auto client, Connect(server->port()));
  ASSERT_OK(client->Set("k", "v"));
  EXPECT_TRUE(ClosedByPeer(fds[2], absl::Seconds(3)));
  for (int fd : fds) close(fd);
}

// A server that closes a connection before answering its hello (as an overloaded one evicting
// the oldest unauthenticated connections does) does not fail the client: it reconnects. Here a
// fake server hangs up on the first connection and answers the hello of the second.
TEST(TCPStoreLimits, AClientClosedBeforeItsHelloIsAnsweredReconnects) {
  const int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(listener, 8), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const int port = ntohs(addr.sin_port);
  int connections = 0;
  std::string token_seen;
  std::thread fake([&] {
    for (; connections < 2; ++connections) {
      pollfd p{listener, POLLIN, 0};
      if (poll(&p, 1, 10000) != 1) return;
      const int fd = accept(listener, nullptr, nullptr);
      if (fd < 0) return;
      if (connections == 0) {
        close(fd);
        continue;
      }
      wire::Decoder decoder(wire::Decoder::Direction::kRequests);
      std::vector<wire::Message> requests;
      char buf[4096];
      while (requests.empty()) {
        pollfd q{fd, POLLIN, 0};
        if (poll(&q, 1, 10000) != 1) break;
        const ssize_t n = recv(fd, buf, sizeof(buf), 0);
        if (n <= 0 || !decoder.Feed(absl::string_view(buf, n), &requests).ok()) break;
      }
      if (requests.size() == 1 && requests[0].command == wire::WireCommand::kHello) {
        token_seen = requests[0].value;
        std::string ok;
        wire::EncodeOk(requests[0].request_id, &ok);
        SendAll(fd, ok);
      }
      // Held open until the client goes.
      pollfd q{fd, POLLIN, 0};
      (void)poll(&q, 1, 10000);
      close(fd);
    }
  });
  {
    ASSERT_OK_AND_ASSIGN(auto client, Connect(port));
  }
  fake.join();
  close(listener);
  EXPECT_EQ(connections, 2);
  EXPECT_EQ(token_seen, kToken);
}

// ---- stalls -----------------------------------------------------------------------------------

// An admitted client that sends half a frame and waits is closed after read_timeout; a client
// idle in a blocking Get all that time is not.
TEST(TCPStoreLimits, AHalfOpenFrameIsClosedButAnIdleClientIsNot) {
  TCPStoreServerLimits limits;
  limits.read_timeout = absl::Milliseconds(300);
  ASSERT_OK_AND_ASSIGN(auto server, StartServer(limits));
  ASSERT_OK_AND_ASSIGN(auto idle, Connect(server->port()));
  absl::StatusOr<std::string> parked;
  std::thread waiter([&] { parked = idle->Get("late", kTimeout); });

  const int fd = RawConnect(server->port());
  ASSERT_GE(fd, 0);
  SendAll(fd, Hello());
  std::string frame;
  ASSERT_OK(wire::EncodeSet(2, "half", std::string(1000, 'x'), &frame));
  const absl::Time start = absl::Now();  // Before the server can have read the half frame.
  SendAll(fd, frame.substr(0, 500));
  std::vector<wire::Message> replies;
  EXPECT_TRUE(ClosedByPeer(fd, absl::Seconds(5), &replies));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(290));
  close(fd);
  ASSERT_EQ(replies.size(), 1u);  // The hello's OK, nothing for the half frame.
  EXPECT_EQ(replies[0].command, wire::WireCommand::kOk);

  absl::SleepFor(absl::Milliseconds(400));  // The waiter is now idle well past read_timeout.
  ASSERT_OK(server->Set("late", "here"));
  waiter.join();
  ASSERT_OK(parked);
  EXPECT_EQ(*parked, "here");
  ASSERT_OK(idle->Set("again", "1"));
  ASSERT_OK_AND_ASSIGN(bool half, server->Check("half"));
  EXPECT_FALSE(half);
}

// ---- size bounds ------------------------------------------------------------------------------

TEST(TCPStoreLimits, ARequestOverMaxRequestBytesGetsResourceExhausted) {
  TCPStoreServerLimits limits;
  limits.max_request_bytes = 1 << 20;
  ASSERT_OK_AND_ASSIGN(auto server, StartServer(limits));
  ASSERT_OK_AND_ASSIGN(auto client, Connect(server->port()));
  ASSERT_OK(client->Set("small", std::string(1000, 'x')));
  EXPECT_THAT(client->Set("big", std::string(2 << 20, 'x')),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr(absl::StrCat("a request of ", 24 + 3 + (2 << 20),
                                              " bytes exceeds the server's limit of 1048576 "
                                              "(TCPStoreServerLimits::max_request_bytes)"))));
  // The server serves everyone else.
  ASSERT_OK_AND_ASSIGN(std::string v, server->Get("small", kTimeout));
  EXPECT_EQ(v.size(), 1000u);
}

TEST(TCPStoreLimits, PartlyReceivedRequestsAreBoundedInTotal) {
  TCPStoreServerLimits limits;
  limits.max_request_bytes = 2 << 20;
  limits.max_buffered_bytes = 3 << 20;
  ASSERT_OK_AND_ASSIGN(auto server, StartServer(limits));
  const uint64_t value_bytes = (3 << 20) / 2;  // Two of these do not fit together.
  const std::string header = SetHeader(7, value_bytes);
  const int first = RawConnect(server->port());
  ASSERT_GE(first, 0);
  SendAll(first, Hello() + header + "abc");
  absl::SleepFor(absl::Milliseconds(200));
  const int second = RawConnect(server->port());
  ASSERT_GE(second, 0);
  SendAll(second, Hello() + header + "abc");
  std::vector<wire::Message> replies;
  EXPECT_TRUE(ClosedByPeer(second, absl::Seconds(5), &replies));
  close(second);
  ASSERT_EQ(replies.size(), 2u);
  EXPECT_THAT(wire::ErrorStatus(replies[1]),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr(absl::StrCat("a request of ", 24 + 1 + value_bytes,
                                              " bytes does not fit: requests being received "
                                              "already hold ", 24 + 1 + value_bytes, " of the "
                                              "server's 3145728 bytes "
                                              "(TCPStoreServerLimits::max_buffered_bytes)"))));
  EXPECT_EQ(replies[1].request_id, 7u);
  // The first completes its request.
  SendAll(first, std::string(value_bytes - 3, 'y'));
  ASSERT_OK_AND_ASSIGN(std::string v, server->Get("k", kTimeout));
  EXPECT_EQ(v.size(), value_bytes);
  close(first);
}

TEST(TCPStoreLimits, BadLimitsAreInvalidArgument) {
  TCPStoreServerLimits limits;
  limits.max_unauthenticated_connections = 0;
  EXPECT_THAT(StartServer(limits).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("max_unauthenticated_connections 0 (must be >= 1)")));
  limits = TCPStoreServerLimits();
  limits.read_timeout = absl::ZeroDuration();
  EXPECT_THAT(StartServer(limits).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("read_timeout 0")));
  limits = TCPStoreServerLimits();
  limits.max_buffered_bytes = limits.max_request_bytes - 1;
  EXPECT_THAT(StartServer(limits).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("at most max_buffered_bytes")));
}

// ---- descriptors ------------------------------------------------------------------------------

// With the process out of descriptors, accept() fails with EMFILE while connections wait in the
// backlog. The server must not spin on it (CPU time) nor log a line per attempt, and must serve
// new clients once descriptors are free again.
TEST(TCPStoreLimits, AcceptAtTheDescriptorLimitBacksOffAndRecovers) {
  char log_path[] = "/tmp/tcp_store_limits_stderr_XXXXXX";
  const int log_fd = mkstemp(log_path);
  ASSERT_GE(log_fd, 0);
  ASSERT_OK_AND_ASSIGN(auto child, SpawnServerChild({"fd_limited_server"}, log_fd));
  close(log_fd);
  const auto [pid, port] = child;
  std::vector<int> fds;
  for (int i = 0; i < 10; ++i) {
    fds.push_back(RawConnect(port));  // The kernel completes them; the server accepts 3.
    ASSERT_GE(fds.back(), 0);
  }
  absl::SleepFor(absl::Milliseconds(300));
  const absl::Duration cpu_before = CpuTime(pid);
  absl::SleepFor(absl::Seconds(2));
  const absl::Duration cpu = CpuTime(pid) - cpu_before;
  std::ifstream log(log_path);
  int accept_lines = 0;
  std::string line;
  while (std::getline(log, line)) {
    if (line.find("accept failed") != std::string::npos) ++accept_lines;
  }
  std::printf("at the fd limit for 2 s: server CPU %s, %d 'accept failed' log lines\n",
              absl::FormatDuration(cpu).c_str(), accept_lines);
  EXPECT_LT(cpu, absl::Milliseconds(200));
  EXPECT_GE(accept_lines, 1);
  EXPECT_LE(accept_lines, 1);  // One per 10 s.
  // Hanging up frees the server's descriptors; a new client is then served.
  for (int fd : fds) close(fd);
  TCPStoreOptions o;
  o.port = port;
  o.timeout = kTimeout;
  ASSERT_OK_AND_ASSIGN(auto client, TCPStore::Create(o));
  ASSERT_OK(client->Set("k", "v"));
  client.reset();
  kill(pid, SIGKILL);
  (void)WaitChild(pid, absl::Seconds(5));
  unlink(log_path);
}

// ---- the flood measurement --------------------------------------------------------------------

// One Set+Get round trip.
absl::Duration RoundTrip(TCPStore& store) {
  const absl::Time start = absl::Now();
  EXPECT_OK(store.Set("probe", "value"));
  EXPECT_OK(store.Get("probe", kTimeout).status());
  return absl::Now() - start;
}

// The median and the maximum of `t` (sorted in place).
std::pair<absl::Duration, absl::Duration> MedianMax(std::vector<absl::Duration>& t) {
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], t.back()};
}

// 1000 connections without the token (a third silent, a third half a hello, a third the header
// of a 64 MiB Set and 1000 body bytes) against a server in a child process, with the default cap
// and with the cap raised to hold all 1000 at once.
class Flood : public ::testing::TestWithParam<int> {};

TEST_P(Flood, A1000UnauthenticatedConnectionsCostLittleAndDoNotSlowTheJob) {
  const int cap = GetParam();
  ASSERT_OK_AND_ASSIGN(auto child, SpawnServerChild({"token_server", absl::StrCat(cap)}));
  const auto [pid, port] = child;
  ASSERT_OK_AND_ASSIGN(auto client, Connect(port));
  std::vector<absl::Duration> before;
  for (int i = 0; i < 200; ++i) before.push_back(RoundTrip(*client));
  const int64_t rss_before = ProcStatusKb(pid, "VmRSS");

  // The flood in a thread; the job's round trips go on meanwhile.
  std::vector<int> fds;
  std::atomic<bool> flooding{true};
  std::thread flood([&] {
    const std::string half_hello = Hello().substr(0, 10);
    const std::string big_set = SetHeader(1, 64 << 20) + std::string(1000, 'x');
    for (int i = 0; i < 1000; ++i) {
      const int fd = RawConnect(port);
      if (fd < 0) {
        ADD_FAILURE() << "connection " << i << ": " << std::strerror(errno);
        break;
      }
      if (i % 3 == 1) SendAll(fd, half_hello);
      if (i % 3 == 2) SendAll(fd, big_set);
      fds.push_back(fd);
    }
    flooding = false;
  });
  std::vector<absl::Duration> during;
  while (flooding || during.size() < 200) during.push_back(RoundTrip(*client));
  flood.join();
  absl::SleepFor(absl::Milliseconds(300));
  const int64_t rss_after = ProcStatusKb(pid, "VmRSS");
  const int64_t hwm = ProcStatusKb(pid, "VmHWM");
  const auto [before_median, before_max] = MedianMax(before);
  const auto [during_median, during_max] = MedianMax(during);
  std::printf(
      "flood, cap %d: server VmRSS %lld -> %lld KiB (+%lld KiB, VmHWM %lld KiB); Set+Get "
      "median (max) %s (%s) before, %s (%s) over %zu round trips during\n",
      cap, static_cast<long long>(rss_before), static_cast<long long>(rss_after),
      static_cast<long long>(rss_after - rss_before), static_cast<long long>(hwm),
      absl::FormatDuration(before_median).c_str(), absl::FormatDuration(before_max).c_str(),
      absl::FormatDuration(during_median).c_str(), absl::FormatDuration(during_max).c_str(),
      during.size());
  EXPECT_LE(rss_after - rss_before, 16 << 10) << "KiB";
  // "Not slowed": generous bounds for a loaded 2-core machine.
  EXPECT_LT(during_median, std::max(10 * before_median, absl::Milliseconds(20)));
  for (int fd : fds) close(fd);
  ASSERT_OK(client->Set("after", "1"));
  client.reset();
  kill(pid, SIGKILL);
  (void)WaitChild(pid, absl::Seconds(5));
}

INSTANTIATE_TEST_SUITE_P(Caps, Flood, ::testing::Values(128, 1000),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return absl::StrCat("cap", info.param);
                         });

}  // namespace
}  // namespace fairscale::comm

int main(int argc, char** argv) {
  if (argc >= 2) {
    const std::string role = argv[1];
    int a = 0;
    if (role == "token_server" && argc == 3 && absl::SimpleAtoi(argv[2], &a)) {
      return fairscale::comm::ChildTokenServer(a);
    }
    if (role == "fd_limited_server" && argc == 2) return fairscale::comm::ChildFdLimitedServer();
  }
  ::testing::InitGoogleMock(&argc, argv);
  return RUN_ALL_TESTS();
}
