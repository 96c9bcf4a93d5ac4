// TrainConfig::fault_tolerant's checks (Validate, CheckBeforeLaunch) and the group
// communicator's name. The mode itself runs as processes in //integration_tests:ft_job_test.
#include <string>

#include "base/status_matchers.h"
#include "examples/gpt/ft_trainer.h"
#include "examples/gpt/trainer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::examples::gpt {
namespace {

using base::testing::StatusIs;
using ::testing::HasSubstr;

TrainConfig FtConfig() {
  TrainConfig c;
  c.fault_tolerant = true;
  c.strategy = "hybrid_shard";
  c.hybrid_shard_group_size = 2;
  c.checkpoint_dir.clear();
  return c;
}

TEST(FtConfigTest, AcceptsHybridShardWithGroups) {
  EXPECT_OK(FtConfig().Validate());
  TrainConfig c = FtConfig();
  c.hybrid_shard_group_size = 1;  // plain data-parallel replicas
  EXPECT_OK(c.Validate());
}

TEST(FtConfigTest, NamesTheFlagsItNeeds) {
  TrainConfig c = FtConfig();
  c.strategy = "full_shard";
  EXPECT_THAT(c.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--fault_tolerant needs --data_parallel=fsdp "
                                 "--strategy=hybrid_shard --hybrid_shard_group_size")));
  c = FtConfig();
  c.hybrid_shard_group_size = 0;  // "one group per host" is not a replica-group layout
  EXPECT_THAT(c.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("--hybrid_shard_group_size=0")));
}

TEST(FtConfigTest, RejectsWhatItDoesNotSupport) {
  const auto rejects = [](TrainConfig c, const std::string& flag) {
    EXPECT_THAT(c.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(flag)))
        << flag;
  };
  TrainConfig c = FtConfig();
  c.pipeline_stages = 2;
  rejects(c, "--pipeline_stages");
  c = FtConfig(), c.tensor_parallel = 2;
  rejects(c, "--tensor_parallel");
  c = FtConfig(), c.moe_experts = 2;
  rejects(c, "--moe_experts");
  c = FtConfig(), c.deterministic = true, c.micro_batches = 4;
  rejects(c, "--deterministic");
  c = FtConfig(), c.loss_scale = true;
  rejects(c, "--loss_scale");
  c = FtConfig(), c.optimizer_offload = "disk", c.offload_dir = "/tmp/x";
  rejects(c, "--optimizer_offload");
  c = FtConfig(), c.checkpoint_dir = "/tmp/ckpt";
  rejects(c, "--checkpoint_dir=none");
  c = FtConfig(), c.resume = ResumeMode::kAuto;
  rejects(c, "no --resume");
  c = FtConfig(), c.ft_heartbeat_ms = 500, c.ft_dead_after_ms = 600;
  rejects(c, "--ft_dead_after_ms=600");
  c = FtConfig(), c.ft_min_groups = 0;
  rejects(c, "--ft_min_groups=0");
}

TEST(FtConfigTest, CheckBeforeLaunchCountsTheGroups) {
  TrainConfig c = FtConfig();
  c.metrics_path.clear(), c.plot_path.clear();
  c.ft_min_groups = 3;
  EXPECT_THAT(CheckBeforeLaunch(c, 4),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--ft_min_groups=3 is more than the 2 replica groups")));
  c.ft_min_groups = 2;
  EXPECT_OK(CheckBeforeLaunch(c, 4));
  EXPECT_THAT(CheckBeforeLaunch(c, 3), StatusIs(absl::StatusCode::kInvalidArgument,
                                                HasSubstr("does not divide the rank count 3")));
}

TEST(FtConfigTest, GroupCommunicatorNamePerIncarnation) {
  EXPECT_EQ(FtGroupCommName(1, 0), "ft/g1/i0");
  EXPECT_NE(FtGroupCommName(1, 1), FtGroupCommName(1, 0));
}

}  // namespace
}  // namespace fairscale::examples::gpt
