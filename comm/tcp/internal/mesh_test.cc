// Full-mesh setup: handshake validation, stray connections, stale addresses and deadlines.
#include "comm/tcp/internal/mesh.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_matchers.h"
#include "comm/store/hash_store.h"
#include "comm/tcp/internal/wire.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::comm::tcp_internal {
namespace {

using ::fairscale::base::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

MeshOptions Options(absl::Duration timeout = absl::Seconds(20)) {
  MeshOptions options;
  options.timeout = timeout;
  return options;
}

// Runs ConnectMesh for ranks [0, sizes.size()) with the given claimed world sizes.
std::vector<absl::StatusOr<std::vector<MeshPeer>>> Connect(std::shared_ptr<Store> store,
                                                            std::vector<int> sizes,
                                                            absl::Duration timeout) {
  std::vector<absl::StatusOr<std::vector<MeshPeer>>> out(sizes.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < sizes.size(); ++r) {
    threads.emplace_back([&, r] {
      out[r] = ConnectMesh(*store, static_cast<int>(r), sizes[r], Options(timeout));
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

UniqueFd ConnectTo(const std::string& address) {
  auto targets = ResolveHostPort(address);
  EXPECT_OK(targets.status());
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  const SocketAddress& a = targets->front();
  EXPECT_EQ(::connect(fd.get(), reinterpret_cast<const sockaddr*>(&a.storage), a.length), 0);
  return fd;
}

TEST(Mesh, FourRanksConnectEveryPair) {
  auto results = Connect(std::make_shared<HashStore>(), {4, 4, 4, 4}, absl::Seconds(20));
  for (int r = 0; r < 4; ++r) {
    ASSERT_OK(results[r].status());
    for (int p = 0; p < 4; ++p) {
      EXPECT_EQ((*results[r])[p].fd.valid(), p != r) << r << "->" << p;
      if (p != r) {
        EXPECT_THAT((*results[r])[p].address, HasSubstr("127.0.0.1:"));
      }
    }
  }
  // Each pair shares one connection: a byte written on one end arrives on the other.
  char c = 'x';
  ASSERT_EQ(::send((*results[3])[1].fd.get(), &c, 1, 0), 1);
  char got = 0;
  for (int i = 0; i < 1000 && ::recv((*results[1])[3].fd.get(), &got, 1, 0) != 1; ++i) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(got, 'x');
}

TEST(Mesh, StrayConnectionsAreRejectedAndIgnored) {
  auto store = std::make_shared<HashStore>();
  absl::StatusOr<std::vector<MeshPeer>> rank0;
  std::thread t0([&] { rank0 = ConnectMesh(*store, 0, 2, Options()); });
  auto address = store->Get("addr/0", absl::Seconds(20));
  ASSERT_OK(address.status());
  // One stray speaks garbage, one connects and says nothing at all.
  UniqueFd garbage = ConnectTo(*address);
  const char junk[sizeof(Hello)] = "GET / HTTP/1.0\r\n\r\n";
  ASSERT_EQ(::send(garbage.get(), junk, sizeof(junk), 0), static_cast<ssize_t>(sizeof(junk)));
  UniqueFd silent = ConnectTo(*address);
  absl::SleepFor(absl::Milliseconds(50));
  auto rank1 = ConnectMesh(*store, 1, 2, Options());
  t0.join();
  ASSERT_OK(rank0.status());
  ASSERT_OK(rank1.status());
  // The stray got no answer: its connection was closed.
  char buf[64];
  EXPECT_EQ(::recv(garbage.get(), buf, sizeof(buf), 0), 0);
}

TEST(Mesh, WorldSizeMismatchIsInvalidArgumentOnBothSides) {
  auto results = Connect(std::make_shared<HashStore>(), {2, 3}, absl::Seconds(20));
  EXPECT_THAT(results[0].status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("tcp rendezvous rank 0/2"), HasSubstr("peer 1 at "),
                             HasSubstr("world size 3 but this rank has world size 2"))));
  EXPECT_THAT(results[1].status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("tcp rendezvous rank 1/3"), HasSubstr("peer 0 at "),
                             HasSubstr("world size 2 but this rank has world size 3"))));
}

TEST(Mesh, HandshakeFromTheWrongRankIsInvalidArgument) {
  auto store = std::make_shared<HashStore>();
  absl::StatusOr<std::vector<MeshPeer>> rank0;
  std::thread t0([&] { rank0 = ConnectMesh(*store, 0, 3, Options()); });
  auto address = store->Get("addr/0", absl::Seconds(20));
  ASSERT_OK(address.status());
  auto nonce = store->Get("nonce/0", absl::Seconds(20));
  ASSERT_OK(nonce.status());
  UniqueFd fake = ConnectTo(*address);
  const Hello hello{kHandshakeMagic, kProtocolVersion, /*from_rank=*/2, /*to_rank=*/1, 3,
                    std::stoull(*nonce)};
  ASSERT_EQ(::send(fake.get(), &hello, sizeof(hello), 0), static_cast<ssize_t>(sizeof(hello)));
  t0.join();
  EXPECT_THAT(rank0.status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("peer 2 at 127.0.0.1:"),
                             HasSubstr("believes it is connecting to rank 1"))));
  // It was answered (so a real peer could report the mismatch too).
  Hello reply{};
  EXPECT_EQ(::recv(fake.get(), &reply, sizeof(reply), MSG_WAITALL),
            static_cast<ssize_t>(sizeof(reply)));
  EXPECT_EQ(reply.from_rank, 0);
}

// A rank of another communicator (an old epoch, comm/replace.h) whose late connect reaches this
// one's listener, e.g. on a reused port, carries another nonce: the listener drops it and goes
// on; the stale side fails at once saying its rendezvous is stale.
TEST(Mesh, ConnectionMeantForAnotherCommunicatorIsRefusedOnBothSides) {
  auto store = std::make_shared<HashStore>();
  absl::StatusOr<std::vector<MeshPeer>> rank0;
  std::thread t0([&] { rank0 = ConnectMesh(*store, 0, 2, Options()); });
  auto address = store->Get("addr/0", absl::Seconds(20));
  ASSERT_OK(address.status());
  auto nonce = store->Get("nonce/0", absl::Seconds(20));
  ASSERT_OK(nonce.status());
  // The old communicator's store: the same address, the nonce of the listener it had then.
  auto old_store = std::make_shared<HashStore>();
  ASSERT_OK(old_store->Set("nonce/0", absl::StrCat(std::stoull(*nonce) + 1)));
  ASSERT_OK(old_store->Set("addr/0", *address));
  const absl::Time start = absl::Now();
  auto stale = ConnectMesh(*old_store, 1, 3, Options());  // of another size, too
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_THAT(stale.status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("tcp rendezvous rank 1/3: rank 0's address " + *address +
                                       " now belongs to another communicator"),
                             HasSubstr("rendezvous is stale"))));
  // The listener was not disturbed: the real rank 1 joins.
  auto rank1 = ConnectMesh(*store, 1, 2, Options());
  t0.join();
  ASSERT_OK(rank0.status());
  ASSERT_OK(rank1.status());
}

TEST(Mesh, StaleAddressRetriesUntilTheDeadlineAndNamesIt) {
  auto store = std::make_shared<HashStore>();
  // A port nobody listens on: take one from the kernel and close it.
  std::string stale;
  {
    auto listener = Listen("127.0.0.1", 1);
    ASSERT_OK(listener.status());
    stale = listener->address;
  }
  ASSERT_OK(store->Set("addr/0", stale));
  const absl::Time start = absl::Now();
  auto rank1 = ConnectMesh(*store, 1, 2, Options(absl::Milliseconds(400)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  EXPECT_THAT(rank1.status(),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       AllOf(HasSubstr("tcp rendezvous rank 1/2"),
                             HasSubstr("rank 0 at " + stale + ": connect: Connection refused"),
                             HasSubstr("attempts"))));
}

// A published address that keeps refusing connections is wrong from here (the peer listened
// there before publishing it): fail after refused_timeout, not the rendezvous timeout, naming
// the peer, the address and the fix.
TEST(Mesh, PublishedAddressThatRefusesFailsFastNamingTheFix) {
  EXPECT_EQ(MeshOptions().refused_timeout, absl::Seconds(5));
  auto store = std::make_shared<HashStore>();
  std::string stale;
  {
    auto listener = Listen("127.0.0.1", 1);
    ASSERT_OK(listener.status());
    stale = listener->address;
  }
  ASSERT_OK(store->Set("addr/0", stale));
  MeshOptions options = Options(absl::Seconds(60));
  options.refused_timeout = absl::Milliseconds(500);
  const absl::Time start = absl::Now();
  auto rank1 = ConnectMesh(*store, 1, 2, options);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_THAT(rank1.status(),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("tcp rendezvous rank 1/2: cannot connect to rank 0 at " +
                                       stale + " (connect: Connection refused"),
                             HasSubstr("advertised a loopback address"),
                             HasSubstr("FS_SOCKET_IFNAME=<interface>"))));
}

TEST(Mesh, MissingRankTimesOutNamingTheStoreKey) {
  auto store = std::make_shared<HashStore>();
  auto rank1 = ConnectMesh(*store, 1, 2, Options(absl::Milliseconds(200)));
  EXPECT_THAT(rank1.status(), StatusIs(absl::StatusCode::kDeadlineExceeded,
                                       AllOf(HasSubstr("rank 0 did not publish its address"),
                                             HasSubstr("addr/0"))));
  auto rank0 = ConnectMesh(*store, 0, 2, Options(absl::Milliseconds(200)));
  EXPECT_THAT(rank0.status(), StatusIs(absl::StatusCode::kDeadlineExceeded,
                                       HasSubstr("rank 1 never completed a connection")));
}

// A rank started alone does not wait out its timeout in silence: after 5 s it says whom it
// waits for, how many joined and which store it waits in. (Both paths: rank 1 waits for rank 0's
// address in the store, rank 0 for rank 1's connection.)
TEST(Mesh, LoneRankSaysWhomItWaitsFor) {
  auto store = std::make_shared<HashStore>();
  ::testing::internal::CaptureStderr();
  auto rank1 = ConnectMesh(*store, 1, 2, Options(absl::Seconds(6)));
  const std::string log1 = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(rank1.status(), StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(log1, AllOf(HasSubstr("tcp rendezvous rank 1/2: waiting for rank 0 to join (1 of 2 "
                                    "joined) in the store HashStore; started alone"),
                          HasSubstr("giving up after 6s")));

  auto store0 = std::make_shared<HashStore>();
  ::testing::internal::CaptureStderr();
  auto rank0 = ConnectMesh(*store0, 0, 2, Options(absl::Seconds(6)));
  const std::string log0 = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(rank0.status(), StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(log0, HasSubstr("tcp rendezvous rank 0/2: waiting for rank 1 to join (1 of 2 "
                              "joined) in the store HashStore"));
}

TEST(Mesh, Ipv6Loopback) {
  if (!Listen("::1", 1).ok()) GTEST_SKIP() << "no IPv6 loopback here";
  auto store = std::make_shared<HashStore>();
  std::vector<absl::StatusOr<std::vector<MeshPeer>>> out(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      MeshOptions options = Options();
      options.bind_address = "::1";
      out[r] = ConnectMesh(*store, r, 2, options);
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_OK(out[0].status());
  ASSERT_OK(out[1].status());
  EXPECT_THAT((*out[1])[0].address, HasSubstr("[::1]:"));
}

TEST(Mesh, BadBindAddressIsReported) {
  auto store = std::make_shared<HashStore>();
  MeshOptions options = Options();
  options.bind_address = "not an address";
  EXPECT_THAT(ConnectMesh(*store, 0, 2, options).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not an address")));
}

}  // namespace
}  // namespace fairscale::comm::tcp_internal
