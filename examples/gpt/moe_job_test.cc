// --moe_experts: the main job with every odd block's MLP a mixture of experts (experts spread
// over the ranks, FSDP sharding the rest; processes over tcp): the loss falls, the gates' aux
// loss is logged, a run stopped after step 4 and resumed gives bitwise the uninterrupted run's
// losses and parameters (the experts and their Adam state are restored per rank, the gates'
// noise is seeded per step); bad configurations are clear errors.
#include <map>
#include <string>

#include "base/status_matchers.h"
#include "comm/testing/rank_runner.h"
#include "examples/gpt/job_testing.h"
#include "examples/gpt/trainer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/tmp.h"

namespace fairscale::examples::gpt {
namespace {

using ::fairscale::base::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

// trainer_test.cc's TinyConfig (bf16 compute over f32 masters, full_shard) with 4 experts.
TrainConfig MoeConfig() {
  TrainConfig c;
  c.steps = 8, c.batch = 4, c.seq = 16, c.width = 32, c.blocks = 2, c.heads = 2;
  c.lr = 1e-2, c.warmup_steps = 2, c.grad_clip = 0.5;
  c.eval_every = 0, c.eval_batches = 1, c.sample_tokens = 0, c.progress = false;
  c.threads = 1;
  c.moe_experts = 4;
  return c;
}

TEST(MoeJobTest, TrainsAndResumesBitwise) {
  const std::string tmp = fairscale::testing::TmpPath("moe_job_test");
  TrainConfig whole = MoeConfig();
  whole.checkpoint_dir = tmp + "/whole";
  whole.sample_tokens = 8;  // the sample's forward runs the experts on every rank in lockstep
  whole.overwrite_checkpoints = true;
  const JobOutput full = RunJob(whole, 2, "moe_whole");
  TrainConfig first = whole;
  first.checkpoint_dir = tmp + "/split";
  first.checkpoint_every = 4, first.stop_after = 4;
  const JobOutput part = RunJob(first, 2, "moe_split");
  TrainConfig second = first;
  second.stop_after = 0, second.resume = ResumeMode::kRequired;
  second.overwrite_checkpoints = false;
  const JobOutput resumed = RunJob(second, 2, "moe_split");
  if (comm::testing::IsRankProcess()) return;
  ASSERT_EQ(full.losses.size(), 8u);
  EXPECT_LT(full.losses.back(), full.losses.front() - 0.3);
  ASSERT_TRUE(full.final_record.is_object());
  ASSERT_EQ(resumed.losses.size(), 8u);
  EXPECT_EQ(resumed.losses, full.losses);
  ASSERT_TRUE(resumed.final_record.is_object());
  EXPECT_EQ(resumed.final_record["param_fnv1a64"], full.final_record["param_fnv1a64"]);
  EXPECT_EQ(resumed.final_record["full_param_fnv1a64"], full.final_record["full_param_fnv1a64"]);
  ASSERT_EQ(part.checkpoints.size(), 1u);
  using Kinds = std::map<std::string, std::string>;
  EXPECT_EQ(part.checkpoints[0]["items"].get<Kinds>(),
            (Kinds{{"model", "fsdp_sharded"},
                   {"experts", "stages/module"},
                   {"expert_optimizer", "stages/optimizer"},
                   {"trainer", "json"}}));
  ASSERT_EQ(resumed.resumes.size(), 1u);
  EXPECT_EQ(resumed.resumes[0]["full_param_fnv1a64"], part.checkpoints[0]["full_param_fnv1a64"]);
}

TEST(MoeJobTest, RejectsBadConfigurations) {
  TrainConfig c = MoeConfig();
  EXPECT_OK(c.Validate());
  EXPECT_OK(CheckBeforeLaunch(c, 4));
  EXPECT_THAT(CheckBeforeLaunch(c, 3),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("moe_experts 4"), HasSubstr("rank count 3"))));
  TrainConfig bad = c;
  bad.blocks = 1;
  EXPECT_THAT(bad.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("needs blocks >= 2")));
  bad = c;
  bad.tensor_parallel = 2, bad.precision = "fp32";
  EXPECT_THAT(bad.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("without pipeline or tensor parallelism")));
  bad = c;
  bad.checkpoint_activations = "all";
  EXPECT_THAT(bad.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("would route again")));
  bad = c;
  bad.moe_experts = -1;
  EXPECT_THAT(bad.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("moe_experts must be >= 0")));
}

}  // namespace
}  // namespace fairscale::examples::gpt
