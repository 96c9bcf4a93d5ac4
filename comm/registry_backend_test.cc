// Backend selection with fake backends linked (registry_test.cc links none): priority order,
// "" picking the highest, kNotFound listing what is linked, and CreateCommunicatorFromEnv
// building the store the torchrun contract asks for.
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_matchers.h"
#include "comm/communicator.h"
#include "comm/registry.h"
#include "comm/store/tcp_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::comm {
namespace {

using ::fairscale::base::testing::IsOk;
using ::fairscale::base::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A backend that does nothing; it only reports which factory made it and what it was given.
class FakeComm : public Communicator {
 public:
  FakeComm(std::string backend, const CommConfig& config)
      : Communicator(config.rank, config.size, std::move(backend), config.timeout),
        config(config) {}
  void Abort(absl::Status) override {}
  absl::Status status() const override { return absl::OkStatus(); }
  const CommConfig config;

 protected:
  Work DoAllReduce(const OpContext&, ConstBuffer, Buffer, ReduceOp) override { return Work(); }
  Work DoReduceScatter(const OpContext&, ConstBuffer, Buffer, ReduceOp) override { return Work(); }
  Work DoAllGather(const OpContext&, ConstBuffer, Buffer) override { return Work(); }
  Work DoBroadcast(const OpContext&, Buffer, int) override { return Work(); }
  Work DoReduce(const OpContext&, ConstBuffer, Buffer, ReduceOp, int) override { return Work(); }
  Work DoAllToAll(const OpContext&, ConstBuffer, Buffer) override { return Work(); }
  Work DoSend(const OpContext&, ConstBuffer, int) override { return Work(); }
  Work DoRecv(const OpContext&, Buffer, int) override { return Work(); }
  Work DoBarrier(const OpContext&) override { return Work(); }
  Work DoBatchP2P(const OpContext&, std::vector<P2PItem>) override { return Work(); }
  absl::StatusOr<std::shared_ptr<Communicator>> DoSplit(const OpContext&, int, int) override {
    return std::shared_ptr<Communicator>();
  }
};

template <const char* kName>
absl::StatusOr<std::shared_ptr<Communicator>> MakeFake(const CommConfig& config) {
  return std::make_shared<FakeComm>(kName, config);
}

constexpr char kLow[] = "fake_low";
constexpr char kHigh[] = "fake_high";
constexpr char kMid[] = "fake_mid";

// Registered out of priority order on purpose.
const BackendRegistration kLowRegistration(kLow, 1, &MakeFake<kLow>);
const BackendRegistration kHighRegistration(kHigh, 10, &MakeFake<kHigh>);
const BackendRegistration kMidRegistration(kMid, 5, &MakeFake<kMid>);

const FakeComm& AsFake(const std::shared_ptr<Communicator>& c) {
  return *dynamic_cast<const FakeComm*>(c.get());
}

TEST(Registry, ListsBackendsByPriority) {
  EXPECT_THAT(LinkedBackends(), ElementsAre("fake_high", "fake_mid", "fake_low"));
}

TEST(Registry, EmptyNamePicksTheHighestPriority) {
  CommConfig config;
  ASSERT_OK_AND_ASSIGN(auto c, CreateCommunicator("", config));
  EXPECT_EQ(c->backend(), "fake_high");
}

TEST(Registry, PicksByName) {
  CommConfig config;
  config.rank = 1;
  config.size = 3;
  ASSERT_OK_AND_ASSIGN(auto c, CreateCommunicator("fake_low", config));
  EXPECT_EQ(c->backend(), "fake_low");
  EXPECT_EQ(c->rank(), 1);
  EXPECT_EQ(c->size(), 3);
}

TEST(Registry, UnknownNameListsWhatIsLinked) {
  CommConfig config;
  EXPECT_THAT(CreateCommunicator("nccl", config).status(),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("'nccl' is not linked into this binary; linked: fake_high, "
                                 "fake_mid, fake_low")));
}

TEST(Registry, BadRankOrTimeoutIsInvalidArgument) {
  CommConfig config;
  config.rank = 2;
  config.size = 2;
  EXPECT_THAT(CreateCommunicator("", config).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 2")));
  config.rank = 0;
  config.timeout = absl::ZeroDuration();
  EXPECT_THAT(CreateCommunicator("", config).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("timeout")));
}

// ---- CreateCommunicatorFromEnv ------------------------------------------------------------------

class FromEnvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                          "FS_COMM_BACKEND", "FS_COMM_TIMEOUT_S", "FS_COMM_STALL_TIMEOUT_S",
                          "TORCHELASTIC_USE_AGENT_STORE", "FS_STORE_TOKEN", "FS_STORE_PREFIX",
                          "FS_STORE_PROTOCOL", "TORCHELASTIC_RESTART_COUNT", "LOCAL_WORLD_SIZE",
                          "FS_SOCKET_IFNAME"}) {
      unsetenv(v);
    }
  }
  static void Set(const char* name, const std::string& value) {
    setenv(name, value.c_str(), 1);
  }
  // A port that was free a moment ago (the OS picked it for a server we then closed).
  static int FreePort() {
    TCPStoreOptions o;
    o.is_server = true;
    o.timeout = absl::Seconds(10);
    auto s = TCPStore::Create(o);
    return s.ok() ? (*s)->port() : 0;
  }
};

TEST_F(FromEnvTest, SingleRankUsesAnInMemoryStore) {
  Set("RANK", "0");
  Set("WORLD_SIZE", "1");
  Set("FS_COMM_BACKEND", "fake_low");
  CommConfig base;
  base.timeout = absl::Minutes(3);
  base.name = "job";
  ASSERT_OK_AND_ASSIGN(auto c, CreateCommunicatorFromEnv(base));
  const FakeComm& fake = AsFake(c);
  EXPECT_EQ(fake.backend(), "fake_low");
  EXPECT_EQ(fake.config.timeout, absl::Minutes(3));  // No FS_COMM_TIMEOUT_S: base's.
  EXPECT_EQ(fake.config.name, "job");
  ASSERT_NE(fake.config.store, nullptr);
  EXPECT_EQ(dynamic_cast<TCPStore*>(fake.config.store.get()), nullptr);
  EXPECT_OK(fake.config.store->Set("k", "v"));
}

TEST_F(FromEnvTest, StallTimeoutSetsTheHeartbeatOptions) {
  Set("RANK", "0");
  Set("WORLD_SIZE", "1");
  Set("FS_COMM_STALL_TIMEOUT_S", "3");
  {
    ASSERT_OK_AND_ASSIGN(auto c, CreateCommunicatorFromEnv());
    const FakeComm& fake = AsFake(c);
    EXPECT_EQ(fake.config.options.at("algo.stall_timeout_ms"), "3000");
    EXPECT_EQ(fake.config.options.at("algo.heartbeat_ms"), "750");
  }
  Set("FS_COMM_STALL_TIMEOUT_S", "0");
  {
    ASSERT_OK_AND_ASSIGN(auto c, CreateCommunicatorFromEnv());
    EXPECT_EQ(AsFake(c).config.options.at("algo.heartbeat_ms"), "0");  // off
  }
  Set("FS_COMM_STALL_TIMEOUT_S", "soon");
  EXPECT_THAT(CreateCommunicatorFromEnv().status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("FS_COMM_STALL_TIMEOUT_S='soon' is not a number of seconds")));
}

TEST_F(FromEnvTest, RankZeroHostsTheStoreOnMasterPort) {
  const int port = FreePort();
  ASSERT_GT(port, 0);
  Set("RANK", "0");
  Set("WORLD_SIZE", "2");
  Set("MASTER_ADDR", "127.0.0.1");
  Set("MASTER_PORT", absl::StrCat(port));
  Set("FS_COMM_TIMEOUT_S", "7");
  ASSERT_OK_AND_ASSIGN(auto c, CreateCommunicatorFromEnv());
  const FakeComm& fake = AsFake(c);
  EXPECT_EQ(fake.backend(), "fake_high");
  EXPECT_EQ(fake.rank(), 0);
  EXPECT_EQ(fake.size(), 2);
  EXPECT_EQ(fake.config.timeout, absl::Seconds(7));
  auto* store = dynamic_cast<TCPStore*>(fake.config.store.get());
  ASSERT_NE(store, nullptr);
  EXPECT_TRUE(store->is_server());
  EXPECT_EQ(store->port(), port);
  // Rank 1 would connect here.
  ASSERT_OK(store->Set("rank0", "hello"));
  TCPStoreOptions o;
  o.port = port;
  o.timeout = absl::Seconds(10);
  ASSERT_OK_AND_ASSIGN(auto rank1, TCPStore::Create(o));
  ASSERT_OK_AND_ASSIGN(std::string v, rank1->Get("rank0", absl::Seconds(5)));
  EXPECT_EQ(v, "hello");
}

// Rank 0 of 2 hosting the store on 127.0.0.1; FS_SOCKET_IFNAME / the caller's bind_address decide
// where the backend listens.
TEST_F(FromEnvTest, SocketIfnameChoosesTheBindAddress) {
  Set("RANK", "0");
  Set("WORLD_SIZE", "2");
  Set("MASTER_ADDR", "127.0.0.1");
  Set("FS_COMM_BACKEND", "fake_low");
  {
    Set("MASTER_PORT", absl::StrCat(FreePort()));
    ASSERT_OK_AND_ASSIGN(auto c, CreateCommunicatorFromEnv());
    EXPECT_EQ(AsFake(c).config.bind_address, "127.0.0.1");  // loopback MASTER_ADDR
    EXPECT_EQ(AsFake(c).config.network_interface, "");
  }
  Set("FS_SOCKET_IFNAME", "lo");
  {
    Set("MASTER_PORT", absl::StrCat(FreePort()));
    ASSERT_OK_AND_ASSIGN(auto c, CreateCommunicatorFromEnv());
    EXPECT_EQ(AsFake(c).config.bind_address, "127.0.0.1");
    EXPECT_EQ(AsFake(c).config.network_interface, "lo");
  }
  {
    Set("MASTER_PORT", absl::StrCat(FreePort()));
    CommConfig base;
    base.bind_address = "0.0.0.0";  // the caller's own choice wins
    ASSERT_OK_AND_ASSIGN(auto c, CreateCommunicatorFromEnv(base));
    EXPECT_EQ(AsFake(c).config.bind_address, "0.0.0.0");
  }
  Set("FS_SOCKET_IFNAME", "fs_nosuch0");
  EXPECT_THAT(CreateCommunicatorFromEnv().status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("FS_SOCKET_IFNAME='fs_nosuch0'"),
                             HasSubstr("no interface named 'fs_nosuch0'"), HasSubstr("lo"))));
}

TEST_F(FromEnvTest, AgentStoreMakesEveryRankAClient) {
  TCPStoreOptions agent_options;
  agent_options.is_server = true;
  agent_options.timeout = absl::Seconds(10);
  ASSERT_OK_AND_ASSIGN(auto agent, TCPStore::Create(agent_options));
  Set("RANK", "0");
  Set("WORLD_SIZE", "2");
  Set("MASTER_ADDR", "127.0.0.1");
  Set("MASTER_PORT", absl::StrCat(agent->port()));
  Set("TORCHELASTIC_USE_AGENT_STORE", "True");
  // Our protocol (fs_launch's agent store): without a token the agent store would be c10d's.
  Set("FS_STORE_PROTOCOL", "fairscale");
  ASSERT_OK_AND_ASSIGN(auto c, CreateCommunicatorFromEnv());
  auto* store = dynamic_cast<TCPStore*>(AsFake(c).config.store.get());
  ASSERT_NE(store, nullptr);
  EXPECT_FALSE(store->is_server());
  ASSERT_OK(store->Set("from-rank0", "x"));
  ASSERT_OK_AND_ASSIGN(std::string v, agent->Get("from-rank0", absl::Seconds(5)));
  EXPECT_EQ(v, "x");
  c.reset();  // The client goes before the agent's server.
}

// fs_launch's agent store demands FS_STORE_TOKEN, and FS_STORE_PREFIX namespaces every key.
TEST_F(FromEnvTest, TheStoreTokenAndPrefixReachTheTCPStore) {
  TCPStoreOptions agent_options;
  agent_options.is_server = true;
  agent_options.timeout = absl::Seconds(10);
  agent_options.token = "feedfacefeedfacefeedfacefeedface";
  ASSERT_OK_AND_ASSIGN(auto agent, TCPStore::Create(agent_options));
  Set("RANK", "1");
  Set("WORLD_SIZE", "2");
  Set("MASTER_ADDR", "127.0.0.1");
  Set("MASTER_PORT", absl::StrCat(agent->port()));
  Set("TORCHELASTIC_USE_AGENT_STORE", "True");
  Set("FS_STORE_PROTOCOL", "fairscale");  // a missing token must still reach our TCPStore
  Set("FS_COMM_TIMEOUT_S", "60");
  for (const char* wrong : {"", "feedfacefeedfacefeedfacefeedfacf"}) {
    if (*wrong == '\0') {
      unsetenv("FS_STORE_TOKEN");
    } else {
      Set("FS_STORE_TOKEN", wrong);
    }
    EXPECT_THAT(CreateCommunicatorFromEnv().status(),
                StatusIs(absl::StatusCode::kUnauthenticated,
                         absl::StrCat("TCPStore 127.0.0.1:", agent->port(),
                                      " rejected this client: wrong or missing job token "
                                      "(FS_STORE_TOKEN)")))
        << "token '" << wrong << "'";
  }
  Set("FS_STORE_TOKEN", "feedfacefeedfacefeedfacefeedface");
  Set("FS_STORE_PREFIX", "fs_launch/3/job");
  ASSERT_OK_AND_ASSIGN(auto c, CreateCommunicatorFromEnv());
  ASSERT_OK(AsFake(c).config.store->Set("k", "v"));
  ASSERT_OK_AND_ASSIGN(std::string v, agent->Get("fs_launch/3/job/k", absl::Seconds(5)));
  EXPECT_EQ(v, "v");
  c.reset();  // The client goes before the agent's server.
}

TEST_F(FromEnvTest, UnknownBackendFromEnv) {
  Set("RANK", "0");
  Set("WORLD_SIZE", "1");
  Set("FS_COMM_BACKEND", "ucx");
  EXPECT_THAT(CreateCommunicatorFromEnv().status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("linked: fake_high")));
}

TEST_F(FromEnvTest, UnreachableMasterFailsWithinTheTimeout) {
  const int port = FreePort();
  Set("RANK", "1");
  Set("WORLD_SIZE", "2");
  Set("MASTER_ADDR", "127.0.0.1");
  Set("MASTER_PORT", absl::StrCat(port));
  Set("FS_COMM_TIMEOUT_S", "0.3");
  const absl::Time start = absl::Now();
  EXPECT_THAT(CreateCommunicatorFromEnv().status(),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr(absl::StrCat("127.0.0.1:", port))));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
}

}  // namespace
}  // namespace fairscale::comm
