// The main job's --deterministic mode: TrainRank at 1, 2, 3 and 4 ranks (real processes over
// tcp) on the same global batch of micro-batches gives bitwise the same per-step train losses,
// validation loss and full-parameter hash, in the fsdp modes (bf16 and fp32, sharded, hybrid,
// unsharded, with loss scaling) and the sdp mode; a run saved at 4 ranks and resumed at 2 ends
// where the uninterrupted run does. Correctness against an independent run: with M micro-batches
// it reads the data of the default mode at M ranks, whose losses it matches within rounding
// (and differs from in the last bits: the negative control).
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
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
using ::testing::HasSubstr;

struct Job {
  std::vector<double> losses;  // train loss by step
  double val_loss = 0;
  std::string full_hash;  // rank 0's full-parameter hash
};

TrainConfig Tiny(int64_t micro_batches) {
  TrainConfig c;
  c.steps = 10, c.batch = 2, c.seq = 16, c.width = 32, c.blocks = 2, c.heads = 2;
  c.lr = 1e-2, c.warmup_steps = 2, c.grad_clip = 0.5;
  c.precision = "fp32", c.strategy = "full_shard";
  c.eval_every = 0, c.eval_batches = 1, c.sample_tokens = 0, c.progress = false;
  c.deterministic = micro_batches > 0;
  c.micro_batches = micro_batches;
  c.threads = 1;
  return c;
}

// The job at `world` ranks (job_testing.h): the losses, the validation loss and rank 0's
// full-parameter hash (empty in the rank processes).
Job RunDet(TrainConfig config, int world, const std::string& name) {
  const JobOutput out = RunJob(std::move(config), world, "det_" + name);
  if (comm::testing::IsRankProcess()) return {};
  Job job;
  job.losses = out.losses;
  if (out.final_record.is_object()) {
    job.val_loss = out.final_record["val_loss"].get<double>();
    job.full_hash = out.final_record["full_param_fnv1a64"][0].get<std::string>();
  }
  return job;
}

void ExpectSameBits(const Job& got, const Job& want, const std::string& what) {
  ASSERT_EQ(got.losses.size(), want.losses.size()) << what;
  for (size_t i = 0; i < got.losses.size(); ++i) {
    EXPECT_EQ(got.losses[i], want.losses[i]) << what << ", step " << i + 1;
  }
  EXPECT_EQ(got.val_loss, want.val_loss) << what;
  EXPECT_EQ(got.full_hash, want.full_hash) << what;
  EXPECT_FALSE(want.full_hash.empty()) << what;
}

struct Mode {
  std::string name;
  std::string data_parallel = "fsdp";
  std::string strategy = "full_shard";
  std::string precision = "fp32";
  bool loss_scale = false;
  int64_t group = 0;  // hybrid_shard_group_size (-1 in the resume test: a 2-stage pipeline)
};

class GptDeterministic : public ::testing::TestWithParam<Mode> {};

TEST_P(GptDeterministic, BitwiseEqualAtOneToFourRanks) {
  const Mode& m = GetParam();
  TrainConfig c = Tiny(12);
  c.data_parallel = m.data_parallel, c.strategy = m.strategy, c.precision = m.precision;
  c.loss_scale = m.loss_scale;
  const Job one = RunDet(c, 1, m.name + "_1");
  std::vector<Job> others;
  for (int world : {2, 3, 4}) {
    TrainConfig w = c;
    // Hybrid: groups of `group` ranks where they divide the world, else one group per rank.
    if (m.group > 0) w.hybrid_shard_group_size = world % m.group == 0 ? m.group : 1;
    others.push_back(RunDet(w, world, absl::StrCat(m.name, "_", world)));
  }
  if (comm::testing::IsRankProcess()) return;
  ASSERT_EQ(one.losses.size(), 10u);
  EXPECT_LT(one.losses.back(), one.losses.front());  // it learns
  for (size_t i = 0; i < others.size(); ++i) {
    ExpectSameBits(others[i], one, absl::StrCat(m.name, " at ", i + 2, " ranks"));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Modes, GptDeterministic,
    ::testing::Values(Mode{"full_shard_bf16", "fsdp", "full_shard", "bf16"},
                      Mode{"hybrid_zero2_loss_scale", "fsdp", "hybrid_shard_zero2", "fp32", true, 2},
                      Mode{"no_shard", "fsdp", "no_shard"},
                      Mode{"sdp", "sdp", "full_shard"}),
    [](const auto& info) { return info.param.name; });

// The pipeline mode (2 stages, whole stages) at 2 ranks (one pipeline, 1F1B, 4 chunks) and at 4
// ranks (two replicas, GPipe, 2 chunks each) trains the unpipelined job's model bitwise: the
// same per-micro-batch gradients summed on the same tree, the same exact norm.
TEST(GptDeterministicPipeline, MatchesTheUnpipelinedJobBitwise) {
  TrainConfig plain = Tiny(4);
  plain.strategy = "no_shard";
  TrainConfig piped = plain;
  piped.pipeline_stages = 2;
  const Job one = RunDet(plain, 1, "pipe_plain_1");
  const Job two = RunDet(piped, 2, "pipe_2x1");
  piped.pipeline_schedule = "gpipe";
  const Job four = RunDet(piped, 4, "pipe_2x2");
  if (comm::testing::IsRankProcess()) return;
  // The pipeline's ranks each hash their own stage: compare the losses (every step, and the
  // validation loss), and the two pipelined runs' stage-0 hashes.
  Job one_losses = one, two_losses = two, four_losses = four;
  one_losses.full_hash = two_losses.full_hash = four_losses.full_hash = "-";
  ExpectSameBits(two_losses, one_losses, "2 stages x 1 replica vs unpipelined");
  ExpectSameBits(four_losses, one_losses, "2 stages x 2 replicas vs unpipelined");
  EXPECT_EQ(four.full_hash, two.full_hash);
}

// With M = 4 micro-batches the deterministic job reads the default mode's data at 4 ranks: the
// losses agree within f32 rounding, the bits do not (so the comparisons above can fail).
TEST(GptDeterministicControl, MatchesTheDefaultModeWithinRoundingButNotBitwise) {
  const Job det1 = RunDet(Tiny(4), 1, "control_det_1");
  const Job det2 = RunDet(Tiny(4), 2, "control_det_2");
  const Job plain4 = RunDet(Tiny(0), 4, "control_default_4");
  if (comm::testing::IsRankProcess()) return;
  ExpectSameBits(det2, det1, "M=4 at 2 ranks");
  ASSERT_EQ(plain4.losses.size(), det1.losses.size());
  bool differs = det1.full_hash != plain4.full_hash;
  for (size_t i = 0; i < det1.losses.size(); ++i) {
    EXPECT_NEAR(det1.losses[i], plain4.losses[i], 1e-4) << "step " << i + 1;
    differs = differs || det1.losses[i] != plain4.losses[i];
  }
  EXPECT_TRUE(differs);
}

// Saved at 4 ranks after step 5, resumed at 2: the same losses from step 6 and the same final
// parameters as the uninterrupted run at 3 ranks (fsdp bf16 ZeRO-2, sdp, and the pipeline: 2
// stages x 2 replicas resumed as 2 x 1).
class GptDeterministicResume : public ::testing::TestWithParam<Mode> {};

TEST_P(GptDeterministicResume, SavedAtFourRanksResumedAtTwoEndsWhereTheUninterruptedRunDoes) {
  const Mode& m = GetParam();
  const std::string dir = fairscale::testing::TmpPath("det_resume_" + m.name);
  // Rank processes re-run the test up to their RunProcesses call: only the parent cleans up.
  if (!comm::testing::IsRankProcess()) std::filesystem::remove_all(dir);
  TrainConfig c = Tiny(12);
  c.data_parallel = m.data_parallel, c.strategy = m.strategy, c.precision = m.precision;
  const bool pipe = m.group < 0;  // a pipeline of 2 stages
  if (pipe) c.pipeline_stages = 2;
  const Job whole = RunDet(c, pipe ? 2 : 3, "resume_whole_" + m.name);
  TrainConfig first = c;
  first.checkpoint_dir = dir, first.checkpoint_every = 5, first.stop_after = 5;
  RunDet(first, 4, "resume_part_" + m.name);
  TrainConfig second = c;
  second.checkpoint_dir = dir, second.checkpoint_every = 5, second.resume = ResumeMode::kRequired;
  // Continues the same metrics file: all 10 steps' losses.
  const Job resumed = RunDet(second, 2, "resume_part_" + m.name);
  if (comm::testing::IsRankProcess()) return;
  ExpectSameBits(resumed, whole, m.name + " saved at 4 ranks, resumed at 2");
}

INSTANTIATE_TEST_SUITE_P(
    Modes, GptDeterministicResume,
    ::testing::Values(Mode{"shard_grad_op_bf16", "fsdp", "shard_grad_op", "bf16"},
                      Mode{"sdp", "sdp", "full_shard"},
                      Mode{"pipe_no_shard", "fsdp", "no_shard", "fp32", false, -1}),
    [](const auto& info) { return info.param.name; });

TEST(GptDeterministicConfig, BadInputIsRejectedBeforeLaunch) {
  TrainConfig c = Tiny(12);
  EXPECT_THAT(CheckBeforeLaunch(c, 5),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--micro_batches=12 cannot be split evenly over 5 ranks")));
  EXPECT_THAT(CheckBeforeLaunch(c, 5), StatusIs(absl::StatusCode::kInvalidArgument,
                                                HasSubstr("(1, 2, 3, 4, 6, 12)")));
  c.micro_batches = 0;
  EXPECT_THAT(c.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("--deterministic needs --micro_batches=M")));
  c = Tiny(12);
  c.threads = 2;
  EXPECT_THAT(c.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--threads=2")));
  c = Tiny(0);
  c.micro_batches = 8;
  EXPECT_THAT(c.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("--micro_batches=8 is for --deterministic")));
  c = Tiny(12);
  c.data_parallel = "sdp", c.oss_partition = "flat";
  EXPECT_THAT(c.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("needs oss_partition greedy")));
  // A checkpoint of a deterministic run records it: a default-mode resume is refused.
  EXPECT_EQ(Tiny(12).ToJson()["micro_batches"], 12);
  EXPECT_FALSE(Tiny(0).ToJson().contains("deterministic"));
}

}  // namespace
}  // namespace fairscale::examples::gpt
