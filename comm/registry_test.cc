// The registry with no backend linked, and the torchrun environment contract (ParseEnv).
// registry_backend_test.cc covers selection among linked (fake) backends.
#include "comm/registry.h"

#include <cstdlib>
#include <map>
#include <optional>
#include <string>

#include "base/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::comm {
namespace {

using ::fairscale::base::testing::IsOk;
using ::fairscale::base::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr const char* kVars[] = {
    "RANK",           "WORLD_SIZE",         "LOCAL_RANK",           "MASTER_ADDR",
    "MASTER_PORT",    "FS_COMM_BACKEND",    "FS_COMM_TIMEOUT_S",    "TORCHELASTIC_USE_AGENT_STORE",
    "FS_STORE_TOKEN", "FS_STORE_PREFIX",    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK", "PMI_SIZE",           "MPI_LOCALRANKID",
    "SLURM_PROCID",   "SLURM_NTASKS",       "SLURM_LOCALID",        "SLURM_STEP_ID",
    "SLURM_STEPID",   "SLURM_JOB_ID",       "SLURM_JOB_NODELIST",   "SLURM_NODELIST",
    "SLURM_STEP_NODELIST", "FS_STORE_PROTOCOL", "TORCHELASTIC_RESTART_COUNT",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_MCA_orte_jobfam_session_dir", "OMPI_MCA_ess_base_jobid",
    "LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "SLURM_STEP_NUM_NODES", "FS_SOCKET_IFNAME"};

// Clears the contract's variables for each test and restores them afterwards.
// Environment variables that ParseEnv rejects.
struct BadCase {
  std::map<std::string, std::string> vars;
  std::string message;  // must appear in the kInvalidArgument message
};

class EnvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : kVars) {
      const char* old = std::getenv(v);
      saved_[v] = old ? std::optional<std::string>(old) : std::nullopt;
      unsetenv(v);
    }
  }
  void TearDown() override {
    for (const auto& [name, value] : saved_) {
      if (value.has_value()) {
        setenv(name.c_str(), value->c_str(), 1);
      } else {
        unsetenv(name.c_str());
      }
    }
  }
  static void Set(const char* name, const char* value) { setenv(name, value, 1); }

  // For each case, in a cleared environment: ParseEnv with exactly c.vars set is kInvalidArgument
  // containing c.message.
  static void ExpectEachRejected(const std::vector<BadCase>& cases) {
    for (const BadCase& c : cases) {
      for (const char* v : kVars) unsetenv(v);
      std::string desc;
      for (const auto& [k, v] : c.vars) {
        Set(k.c_str(), v.c_str());
        desc += k + "=" + v + " ";
      }
      EXPECT_THAT(ParseEnv().status(),
                  StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)))
          << desc;
    }
  }

  std::map<std::string, std::optional<std::string>> saved_;
};

TEST(Registry, NothingLinked) {
  EXPECT_THAT(LinkedBackends(), IsEmpty());
  CommConfig config;
  EXPECT_THAT(CreateCommunicator("", config).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no comm backend is linked")));
  EXPECT_THAT(CreateCommunicator("tcp", config).status(),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("no comm backend is linked"), HasSubstr("'tcp'"),
                             HasSubstr("//comm:all_backends"))));
}

TEST_F(EnvTest, MinimalSingleRank) {
  Set("RANK", "0");
  Set("WORLD_SIZE", "1");
  ASSERT_OK_AND_ASSIGN(EnvConfig env, ParseEnv());
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.world_size, 1);
  EXPECT_EQ(env.local_rank, 0);
  EXPECT_EQ(env.master_addr, "");
  EXPECT_EQ(env.master_port, 0);
  EXPECT_EQ(env.backend, "");
  EXPECT_EQ(env.timeout, absl::Minutes(10));
  EXPECT_FALSE(env.use_agent_store);
}

TEST_F(EnvTest, EveryVariable) {
  Set("RANK", "2");
  Set("WORLD_SIZE", "4");
  Set("LOCAL_RANK", "1");
  Set("MASTER_ADDR", "10.1.2.3");
  Set("MASTER_PORT", "29500");
  Set("FS_COMM_BACKEND", "tcp");
  Set("FS_COMM_TIMEOUT_S", "2.5");
  Set("TORCHELASTIC_USE_AGENT_STORE", "True");
  ASSERT_OK_AND_ASSIGN(EnvConfig env, ParseEnv());
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.master_addr, "10.1.2.3");
  EXPECT_EQ(env.master_port, 29500);
  EXPECT_EQ(env.backend, "tcp");
  EXPECT_EQ(env.timeout, absl::Milliseconds(2500));
  EXPECT_TRUE(env.use_agent_store);
  Set("TORCHELASTIC_USE_AGENT_STORE", "False");
  ASSERT_OK_AND_ASSIGN(env, ParseEnv());
  EXPECT_FALSE(env.use_agent_store);
}

// The ranks on this host (for the choice of bind address): each launcher's spelling.
TEST_F(EnvTest, LocalWorldSizeAndSocketIfname) {
  Set("RANK", "0");
  Set("WORLD_SIZE", "1");
  ASSERT_OK_AND_ASSIGN(EnvConfig env, ParseEnv());
  EXPECT_EQ(env.local_world_size, 0);  // unknown
  EXPECT_EQ(env.socket_ifname, "");
  Set("LOCAL_WORLD_SIZE", "1");
  Set("FS_SOCKET_IFNAME", "eth0");
  ASSERT_OK_AND_ASSIGN(env, ParseEnv());
  EXPECT_EQ(env.local_world_size, 1);
  EXPECT_EQ(env.socket_ifname, "eth0");
  for (const char* v : kVars) unsetenv(v);
  Set("OMPI_COMM_WORLD_RANK", "0");
  Set("OMPI_COMM_WORLD_SIZE", "1");
  Set("OMPI_COMM_WORLD_LOCAL_SIZE", "1");
  ASSERT_OK_AND_ASSIGN(env, ParseEnv());
  EXPECT_EQ(env.local_world_size, 1);
  for (const char* v : kVars) unsetenv(v);
  Set("PMI_RANK", "0");
  Set("PMI_SIZE", "1");
  Set("MPI_LOCALNRANKS", "1");
  ASSERT_OK_AND_ASSIGN(env, ParseEnv());
  EXPECT_EQ(env.local_world_size, 1);
  for (const char* v : kVars) unsetenv(v);
  Set("SLURM_PROCID", "0");
  Set("SLURM_NTASKS", "1");
  Set("SLURM_STEP_NUM_NODES", "1");
  ASSERT_OK_AND_ASSIGN(env, ParseEnv());
  EXPECT_EQ(env.local_world_size, 1);
  Set("LOCAL_WORLD_SIZE", "many");
  EXPECT_THAT(ParseEnv().status(), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr("LOCAL_WORLD_SIZE='many'")));
}

TEST_F(EnvTest, ErrorsNameTheVariableAndItsValue) {
  const std::map<std::string, std::string> ok1 = {{"RANK", "0"}, {"WORLD_SIZE", "1"}};
  const std::map<std::string, std::string> ok2 = {
      {"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}};
  auto with = [](std::map<std::string, std::string> base,
                 std::map<std::string, std::string> changes) {
    for (auto& [k, v] : changes) base[k] = v;
    return base;
  };
  auto without = [](std::map<std::string, std::string> base, const std::string& name) {
    base.erase(name);
    return base;
  };
  const std::vector<BadCase> cases = {
      {without(ok1, "RANK"), "RANK is not set"},
      {without(ok1, "WORLD_SIZE"), "WORLD_SIZE is not set"},
      {with(ok1, {{"RANK", "abc"}}), "RANK='abc' is not an integer"},
      {with(ok1, {{"RANK", ""}}), "RANK='' is not an integer"},
      {with(ok1, {{"RANK", "1.5"}}), "RANK='1.5' is not an integer"},
      {with(ok1, {{"RANK", "99999999999"}}), "RANK='99999999999'"},
      {with(ok1, {{"RANK", "-1"}}), "RANK='-1' is outside"},
      {with(ok1, {{"WORLD_SIZE", "0"}}), "WORLD_SIZE='0' is outside"},
      {with(ok1, {{"WORLD_SIZE", "-4"}}), "WORLD_SIZE='-4'"},
      {with(ok2, {{"RANK", "2"}}), "RANK='2' is not below WORLD_SIZE='2'"},
      {with(ok1, {{"LOCAL_RANK", "-3"}}), "LOCAL_RANK='-3'"},
      {with(ok1, {{"LOCAL_RANK", "x"}}), "LOCAL_RANK='x' is not an integer"},
      {without(ok2, "MASTER_ADDR"), "MASTER_ADDR is not set"},
      {without(ok2, "MASTER_PORT"), "MASTER_PORT is not set"},
      {with(ok2, {{"MASTER_ADDR", ""}}), "MASTER_ADDR='' is empty"},
      {with(ok2, {{"MASTER_PORT", "http"}}), "MASTER_PORT='http' is not an integer"},
      {with(ok2, {{"MASTER_PORT", "70000"}}), "MASTER_PORT='70000' is outside [1, 65535]"},
      {with(ok2, {{"MASTER_PORT", "0"}}), "MASTER_PORT='0'"},
      {with(ok1, {{"FS_COMM_TIMEOUT_S", "0"}}), "FS_COMM_TIMEOUT_S='0' must be positive"},
      {with(ok1, {{"FS_COMM_TIMEOUT_S", "-5"}}), "FS_COMM_TIMEOUT_S='-5'"},
      {with(ok1, {{"FS_COMM_TIMEOUT_S", "soon"}}), "FS_COMM_TIMEOUT_S='soon'"},
      {with(ok1, {{"FS_COMM_TIMEOUT_S", "inf"}}), "FS_COMM_TIMEOUT_S='inf'"},
      {with(ok1, {{"TORCHELASTIC_USE_AGENT_STORE", "maybe"}}),
       "TORCHELASTIC_USE_AGENT_STORE='maybe'"},
  };
  ExpectEachRejected(cases);
}

TEST_F(EnvTest, StoreTokenAndPrefix) {
  Set("RANK", "0");
  Set("WORLD_SIZE", "1");
  Set("FS_STORE_TOKEN", "00ff");
  Set("FS_STORE_PREFIX", "fs_launch/1/job");
  ASSERT_OK_AND_ASSIGN(EnvConfig env, ParseEnv());
  EXPECT_EQ(env.store_token, "00ff");
  EXPECT_EQ(env.store_prefix, "fs_launch/1/job");
  EXPECT_EQ(env.rank_source, "RANK/WORLD_SIZE");
}

TEST_F(EnvTest, OpenMpiRankSizeAndLocalRank) {
  Set("OMPI_COMM_WORLD_RANK", "3");
  Set("OMPI_COMM_WORLD_SIZE", "4");
  Set("OMPI_COMM_WORLD_LOCAL_RANK", "1");
  Set("MASTER_ADDR", "node0");
  Set("MASTER_PORT", "29500");
  ASSERT_OK_AND_ASSIGN(EnvConfig env, ParseEnv());
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.rank_source, "OMPI_COMM_WORLD_*");
}

TEST_F(EnvTest, PmiRankAndSize) {
  Set("PMI_RANK", "2");
  Set("PMI_SIZE", "3");
  Set("MPI_LOCALRANKID", "0");
  Set("MASTER_ADDR", "node0");
  Set("MASTER_PORT", "29500");
  ASSERT_OK_AND_ASSIGN(EnvConfig env, ParseEnv());
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.world_size, 3);
  EXPECT_EQ(env.local_rank, 0);
  EXPECT_EQ(env.rank_source, "PMI_*");
}

TEST_F(EnvTest, SlurmProcidNtasksLocalid) {
  Set("SLURM_STEP_ID", "0");
  Set("SLURM_PROCID", "5");
  Set("SLURM_NTASKS", "8");
  Set("SLURM_LOCALID", "1");
  Set("MASTER_ADDR", "node0");
  Set("MASTER_PORT", "29500");
  ASSERT_OK_AND_ASSIGN(EnvConfig env, ParseEnv());
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.rank_source, "SLURM_*");
}

// srun without MASTER_ADDR / MASTER_PORT: the first host of the node list, a port from the job.
TEST_F(EnvTest, SlurmMasterFromNodeListAndPortFromJobId) {
  Set("SLURM_STEP_ID", "0");
  Set("SLURM_PROCID", "1");
  Set("SLURM_NTASKS", "4");
  Set("SLURM_JOB_ID", "123456");
  Set("SLURM_JOB_NODELIST", "node[01-04,07]");
  ASSERT_OK_AND_ASSIGN(EnvConfig env, ParseEnv());
  EXPECT_EQ(env.master_addr, "node01");
  EXPECT_EQ(env.master_addr_source, "SLURM_JOB_NODELIST");
  EXPECT_EQ(env.master_port, 15000 + 123456 % 20000);
  EXPECT_EQ(env.master_port_source, "SLURM_JOB_ID");
  EXPECT_FALSE(env.use_agent_store);

  Set("SLURM_NODELIST", "x[9-11]");  // the job's list wins over the older spelling
  ASSERT_OK_AND_ASSIGN(env, ParseEnv());
  EXPECT_EQ(env.master_addr, "node01");
  unsetenv("SLURM_JOB_NODELIST");
  ASSERT_OK_AND_ASSIGN(env, ParseEnv());
  EXPECT_EQ(env.master_addr, "x9");
  EXPECT_EQ(env.master_addr_source, "SLURM_NODELIST");
  Set("SLURM_STEP_NODELIST", "gpu-[9-11]x,a3");  // the step's own nodes win
  ASSERT_OK_AND_ASSIGN(env, ParseEnv());
  EXPECT_EQ(env.master_addr, "gpu-9x");

  Set("MASTER_ADDR", "head");
  Set("MASTER_PORT", "29400");
  ASSERT_OK_AND_ASSIGN(env, ParseEnv());
  EXPECT_EQ(env.master_addr, "head");
  EXPECT_EQ(env.master_port, 29400);
  EXPECT_EQ(env.master_addr_source, "MASTER_ADDR");
}

TEST_F(EnvTest, SlurmBadNodeListNamesTheVariable) {
  Set("SLURM_STEP_ID", "0");
  Set("SLURM_PROCID", "0");
  Set("SLURM_NTASKS", "2");
  Set("SLURM_JOB_ID", "7");
  Set("SLURM_JOB_NODELIST", "node[04-01]");
  EXPECT_THAT(ParseEnv().status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("SLURM_JOB_NODELIST is not a Slurm host list"),
                             HasSubstr("'node[04-01]'"), HasSubstr("set MASTER_ADDR"))));
  unsetenv("SLURM_JOB_NODELIST");
  EXPECT_THAT(ParseEnv().status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("MASTER_ADDR is not set"),
                             HasSubstr("SLURM_JOB_NODELIST, which is not set either"))));
  Set("SLURM_JOB_NODELIST", "n1");
  unsetenv("SLURM_JOB_ID");
  EXPECT_THAT(ParseEnv().status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("MASTER_PORT is not set")));
}

// The batch step of an sbatch script: SLURM_PROCID=0, SLURM_NTASKS=N, no srun step.
TEST_F(EnvTest, SlurmBatchStepIsRefused) {
  Set("SLURM_PROCID", "0");
  Set("SLURM_NTASKS", "4");
  Set("SLURM_JOB_ID", "7");
  Set("SLURM_JOB_NODELIST", "n[1-2]");
  for (const char* step : {"", "batch", "4294967291"}) {
    if (*step != '\0') Set("SLURM_STEP_ID", step);
    EXPECT_THAT(ParseEnv().status(),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         AllOf(HasSubstr("SLURM_PROCID='0' SLURM_NTASKS='4'"),
                               HasSubstr("batch step of an sbatch script"),
                               HasSubstr("other 3 rank(s)"), HasSubstr("srun <program>"))))
        << "SLURM_STEP_ID='" << step << "'";
  }
  EXPECT_TRUE(StartedByLauncher());  // so train_gpt says this instead of launching itself
  Set("SLURM_STEP_ID", "3");
  EXPECT_THAT(ParseEnv().status(), IsOk());
  unsetenv("SLURM_STEP_ID");
  Set("SLURM_NTASKS", "1");  // one task: nobody to wait for
  EXPECT_THAT(ParseEnv().status(), IsOk());
}

// mpirun on one node without MASTER_ADDR: a FileStore in mpirun's session directory.
TEST_F(EnvTest, SingleNodeMpirunUsesTheSessionDirectory) {
  Set("OMPI_COMM_WORLD_RANK", "1");
  Set("OMPI_COMM_WORLD_SIZE", "2");
  Set("OMPI_COMM_WORLD_LOCAL_SIZE", "2");
  Set("OMPI_MCA_orte_jobfam_session_dir", "/tmp/ompi.vm.0/pid.42");
  Set("OMPI_MCA_ess_base_jobid", "1498742785");
  ASSERT_OK_AND_ASSIGN(EnvConfig env, ParseEnv());
  EXPECT_EQ(env.store_dir, "/tmp/ompi.vm.0/pid.42/fairscale_store_1498742785");
  EXPECT_EQ(env.master_addr, "");

  Set("MASTER_ADDR", "127.0.0.1");  // an explicit rendezvous wins
  Set("MASTER_PORT", "29500");
  ASSERT_OK_AND_ASSIGN(env, ParseEnv());
  EXPECT_EQ(env.store_dir, "");
  EXPECT_EQ(env.master_port, 29500);

  unsetenv("MASTER_ADDR");
  unsetenv("MASTER_PORT");
  Set("OMPI_COMM_WORLD_LOCAL_SIZE", "1");  // two nodes: no shared directory
  EXPECT_THAT(ParseEnv().status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("MASTER_ADDR is not set"),
                             HasSubstr("OMPI_COMM_WORLD_SIZE='2'"),
                             HasSubstr("the ranks are on several hosts "
                                       "(OMPI_COMM_WORLD_LOCAL_SIZE='1' here)"),
                             HasSubstr("mpirun -x MASTER_ADDR=<rank 0's host> "
                                       "-x MASTER_PORT=29500"),
                             HasSubstr("only the variables named with -x"))));
  Set("MASTER_ADDR", "node0");
  EXPECT_THAT(ParseEnv().status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("MASTER_PORT is not set"), HasSubstr("mpirun -x"))));
}

// mpirun across hosts with a MASTER_ADDR that is loopback here: no other host could reach rank
// 0's store, so it fails at once instead of timing out. Loopback stays fine on one host, and for
// torchrun's "nodes" (agents side by side on one machine).
TEST_F(EnvTest, MpirunAcrossHostsRejectsALoopbackMasterAddr) {
  Set("OMPI_COMM_WORLD_RANK", "2");
  Set("OMPI_COMM_WORLD_SIZE", "4");
  Set("OMPI_COMM_WORLD_LOCAL_SIZE", "2");
  Set("MASTER_PORT", "29500");
  for (const char* addr : {"127.0.0.1", "localhost"}) {
    Set("MASTER_ADDR", addr);
    EXPECT_THAT(ParseEnv().status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr(std::string("MASTER_ADDR='") + addr +
                                         "' is a loopback address on this host"),
                               HasSubstr("2 of the 4 on this one"),
                               HasSubstr("mpirun -x MASTER_ADDR=<its IP"))))
        << addr;
  }
  Set("OMPI_COMM_WORLD_LOCAL_SIZE", "4");  // one host
  EXPECT_OK(ParseEnv().status());
  unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");  // unknown: no claim
  EXPECT_OK(ParseEnv().status());
  Set("OMPI_COMM_WORLD_LOCAL_SIZE", "2");
  Set("MASTER_ADDR", "192.0.2.1");  // not loopback
  EXPECT_OK(ParseEnv().status());

  for (const char* var :
       {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"}) {
    unsetenv(var);
  }
  Set("RANK", "2");
  Set("WORLD_SIZE", "4");
  Set("LOCAL_WORLD_SIZE", "2");
  Set("MASTER_ADDR", "127.0.0.1");
  EXPECT_OK(ParseEnv().status());
}

TEST_F(EnvTest, StoreProtocol) {
  Set("RANK", "1");
  Set("WORLD_SIZE", "2");
  Set("MASTER_ADDR", "localhost");
  Set("MASTER_PORT", "29500");
  Set("TORCHELASTIC_USE_AGENT_STORE", "True");
  Set("TORCHELASTIC_RESTART_COUNT", "3");
  ASSERT_OK_AND_ASSIGN(EnvConfig env, ParseEnv());
  EXPECT_EQ(env.store_protocol, "c10d");  // torchrun: no FS_STORE_TOKEN
  EXPECT_EQ(env.restart_count, 3);
  Set("FS_STORE_TOKEN", "tok");  // fs_launch
  ASSERT_OK_AND_ASSIGN(env, ParseEnv());
  EXPECT_EQ(env.store_protocol, "fairscale");
  Set("FS_STORE_PROTOCOL", "c10d");
  ASSERT_OK_AND_ASSIGN(env, ParseEnv());
  EXPECT_EQ(env.store_protocol, "c10d");
  unsetenv("FS_STORE_TOKEN");
  Set("FS_STORE_PROTOCOL", "fairscale");
  ASSERT_OK_AND_ASSIGN(env, ParseEnv());
  EXPECT_EQ(env.store_protocol, "fairscale");
  Set("FS_STORE_PROTOCOL", "gloo");
  EXPECT_THAT(ParseEnv().status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("FS_STORE_PROTOCOL='gloo'")));
  unsetenv("FS_STORE_PROTOCOL");
  Set("TORCHELASTIC_RESTART_COUNT", "-1");
  EXPECT_THAT(ParseEnv().status(), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr("TORCHELASTIC_RESTART_COUNT='-1'")));
}

// torchrun's agent store without //comm/torch:c10d_store linked: the error says what to link.
TEST_F(EnvTest, C10dStoreNotLinked) {
  EXPECT_THAT(LinkedStoreClients(), IsEmpty());
  Set("RANK", "1");
  Set("WORLD_SIZE", "2");
  Set("MASTER_ADDR", "127.0.0.1");
  Set("MASTER_PORT", "29500");
  Set("TORCHELASTIC_USE_AGENT_STORE", "True");
  EXPECT_THAT(CreateCommunicatorFromEnv().status(),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("c10d TCPStore at 127.0.0.1:29500"),
                             HasSubstr("no 'c10d' store client is linked"),
                             HasSubstr("depend on //comm/torch:c10d_store"),
                             HasSubstr("FS_STORE_PROTOCOL=fairscale"))));
}

TEST_F(EnvTest, StartedByLauncher) {
  EXPECT_FALSE(StartedByLauncher());
  for (const char* var : {"RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                          "PMI_RANK", "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS"}) {
    Set(var, "0");
    EXPECT_TRUE(StartedByLauncher()) << var;
    unsetenv(var);
  }
  Set("LOCAL_RANK", "0");  // not a rank source by itself
  Set("MASTER_ADDR", "x");
  EXPECT_FALSE(StartedByLauncher());
}

TEST_F(EnvTest, ExplicitRankAndWorldSizeWinOverLaunchers) {
  Set("RANK", "1");
  Set("WORLD_SIZE", "2");
  Set("LOCAL_RANK", "1");
  Set("MASTER_ADDR", "127.0.0.1");
  Set("MASTER_PORT", "29500");
  // fs_launch under srun: Slurm's view describes the launcher's task, not this rank.
  Set("SLURM_PROCID", "0");
  Set("SLURM_NTASKS", "1");
  Set("SLURM_LOCALID", "0");
  Set("OMPI_COMM_WORLD_RANK", "0");
  Set("OMPI_COMM_WORLD_SIZE", "1");
  ASSERT_OK_AND_ASSIGN(EnvConfig env, ParseEnv());
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 2);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.rank_source, "RANK/WORLD_SIZE");
}

// mpirun inside an sbatch allocation: the batch step's SLURM_* must not be read.
TEST_F(EnvTest, MpiWinsOverSlurm) {
  Set("OMPI_COMM_WORLD_RANK", "1");
  Set("OMPI_COMM_WORLD_SIZE", "2");
  Set("SLURM_PROCID", "0");
  Set("SLURM_NTASKS", "1");
  Set("SLURM_LOCALID", "0");
  Set("OMPI_COMM_WORLD_LOCAL_RANK", "1");
  Set("MASTER_ADDR", "127.0.0.1");
  Set("MASTER_PORT", "29500");
  ASSERT_OK_AND_ASSIGN(EnvConfig env, ParseEnv());
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 2);
  EXPECT_EQ(env.local_rank, 1);
}

TEST_F(EnvTest, LauncherVariablesThatDoNotAddUpNameTheVariables) {
  const std::vector<BadCase> cases = {
      {{{"OMPI_COMM_WORLD_RANK", "4"}, {"OMPI_COMM_WORLD_SIZE", "4"}},
       "OMPI_COMM_WORLD_RANK='4' is not below OMPI_COMM_WORLD_SIZE='4'"},
      {{{"OMPI_COMM_WORLD_RANK", "1"}}, "OMPI_COMM_WORLD_SIZE is not set (set by mpirun)"},
      {{{"OMPI_COMM_WORLD_SIZE", "2"}}, "OMPI_COMM_WORLD_RANK is not set"},
      {{{"OMPI_COMM_WORLD_RANK", "x"}, {"OMPI_COMM_WORLD_SIZE", "2"}},
       "OMPI_COMM_WORLD_RANK='x' is not an integer"},
      {{{"OMPI_COMM_WORLD_RANK", "1"},
        {"OMPI_COMM_WORLD_SIZE", "2"},
        {"PMI_RANK", "0"},
        {"PMI_SIZE", "2"}},
       "OMPI_COMM_WORLD_RANK='1' OMPI_COMM_WORLD_SIZE='2' disagree with PMI_RANK='0' "
       "PMI_SIZE='2'"},
      {{{"PMI_RANK", "0"}}, "PMI_SIZE is not set"},
      {{{"PMI_RANK", "3"}, {"PMI_SIZE", "2"}}, "PMI_RANK='3' is not below PMI_SIZE='2'"},
      {{{"SLURM_PROCID", "0"}}, "SLURM_NTASKS is not set (set by srun)"},
      {{{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "2"}},
       "SLURM_PROCID='2' is not below SLURM_NTASKS='2'"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_LOCALID", "-1"}},
       "SLURM_LOCALID='-1'"},
      {{{"RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "0"}},
       "WORLD_SIZE is not set"},
      {{}, "WORLD_SIZE is not set (set by torchrun / fs_launch, or OMPI_COMM_WORLD_*"},
  };
  ExpectEachRejected(cases);
}

TEST_F(EnvTest, SingleRankNeedsNoMasterButValidatesOneIfGiven) {
  Set("RANK", "0");
  Set("WORLD_SIZE", "1");
  Set("MASTER_PORT", "99999");
  EXPECT_THAT(ParseEnv().status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("MASTER_PORT='99999'")));
}

TEST_F(EnvTest, FromEnvReportsEnvErrorsThenMissingBackends) {
  EXPECT_THAT(CreateCommunicatorFromEnv().status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is not set")));
  Set("RANK", "0");
  Set("WORLD_SIZE", "1");
  EXPECT_THAT(CreateCommunicatorFromEnv().status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no comm backend is linked")));
}

}  // namespace
}  // namespace fairscale::comm
