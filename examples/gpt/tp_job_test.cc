// --tensor_parallel: the main job with its GPT split over tensor-parallel groups (TpGpt) against
// the dense job (processes over tcp): the same per-step losses; bad configurations.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_matchers.h"
#include "comm/testing/rank_runner.h"
#include "examples/gpt/data.h"
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

// trainer_test.cc's TinyConfig with the replicas all-reducing (strategy no_shard).
TrainConfig TinyConfig() {
  TrainConfig c;
  c.steps = 8, c.batch = 4, c.seq = 16, c.width = 32, c.blocks = 2, c.heads = 2;
  c.lr = 1e-2, c.warmup_steps = 2, c.grad_clip = 0.5;
  c.precision = "fp32", c.strategy = "no_shard";
  c.eval_every = 0, c.eval_batches = 1, c.sample_tokens = 0, c.progress = false;
  c.threads = 1;
  return c;
}

// The vocabulary (the corpus's characters) must split over T = 2.
TEST(TensorParallelJobTest, VocabularySplitsOverTwo) {
  EXPECT_EQ(CharTokenizer(Corpus()).vocab_size() % 2, 0) << CharTokenizer(Corpus()).vocab_size();
}

// T = 2 at 2 ranks (1 replica) gives the dense job's losses at 1 rank; T = 2 at 4 ranks
// (2 replicas, replica k reading rank k's batch) those of the dense job at 2 ranks, with FSDP
// sharding each rank's slices over the replicas (full_shard) or the replicas all-reducing their
// gradients (no_shard): the TpGpt is loaded from the dense Gpt of the seed, its loss is the dense
// cross-entropy, the replicas' averaged gradients the 2-rank average, and the clipping norm the
// whole model's (grad_clip 0.5 clips here).
TEST(TensorParallelJobTest, MatchesTheDenseJob) {
  const TrainConfig dense = TinyConfig();
  TrainConfig tp = dense;
  tp.tensor_parallel = 2;
  TrainConfig tp_fsdp = tp;
  tp_fsdp.strategy = "full_shard";
  tp_fsdp.sample_tokens = 8;  // the sample's forward runs through the FSDP root on every rank
  const JobOutput ref1 = RunJob(dense, 1, "tp_ref1");
  const JobOutput tp2 = RunJob(tp, 2, "tp_2x1");
  const JobOutput ref2 = RunJob(dense, 2, "tp_ref2");
  const JobOutput tp4 = RunJob(tp, 4, "tp_2x2");
  const JobOutput tp4_fsdp = RunJob(tp_fsdp, 4, "tp_2x2_fsdp");
  if (comm::testing::IsRankProcess()) return;
  ASSERT_EQ(ref1.losses.size(), 8u);
  ASSERT_EQ(ref2.losses.size(), 8u);
  const double max_diff =
      std::max({ExpectSameLosses(tp2, ref1, "T = 2 x 1 replica"),
                ExpectSameLosses(tp4, ref2, "T = 2 x 2 replicas, no_shard"),
                ExpectSameLosses(tp4_fsdp, ref2, "T = 2 x FSDP 2 (full_shard)")});
  std::printf(
      "tensor parallel vs dense: max |loss difference| %.3g over %zu steps; 2x1 loss "
      "%.4f -> %.4f, 2x2 %.4f -> %.4f, 2 x FSDP 2 %.4f -> %.4f\n",
      max_diff, ref1.losses.size(), tp2.losses.front(), tp2.losses.back(), tp4.losses.front(),
      tp4.losses.back(), tp4_fsdp.losses.front(), tp4_fsdp.losses.back());
  for (const JobOutput* out : {&tp2, &tp4, &tp4_fsdp}) {
    EXPECT_LT(out->losses.back(), out->losses.front() - 0.3);
  }
}

// A TP = 2 x FSDP 2 run stopped after step 4 and resumed at 2 ranks (T = 2, 1 replica) continues
// as the dense job stopped at 2 ranks and resumed at 1: one FSDP checkpoint per tensor rank
// ("model/stage<r>/"), resharded over the replicas; the full-parameter hash recorded at the
// save is the one found after loading.
TEST(TensorParallelJobTest, ResumesWithAnotherReplicaCount) {
  namespace fs = std::filesystem;
  const std::string tmp = fairscale::testing::TmpPath("tp_job_test_resume");
  JobOutput runs[2][2];  // [dense, tp][first, resumed]
  for (int v = 0; v < 2; ++v) {
    TrainConfig first = TinyConfig();
    first.strategy = "full_shard";
    first.tensor_parallel = v == 0 ? 1 : 2;
    first.checkpoint_every = 4, first.stop_after = 4;
    first.checkpoint_dir = absl::StrCat(tmp, "/ck", v);
    if (!comm::testing::IsRankProcess()) fs::remove_all(first.checkpoint_dir);
    const std::string name = absl::StrCat("tp_resume", v);
    runs[v][0] = RunJob(first, 2 * static_cast<int>(first.tensor_parallel), name);
    TrainConfig second = first;
    second.stop_after = 0, second.resume = ResumeMode::kRequired;
    runs[v][1] = RunJob(second, static_cast<int>(first.tensor_parallel), name);
  }
  if (comm::testing::IsRankProcess()) return;
  const JobOutput& ref = runs[0][1];
  const JobOutput& saved = runs[1][0];
  const JobOutput& got = runs[1][1];
  ASSERT_EQ(ref.losses.size(), 8u);
  ASSERT_EQ(got.losses.size(), 8u);
  ExpectSameLosses(got, ref, "TP 2 x FSDP 2 -> TP 2 x 1");
  ASSERT_EQ(saved.checkpoints.size(), 1u);
  using Kinds = std::map<std::string, std::string>;
  EXPECT_EQ(saved.checkpoints[0]["items"].get<Kinds>(),
            (Kinds{{"model", "stages/fsdp_sharded"}, {"trainer", "json"}}));
  ASSERT_EQ(got.resumes.size(), 1u);
  EXPECT_EQ(got.resumes[0]["from_world_size"], 4);
  EXPECT_EQ(got.resumes[0]["world_size"], 2);
  EXPECT_EQ(got.resumes[0]["full_param_fnv1a64"], saved.checkpoints[0]["full_param_fnv1a64"]);
  for (int r = 0; r < 2; ++r) {
    const std::string dir = absl::StrCat(tmp, "/ck1/step_00000008/model/stage", r);
    EXPECT_TRUE(fs::exists(dir + "/manifest.json")) << dir;
    EXPECT_TRUE(fs::exists(dir + "/rank00000.shard")) << dir;
  }
}

// Tensor x pipeline: T = 2 x 2 stages at 4 ranks (each tensor rank runs its own pipe over the
// ranks with its tensor rank; the last stage scores its vocabulary shard) gives the dense job's
// losses at 1 rank; a run stopped after step 4 and resumed at 4 ranks (one checkpoint stage per
// (stage, tensor rank): "model/stage0..3") gives bitwise the uninterrupted run's losses.
TEST(TensorParallelJobTest, TensorTimesPipeline) {
  namespace fs = std::filesystem;
  const std::string tmp = fairscale::testing::TmpPath("tp_job_test_pipe");
  const TrainConfig dense = TinyConfig();
  TrainConfig tp = dense;
  tp.tensor_parallel = 2, tp.pipeline_stages = 2, tp.pipeline_chunks = 2;
  tp.checkpoint_dir = tmp + "/whole";
  tp.overwrite_checkpoints = true;
  const JobOutput ref = RunJob(dense, 1, "tp_pipe_ref");
  const JobOutput whole = RunJob(tp, 4, "tp_pipe_whole");
  TrainConfig first = tp;
  first.checkpoint_dir = tmp + "/split";
  first.checkpoint_every = 4, first.stop_after = 4;
  RunJob(first, 4, "tp_pipe_split");
  TrainConfig second = first;
  second.stop_after = 0, second.resume = ResumeMode::kRequired;
  second.overwrite_checkpoints = false;
  const JobOutput resumed = RunJob(second, 4, "tp_pipe_split");
  if (comm::testing::IsRankProcess()) return;
  ASSERT_EQ(ref.losses.size(), 8u);
  const double diff = ExpectSameLosses(whole, ref, "T = 2 x 2 stages");
  std::printf("tensor x pipeline vs dense: max |loss difference| %.3g\n", diff);
  EXPECT_LT(whole.losses.back(), whole.losses.front() - 0.3);
  EXPECT_EQ(resumed.losses, whole.losses);
  ASSERT_EQ(resumed.resumes.size(), 1u);
  for (int s = 0; s < 4; ++s) {
    const std::string f = absl::StrCat(tmp, "/split/step_00000008/model/stage", s, "/module.pt");
    EXPECT_TRUE(fs::exists(f)) << f;
  }
}

TEST(TensorParallelJobTest, RejectsBadConfigurations) {
  TrainConfig c = TinyConfig();
  c.tensor_parallel = 2;
  EXPECT_OK(c.Validate());
  EXPECT_THAT(CheckBeforeLaunch(c, 3),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("tensor_parallel 2"), HasSubstr("rank count 3"))));
  TrainConfig bad = c;
  bad.strategy = "hybrid_shard";
  EXPECT_THAT(bad.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("full_shard, shard_grad_op or no_shard")));
  bad = c;
  bad.precision = "bf16";
  EXPECT_THAT(bad.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("precision must be fp32")));
  bad = c;
  bad.data_parallel = "sdp";
  EXPECT_THAT(bad.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("data_parallel fsdp")));
  bad = c;
  bad.pipeline_stages = 2;
  bad.pipeline_balance = "size";
  EXPECT_THAT(bad.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pipeline_balance even")));
  bad.pipeline_balance = "even";
  EXPECT_OK(bad.Validate());
  EXPECT_THAT(CheckBeforeLaunch(bad, 6),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor_parallel 2 x pipeline_stages 2 does not divide")));
  // Resuming a tensor-parallel checkpoint without --tensor_parallel (or with another T) is refused
  // before anything loads, naming the flag.
  EXPECT_THAT(ResumeScheduleSteps(TinyConfig(), "/ck/step_4", 4, c.ToJson()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("tensor_parallel = 2"), HasSubstr("--tensor_parallel=2"))));
  TrainConfig t4 = c;
  t4.tensor_parallel = 4;
  EXPECT_THAT(ResumeScheduleSteps(t4, "/ck/step_4", 4, c.ToJson()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("tensor_parallel = 2")));
  EXPECT_OK(ResumeScheduleSteps(c, "/ck/step_4", 4, c.ToJson()).status());
  bad = c;
  bad.tensor_parallel = 0;
  EXPECT_THAT(bad.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("tensor_parallel must be >= 1")));
  bad = c;
  bad.tensor_parallel = 4;  // heads 2
  EXPECT_THAT(bad.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("does not divide heads 2")));
}

}  // namespace
}  // namespace fairscale::examples::gpt
