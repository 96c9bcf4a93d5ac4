// TrainRank at 2 ranks (real processes over tcp, fp32) against a single-process reference
// written here with plain LibTorch: the same Gpt unwrapped, trained with Adam on the two ranks'
// batches concatenated, the same learning-rate schedule and global gradient clipping. FSDP's
// mean of the per-rank gradients equals the gradient of the mean loss over the concatenated
// batch, so the per-step losses must agree (up to f32 reduction order). Also the schedule.
#include "examples/gpt/trainer.h"

#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/registry.h"
#include "comm/testing/rank_runner.h"
#include "examples/gpt/data.h"
#include "examples/gpt/job_testing.h"
#include "examples/gpt/model.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/tmp.h"

namespace fairscale::examples::gpt {
namespace {

TEST(LearningRateTest, WarmupThenCosine) {
  TrainConfig c;
  c.lr = 1.0, c.steps = 110, c.warmup_steps = 10, c.min_lr_ratio = 0.1;
  EXPECT_DOUBLE_EQ(LearningRate(c, 1), 0.1);
  EXPECT_DOUBLE_EQ(LearningRate(c, 5), 0.5);
  EXPECT_DOUBLE_EQ(LearningRate(c, 10), 1.0);
  EXPECT_NEAR(LearningRate(c, 60), 0.55, 1e-12);  // halfway: (1 + 0.1) / 2
  EXPECT_NEAR(LearningRate(c, 110), 0.1, 1e-12);
  c.warmup_steps = 0;
  EXPECT_NEAR(LearningRate(c, 0), 1.0, 1e-12);
}

TEST(TrainConfigTest, ValidateNamesTheField) {
  TrainConfig c;
  c.width = 30, c.heads = 4;
  EXPECT_THAT(c.Validate(), base::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                                    ::testing::HasSubstr("heads")));
  c = TrainConfig();
  c.strategy = "zero3";
  EXPECT_THAT(c.Validate(), base::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                                    ::testing::HasSubstr("strategy 'zero3'")));
  c = TrainConfig();
  for (const char* bad : {"some", "every:0", "every:", "every:2x", "All"}) {
    c.checkpoint_activations = bad;
    EXPECT_THAT(c.Validate(),
                base::testing::StatusIs(
                    absl::StatusCode::kInvalidArgument,
                    ::testing::HasSubstr(absl::StrCat("checkpoint_activations '", bad,
                                                      "': expected none, all or every:K"))));
  }
  for (const char* good : {"none", "all", "every:1", "every:3"}) {
    c.checkpoint_activations = good;
    EXPECT_OK(c.Validate()) << good;
  }
  c = TrainConfig();
  c.optimizer_offload = "ram";
  EXPECT_THAT(c.Validate(), base::testing::StatusIs(
                                absl::StatusCode::kInvalidArgument,
                                ::testing::HasSubstr("optimizer_offload 'ram': expected none or disk")));
  c.optimizer_offload = "disk";
  EXPECT_THAT(c.Validate(), base::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                                    ::testing::HasSubstr("offload_dir")));
  c.offload_dir = "/tmp/x";
  EXPECT_OK(c.Validate());
  c.data_parallel = "sdp", c.precision = "fp32";
  EXPECT_THAT(c.Validate(),
              base::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                      ::testing::HasSubstr("optimizer_offload disk needs "
                                                           "data_parallel fsdp, got sdp")));
  c = TrainConfig();
  c.precision = "fp16";
  EXPECT_THAT(c.Validate(), base::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                                    ::testing::HasSubstr("float16")));
}

TrainConfig TinyConfig(const std::string& metrics) {
  TrainConfig c;
  c.steps = 8, c.batch = 4, c.seq = 16, c.width = 32, c.blocks = 2, c.heads = 2;
  c.lr = 1e-2, c.warmup_steps = 2, c.grad_clip = 0.5;
  c.precision = "fp32", c.strategy = "full_shard";
  c.eval_every = 0, c.eval_batches = 1, c.sample_tokens = 0, c.progress = false;
  c.threads = 1;
  c.metrics_path = metrics;
  return c;
}

TEST(TrainRankTest, TwoRanksMatchASingleProcessReference) {
  const std::string metrics = fairscale::testing::TmpPath("trainer_test_metrics.jsonl");
  const TrainConfig config = TinyConfig(metrics);
  std::vector<absl::Status> st = comm::testing::RunProcesses(
      2,
      [&](int rank) -> absl::Status {
        FS_ASSIGN_OR_RETURN(std::shared_ptr<comm::Communicator> comm,
                            comm::CreateCommunicator(
                                "tcp", comm::testing::RankConfig(absl::Seconds(30))));
        return TrainRank(config, comm).status();
      },
      absl::Seconds(90));
  if (comm::testing::IsRankProcess()) return;
  for (int r = 0; r < 2; ++r) ASSERT_OK(st[r]) << "rank " << r;

  std::vector<double> got;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (j["type"] == "train") got.push_back(j["loss"].get<double>());
  }
  ASSERT_EQ(got.size(), 8u);

  // The reference.
  at::set_num_threads(1);
  CharTokenizer tok(Corpus());
  TokenData data(tok, Corpus());
  torch::manual_seed(config.seed);
  Gpt model(GptConfig()
                .vocab(tok.vocab_size())
                .seq(config.seq)
                .width(config.width)
                .heads(config.heads)
                .blocks(config.blocks));
  torch::optim::Adam opt(model->parameters(),
                         torch::optim::AdamOptions(config.lr).betas({0.9, 0.99}));
  for (int64_t step = 1; step <= config.steps; ++step) {
    for (auto& group : opt.param_groups()) {
      static_cast<torch::optim::AdamOptions&>(group.options()).lr(LearningRate(config, step));
    }
    std::vector<int64_t> rows;
    for (int rank = 0; rank < 2; ++rank) {
      std::vector<int64_t> b = data.Batch(config.seed, step, rank, Split::kTrain, config.batch,
                                          config.seq);
      rows.insert(rows.end(), b.begin(), b.end());
    }
    at::Tensor t = torch::tensor(rows, at::kLong).view({2 * config.batch, config.seq + 1});
    opt.zero_grad();
    at::Tensor logits = model(t.narrow(1, 0, config.seq));
    at::Tensor loss = torch::nn::functional::cross_entropy(
        logits.reshape({-1, tok.vocab_size()}), t.narrow(1, 1, config.seq).reshape({-1}));
    loss.backward();
    torch::nn::utils::clip_grad_norm_(model->parameters(), config.grad_clip);
    opt.step();
    EXPECT_NEAR(got[step - 1], loss.item<double>(), 1e-4) << "step " << step;
  }
  EXPECT_LT(got.back(), got.front() - 0.3);  // and it learns
}

// --pipeline_stages: the Gpt cut into 2 stages (1f1b, 2 micro-batches) at 2 ranks (1 replica)
// must give the per-step losses of the unpipelined fp32 run at 1 rank, and 2 stages x 2
// replicas at 4 ranks those of the unpipelined run at 2 ranks (replica k trains rank k's batch):
// with equal micro-batches the mean of the micro-batch means is the batch mean, the replicas'
// averaged gradients the 2-rank average, and the clipping norm the whole model's.
TEST(TrainRankTest, PipelineMatchesTheUnpipelinedRun) {
  TrainConfig plain = TinyConfig("");
  plain.strategy = "no_shard";
  TrainConfig piped = plain;
  piped.pipeline_stages = 2, piped.pipeline_chunks = 2;
  const JobOutput ref1 = RunJob(plain, 1, "pipe_ref1");
  const JobOutput pipe2 = RunJob(piped, 2, "pipe_2x1");
  piped.pipeline_schedule = "gpipe";
  const JobOutput ref2 = RunJob(plain, 2, "pipe_ref2");
  const JobOutput pipe4 = RunJob(piped, 4, "pipe_2x2");
  if (comm::testing::IsRankProcess()) return;
  ASSERT_EQ(pipe2.losses.size(), ref1.losses.size());
  ASSERT_EQ(pipe4.losses.size(), ref2.losses.size());
  const double max_diff = std::max(ExpectSameLosses(pipe2, ref1, "2 stages x 1"),
                                   ExpectSameLosses(pipe4, ref2, "2 stages x 2"));
  std::printf("pipeline vs unpipelined: max |loss difference| %.3g over %zu steps; 2x1 loss "
              "%.4f -> %.4f, 2x2 %.4f -> %.4f\n",
              max_diff, ref1.losses.size(), pipe2.losses.front(), pipe2.losses.back(),
              pipe4.losses.front(), pipe4.losses.back());
  EXPECT_LT(pipe2.losses.back(), pipe2.losses.front() - 0.3);
  EXPECT_LT(pipe4.losses.back(), pipe4.losses.front() - 0.3);
  EXPECT_THAT(pipe4.final_record["mode"].get<std::string>(),
              ::testing::HasSubstr("pipe 2 stages (layers 2+2) x 2 replicas (all-reduce), gpipe"));
}

// --pipeline_schedule=interleaved --pipeline_virtual_stages=2: the Gpt (embed, 2 blocks,
// lm_head) cut into 2 ranks x 2 virtual stages of one layer each (rank 0: embed and block1,
// rank 1: block0 and lm_head), 4 micro-batches, must give the per-step losses of the unpipelined
// fp32 run at 1 rank within 1e-5.
TEST(TrainRankTest, InterleavedPipelineMatchesTheUnpipelinedRun) {
  TrainConfig plain = TinyConfig("");
  plain.strategy = "no_shard";
  TrainConfig piped = plain;
  piped.pipeline_stages = 2, piped.pipeline_chunks = 4;
  piped.pipeline_schedule = "interleaved", piped.pipeline_virtual_stages = 2;
  const JobOutput ref = RunJob(plain, 1, "interleaved_ref");
  const JobOutput inter = RunJob(piped, 2, "interleaved_2x2v");
  if (comm::testing::IsRankProcess()) return;
  ASSERT_FALSE(inter.losses.empty());
  const double max_diff = ExpectSameLosses(inter, ref, "interleaved 2 x 2 virtual");
  std::printf("interleaved pipeline vs unpipelined: max |loss difference| %.3g over %zu steps; "
              "loss %.4f -> %.4f\n",
              max_diff, ref.losses.size(), inter.losses.front(), inter.losses.back());
  EXPECT_LT(inter.losses.back(), inter.losses.front() - 0.3);
  EXPECT_THAT(inter.final_record["mode"].get<std::string>(),
              ::testing::HasSubstr("pipe 2 stages x 2 virtual (layers 1+1+1+1) x 1 replica "
                                   "(all-reduce), interleaved, 4 micro-batches"));
}

TEST(TrainConfigTest, PipelineRejectsWhatItCannotDo) {
  TrainConfig c = TinyConfig("");
  c.pipeline_stages = 2, c.strategy = "no_shard";
  EXPECT_OK(c.Validate());
  auto rejects = [](TrainConfig bad, const std::string& what) {
    EXPECT_THAT(bad.Validate(), base::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                                        ::testing::HasSubstr(what)));
  };
  TrainConfig bad = c;
  bad.precision = "bf16";
  rejects(bad, "pipeline_stages 2: precision must be fp32, or bf16 with FSDP inside the stages");
  bad = c, bad.data_parallel = "sdp";
  rejects(bad, "needs data_parallel fsdp, got sdp");
  bad = c, bad.pipeline_balance = "time";
  rejects(bad, "pipeline_balance 'time': expected even or size");
  bad = c, bad.checkpoint_activations = "every:2";
  rejects(bad, "checkpoint_activations 'every:2' with pipeline_stages > 1: expected none, all or "
               "except_last");
  bad = c, bad.optimizer_offload = "disk", bad.offload_dir = "/tmp/x";
  rejects(bad, "loss_scale and optimizer_offload are not supported with a pipeline");
  for (const char* ok : {"full_shard", "shard_grad_op"}) {
    TrainConfig fsdp_inside = c;
    fsdp_inside.strategy = ok, fsdp_inside.checkpoint_activations = "except_last";
    fsdp_inside.pipeline_balance = "size", fsdp_inside.precision = "bf16";
    EXPECT_OK(fsdp_inside.Validate()) << ok;
  }
  bad = TinyConfig(""), bad.checkpoint_activations = "except_last";  // no pipeline
  rejects(bad, "checkpoint_activations 'except_last'");
  bad = c, bad.pipeline_schedule = "zb";
  rejects(bad, "pipeline_schedule 'zb': expected 1f1b, gpipe or interleaved");
  bad = c, bad.pipeline_virtual_stages = 2;
  rejects(bad, "virtual stages = 2 needs the schedule \"interleaved\", not \"1f1b\"");
  bad = c, bad.pipeline_virtual_stages = 2, bad.pipeline_schedule = "interleaved",
  bad.pipeline_chunks = 3;
  rejects(bad, "multiple of the 2 pipeline stages, got chunks = 3");
  bad = c, bad.pipeline_virtual_stages = 3, bad.pipeline_schedule = "interleaved";
  rejects(bad, "more stages x virtual stages than layers");
  bad = c, bad.pipeline_virtual_stages = 0;
  rejects(bad, "pipeline_virtual_stages must be >= 1");
  bad = c, bad.pipeline_virtual_stages = 2, bad.pipeline_schedule = "interleaved",
  bad.strategy = "full_shard";
  rejects(bad, "pipeline_virtual_stages 2 needs strategy no_shard");
  bad = c, bad.pipeline_chunks = c.batch + 1;
  rejects(bad, "pipeline_chunks must be in [1, batch");
  bad = c, bad.pipeline_stages = 0;
  rejects(bad, "pipeline_stages must be >= 1");
}

// --pipeline_stages with FSDP inside the stages (strategy full_shard / shard_grad_op): 2 stages x
// 2 replicas at 4 ranks give the per-step losses of the unpipelined fp32 run at 2 ranks within
// 1e-5, with 1F1B + checkpoint except_last and with GPipe + checkpoint all + balance by size.
TEST(TrainRankTest, PipelineWithFsdpInsideStagesMatchesTheUnpipelinedRun) {
  TrainConfig plain = TinyConfig("");
  const JobOutput ref2 = RunJob(plain, 2, "pipe_fsdp_ref2");
  TrainConfig full = plain;
  full.pipeline_stages = 2, full.pipeline_chunks = 2, full.checkpoint_activations = "except_last";
  const JobOutput full4 = RunJob(full, 4, "pipe_fsdp_full_shard");
  TrainConfig grad_op = full;
  grad_op.strategy = "shard_grad_op", grad_op.pipeline_schedule = "gpipe";
  grad_op.checkpoint_activations = "all", grad_op.pipeline_balance = "size";
  const JobOutput grad_op4 = RunJob(grad_op, 4, "pipe_fsdp_shard_grad_op");
  if (comm::testing::IsRankProcess()) return;
  ASSERT_EQ(full4.losses.size(), ref2.losses.size());
  ASSERT_EQ(grad_op4.losses.size(), ref2.losses.size());
  const double max_diff = std::max(ExpectSameLosses(full4, ref2, "full_shard"),
                                   ExpectSameLosses(grad_op4, ref2, "shard_grad_op"));
  std::printf("pipeline+fsdp vs unpipelined: max |loss difference| %.3g over %zu steps\n",
              max_diff, ref2.losses.size());
  EXPECT_THAT(full4.final_record["mode"].get<std::string>(),
              ::testing::HasSubstr("x 2 replicas (FSDP FULL_SHARD), 1f1b"));
  EXPECT_THAT(grad_op4.final_record["mode"].get<std::string>(),
              ::testing::HasSubstr("x 2 replicas (FSDP SHARD_GRAD_OP), gpipe"));
}

// bf16 in pipeline mode (FSDP inside the stages, bf16 compute and boundary activations over f32
// master shards, gradients reduced in f32): 2 stages x 2 replicas track the unpipelined fsdp bf16
// run at 2 ranks within 5e-4 relative at every step (bf16 against bf16: the same kernels on the
// same rows, summed in another order; measured at most 1.2e-4 over the 8 steps), and the loss
// falls as much.
TEST(TrainRankTest, PipelineBf16TracksTheUnpipelinedBf16Run) {
  TrainConfig plain = TinyConfig("");
  plain.precision = "bf16";
  const JobOutput ref2 = RunJob(plain, 2, "pipe_bf16_ref2");
  TrainConfig piped = plain;
  piped.pipeline_stages = 2, piped.pipeline_chunks = 2;
  const JobOutput pipe4 = RunJob(piped, 4, "pipe_bf16_2x2");
  if (comm::testing::IsRankProcess()) return;
  ASSERT_EQ(pipe4.losses.size(), ref2.losses.size());
  double max_rel = 0;
  for (size_t i = 0; i < ref2.losses.size(); ++i) {
    EXPECT_NEAR(pipe4.losses[i], ref2.losses[i], 5e-4 * std::abs(ref2.losses[i]))
        << "step " << i + 1;
    max_rel = std::max(max_rel, std::abs(pipe4.losses[i] - ref2.losses[i]) / ref2.losses[i]);
  }
  std::printf("pipeline bf16 vs unpipelined bf16: max relative loss difference %.3g; 2x2 loss "
              "%.4f -> %.4f\n", max_rel, pipe4.losses.front(), pipe4.losses.back());
  EXPECT_LT(pipe4.losses.back(), pipe4.losses.front() - 0.3);
  EXPECT_THAT(pipe4.final_record["mode"].get<std::string>(),
              ::testing::HasSubstr("x 2 replicas (FSDP FULL_SHARD)"));
}

// Every mode's checkpoints (//train_state items, ParallelModel::add_state) restore at another
// world size. A run stopped at step 4 and resumed at half its ranks: the unpipelined fsdp run
// 2 -> 1 (the reference), a pipeline with FSDP inside its stages 2 stages x 2 replicas -> 2 x 1
// (fsdp_item per stage), a pipeline of whole stages 2 x 2 -> 2 x 1 (module_item + optimizer_item
// per stage, saved asynchronously) and sdp 2 -> 1 (module_item + oss_item, asynchronously). The
// same model, data and mean gradients, so every run's losses (steps 1-4 at the first world size,
// 5-8 at the second) match the reference within 1e-5; the full-parameter hash recorded at the
// save is the one found after loading; the files are where the items put them.
TEST(TrainRankTest, EveryModeResumesAtAnotherWorldSize) {
  namespace fs = std::filesystem;
  const std::string tmp = fairscale::testing::TmpPath("trainer_test_mode_reshard");
  struct Variant {
    std::string name;
    int world;  // of the first part; the resumed part has half
    std::function<void(TrainConfig&)> set;
  };
  const std::vector<Variant> variants = {
      {"fsdp", 2, [](TrainConfig&) {}},
      {"pipe_fsdp", 4, [](TrainConfig& c) { c.pipeline_stages = 2, c.pipeline_chunks = 2; }},
      {"pipe_whole", 4,
       [](TrainConfig& c) {
         c.pipeline_stages = 2, c.pipeline_chunks = 2, c.strategy = "no_shard";
         c.async_checkpoint = true;
       }},
      {"sdp", 2, [](TrainConfig& c) { c.data_parallel = "sdp", c.async_checkpoint = true; }},
  };
  std::vector<std::array<JobOutput, 2>> runs(variants.size());  // [first, resumed]
  for (size_t v = 0; v < variants.size(); ++v) {
    TrainConfig first = TinyConfig("");
    first.checkpoint_every = 4, first.stop_after = 4;
    first.checkpoint_dir = absl::StrCat(tmp, "/ck_", variants[v].name);
    variants[v].set(first);
    const std::string name = absl::StrCat("mode_reshard_", variants[v].name);
    if (!comm::testing::IsRankProcess()) fs::remove_all(first.checkpoint_dir);
    runs[v][0] = RunJob(first, variants[v].world, name);
    TrainConfig second = first;
    second.stop_after = 0, second.resume = ResumeMode::kRequired;
    runs[v][1] = RunJob(second, variants[v].world / 2, name);
  }
  if (comm::testing::IsRankProcess()) return;
  const JobOutput& ref = runs[0][1];
  ASSERT_EQ(ref.losses.size(), 8u);
  const std::map<std::string, std::map<std::string, std::string>> kinds = {
      {"fsdp", {{"model", "fsdp_sharded"}, {"trainer", "json"}}},
      {"pipe_fsdp", {{"model", "stages/fsdp_sharded"}, {"trainer", "json"}}},
      {"pipe_whole",
       {{"model", "stages/module"}, {"optimizer", "stages/optimizer"}, {"trainer", "json"}}},
      {"sdp", {{"model", "module"}, {"optimizer", "oss"}, {"trainer", "json"}}},
  };
  for (size_t v = 0; v < variants.size(); ++v) {
    const std::string& name = variants[v].name;
    const JobOutput& saved = runs[v][0];
    const JobOutput& got = runs[v][1];
    ASSERT_EQ(got.losses.size(), 8u) << name;
    if (v > 0) ExpectSameLosses(got, ref, name);
    ASSERT_EQ(saved.checkpoints.size(), 1u) << name;
    EXPECT_EQ(saved.checkpoints[0]["world_size"], variants[v].world) << name;
    using Kinds = std::map<std::string, std::string>;
    EXPECT_EQ(saved.checkpoints[0]["items"].get<Kinds>(), kinds.at(name)) << name;
    ASSERT_EQ(got.resumes.size(), 1u) << name;
    EXPECT_EQ(got.resumes[0]["from_world_size"], variants[v].world) << name;
    EXPECT_EQ(got.resumes[0]["world_size"], variants[v].world / 2) << name;
    EXPECT_EQ(got.resumes[0]["full_param_fnv1a64"], saved.checkpoints[0]["full_param_fnv1a64"])
        << name;
    ASSERT_EQ(got.checkpoints.size(), 2u) << name;
    EXPECT_EQ(got.checkpoints[1]["step"], 8) << name;
    EXPECT_EQ(got.checkpoints[1]["world_size"], variants[v].world / 2) << name;
    EXPECT_LT(got.losses[7], got.losses[3]) << name;
  }
  // Where the items put their files (the step-8 checkpoints at the smaller world size).
  const auto exists = [&](const std::string& variant, const std::string& file) {
    const std::string path = absl::StrCat(tmp, "/ck_", variant, "/step_00000008/", file);
    EXPECT_TRUE(fs::exists(path)) << path;
  };
  exists("fsdp", "model/rank00000.shard");
  exists("fsdp", "model/manifest.json");
  exists("fsdp", "trainer/state.json");
  exists("fsdp", "COMPLETE");
  for (int s = 0; s < 2; ++s) {
    exists("pipe_fsdp", absl::StrFormat("model/stage%d/rank00000.shard", s));
    exists("pipe_fsdp", absl::StrFormat("model/stage%d/manifest.json", s));
    exists("pipe_whole", absl::StrFormat("model/stage%d/module.pt", s));
    exists("pipe_whole", absl::StrFormat("optimizer/stage%d/optimizer.pt", s));
  }
  exists("sdp", "model/module.pt");
  exists("sdp", "optimizer/optimizer.pt");
}

// --async_checkpoint: the saves run in the background while training continues, and a run
// stopped after step 5 and resumed from its step-4 checkpoint gives bitwise the losses and final
// parameters of the uninterrupted run (fsdp at 2 ranks, a save every 2 steps).
TEST(TrainRankTest, AsyncCheckpointsResumeBitwise) {
  const std::string tmp = fairscale::testing::TmpPath("trainer_test_async");
  TrainConfig config = TinyConfig("");
  config.checkpoint_every = 2;
  config.async_checkpoint = true;
  config.checkpoint_dir = tmp + "/whole";
  config.overwrite_checkpoints = true;
  const JobOutput whole = RunJob(config, 2, "async_whole");
  TrainConfig first = config;
  first.checkpoint_dir = tmp + "/split";
  first.stop_after = 5;
  RunJob(first, 2, "async_split");
  TrainConfig second = first;
  second.stop_after = 0, second.resume = ResumeMode::kRequired;
  second.overwrite_checkpoints = false;
  const JobOutput resumed = RunJob(second, 2, "async_split");
  if (comm::testing::IsRankProcess()) return;
  ASSERT_EQ(whole.checkpoints.size(), 4u);
  for (const nlohmann::json& c : whole.checkpoints) EXPECT_EQ(c["async"], true);
  ASSERT_EQ(resumed.resumes.size(), 1u);
  EXPECT_EQ(resumed.resumes[0]["step"], 4);
  EXPECT_EQ(resumed.losses, whole.losses);
  ASSERT_TRUE(whole.final_record.is_object());
  EXPECT_EQ(resumed.final_record["param_fnv1a64"], whole.final_record["param_fnv1a64"]);
  EXPECT_EQ(resumed.final_record["full_param_fnv1a64"], whole.final_record["full_param_fnv1a64"]);
}

// --strategy=hybrid_shard --hybrid_shard_group_size=2 at 4 ranks (2 shard groups of 2, the
// gradient shards all-reduced across them) trains the same model as full_shard at 4 ranks: the
// same mean gradient, summed in another order, so the losses agree to float rounding.
TEST(TrainRankTest, HybridShardMatchesFullShard) {
  TrainConfig full = TinyConfig("");
  TrainConfig hybrid = full;
  hybrid.strategy = "hybrid_shard", hybrid.hybrid_shard_group_size = 2;
  const JobOutput ref = RunJob(full, 4, "full_shard4");
  const JobOutput got = RunJob(hybrid, 4, "hybrid_2x2");
  if (comm::testing::IsRankProcess()) return;
  ASSERT_FALSE(got.losses.empty());
  const double max_diff = ExpectSameLosses(got, ref, "hybrid_shard 2x2");
  std::printf("hybrid_shard 2x2 vs full_shard at 4 ranks: max |loss difference| %.3g over %zu "
              "steps\n",
              max_diff, ref.losses.size());
  EXPECT_LT(got.losses.back(), got.losses.front() - 0.3);
}

TEST(TrainConfigTest, HybridShardGroupSizeNeedsAHybridStrategy) {
  TrainConfig c = TinyConfig("");
  c.strategy = "hybrid_shard", c.hybrid_shard_group_size = 2;
  EXPECT_OK(c.Validate());
  c.strategy = "full_shard";
  EXPECT_THAT(c.Validate(),
              base::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                      ::testing::HasSubstr("hybrid_shard_group_size 2: expected")));
  c.strategy = "hybrid_shard_zero2", c.hybrid_shard_group_size = -1;
  EXPECT_THAT(c.Validate(), base::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                                    ::testing::HasSubstr("hybrid_shard_group_size -1")));
  c = TinyConfig("");
  c.strategy = "hybrid_shard", c.pipeline_stages = 2;
  EXPECT_THAT(c.Validate(), base::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                                    ::testing::HasSubstr("not wired for the pipeline")));
}

// --checkpoint_activations recomputes each checkpointed block's forward in backward: the same
// kernels on the same inputs (no randomness in the model's forward), so every loss is bitwise
// the plain run's, for fsdp (blocks inside their units, fp32 and bf16) and sdp, at 1 and 2 ranks.
TEST(TrainRankTest, CheckpointedActivationsGiveBitwiseTheSameLosses) {
  struct Mode {
    std::string data_parallel, precision;
  };
  for (const Mode& mode : std::vector<Mode>{{"fsdp", "fp32"}, {"sdp", "fp32"}, {"fsdp", "bf16"}}) {
    for (int world : {1, 2}) {
      const std::string name = absl::StrCat(mode.data_parallel, "_", mode.precision, "_", world);
      TrainConfig config = TinyConfig("");
      config.steps = 6;
      config.data_parallel = mode.data_parallel;
      config.precision = mode.precision;
      const std::vector<double> plain = RunJob(config, world, name + "_none").losses;
      config.checkpoint_activations = "all";
      const std::vector<double> all = RunJob(config, world, name + "_all").losses;
      config.checkpoint_activations = "every:2";
      const std::vector<double> every2 = RunJob(config, world, name + "_every2").losses;
      if (comm::testing::IsRankProcess()) continue;
      EXPECT_EQ(all, plain) << name;
      EXPECT_EQ(every2, plain) << name;
      ASSERT_FALSE(plain.empty()) << name;
      EXPECT_LT(plain.back(), plain.front()) << name;
    }
  }
}

// --optimizer_offload=disk: offload::OffloadedAdam over each rank's f32 FSDP shards, its state in
// <offload_dir>/rank<r>.fso, streamed in chunks (tiny chunks here: every parameter spans several):
// the same update expressions as torch::optim::Adam, so the losses and final shards are bitwise
// the in-memory run's (fp32 and bf16 compute). Checkpoints keep Adam's layout: a run stopped at
// step 6 and resumed from its step-4 checkpoint matches, whether its first part was offloaded or
// not (the setting may change across a resume).
TEST(TrainRankTest, OptimizerOffloadGivesTheSameLossesAndResumes) {
  const std::string tmp = fairscale::testing::TmpPath("trainer_test_offload");
  for (const std::string precision : {"fp32", "bf16"}) {
    TrainConfig config = TinyConfig("");
    config.precision = precision;
    config.checkpoint_every = 4;
    config.checkpoint_dir = absl::StrCat(tmp, "/", precision, "_plain_ck");
    const JobOutput plain = RunJob(config, 2, precision + "_plain");

    TrainConfig offloaded = config;
    offloaded.optimizer_offload = "disk";
    offloaded.offload_dir = absl::StrCat(tmp, "/", precision, "_offload");
    offloaded.offload_chunk_bytes = 1024;
    offloaded.checkpoint_dir = absl::StrCat(tmp, "/", precision, "_disk_ck");
    const JobOutput disk = RunJob(offloaded, 2, precision + "_disk");

    // Stopped after step 6 (checkpoint at 4) and resumed, offloaded in both parts / in memory
    // first and offloaded after the resume.
    JobOutput resumed[2];
    for (int first_offloaded = 0; first_offloaded < 2; ++first_offloaded) {
      const std::string name = absl::StrCat(precision, "_split", first_offloaded);
      TrainConfig first = first_offloaded ? offloaded : config;
      first.checkpoint_dir = absl::StrCat(tmp, "/", name, "_ck");
      first.stop_after = 6;
      RunJob(first, 2, name);
      TrainConfig second = offloaded;
      second.checkpoint_dir = first.checkpoint_dir;
      second.offload_dir = absl::StrCat(tmp, "/", name, "_offload");
      second.resume = ResumeMode::kRequired;
      resumed[first_offloaded] = RunJob(second, 2, name);
    }
    if (comm::testing::IsRankProcess()) continue;
    ASSERT_TRUE(plain.final_record.is_object()) << precision;
    ASSERT_TRUE(disk.final_record.is_object()) << precision;
    EXPECT_EQ(disk.losses, plain.losses) << precision;
    EXPECT_EQ(disk.final_record["param_fnv1a64"], plain.final_record["param_fnv1a64"])
        << precision;
    for (int r = 0; r < 2; ++r) {
      const std::string file = absl::StrCat(offloaded.offload_dir, "/rank", r, ".fso");
      EXPECT_TRUE(std::filesystem::exists(file)) << file;
    }
    for (int i = 0; i < 2; ++i) {
      ASSERT_TRUE(resumed[i].final_record.is_object()) << precision << " split " << i;
      EXPECT_EQ(resumed[i].losses, plain.losses) << precision << " split " << i;
      EXPECT_EQ(resumed[i].final_record["param_fnv1a64"], plain.final_record["param_fnv1a64"])
          << precision << " split " << i;
    }
  }
}

// The fsdp checkpoints are sharded (train_state::fsdp_item): a run saved at 4 ranks
// resumes at 2 (Adam in memory) and at 3 (Adam offloaded to disk, converted through Adam's
// archive layout). The trainer checks that the full parameters it gathers right after loading
// hash to what the 4-rank run recorded at its save (it fails the resume otherwise); here the
// metrics' checkpoint and resume records must carry that same hash, the per-rank batch stays
// (the global batch changes with the world size), and the loss keeps falling.
TEST(TrainRankTest, ResumesAtAnotherWorldSize) {
  namespace fs = std::filesystem;
  const std::string tmp = fairscale::testing::TmpPath("trainer_test_reshard");
  TrainConfig first = TinyConfig("");
  first.checkpoint_every = 4;
  first.stop_after = 4;
  first.checkpoint_dir = tmp + "/ck4";
  const JobOutput saved = RunJob(first, 4, "reshard_4");
  const std::string metrics4 = MetricsPath("reshard_4");
  JobOutput resumed[2];
  const int worlds[2] = {2, 3};
  for (int i = 0; i < 2; ++i) {
    const std::string name = absl::StrCat("reshard_4to", worlds[i]);
    TrainConfig second = first;
    second.stop_after = 0;
    second.resume = ResumeMode::kRequired;
    // Each resume gets its own copy of the 4-rank checkpoints and metrics (a run owns the steps
    // after the one it resumed from).
    second.checkpoint_dir = absl::StrCat(tmp, "/ck_", name);
    if (!comm::testing::IsRankProcess()) {
      fs::remove_all(second.checkpoint_dir);
      fs::copy(first.checkpoint_dir, second.checkpoint_dir, fs::copy_options::recursive);
      fs::copy_file(metrics4, MetricsPath(name), fs::copy_options::overwrite_existing);
    }
    if (worlds[i] == 3) {
      second.optimizer_offload = "disk";
      second.offload_dir = absl::StrCat(tmp, "/offload_", name);
      second.offload_chunk_bytes = 1024;
    }
    resumed[i] = RunJob(second, worlds[i], name);
  }
  if (comm::testing::IsRankProcess()) return;
  ASSERT_EQ(saved.losses.size(), 4u);
  ASSERT_EQ(saved.checkpoints.size(), 1u);
  EXPECT_EQ(saved.checkpoints[0]["step"], 4);
  EXPECT_EQ(saved.checkpoints[0]["world_size"], 4);
  EXPECT_EQ(saved.checkpoints[0]["items"]["model"], "fsdp_sharded");
  for (int r = 0; r < 4; ++r) {
    const std::string shard = absl::StrFormat("%s/step_00000004/model/rank%05d.shard",
                                              first.checkpoint_dir, r);
    EXPECT_TRUE(fs::exists(shard)) << shard;
  }
  for (int i = 0; i < 2; ++i) {
    const std::string name = absl::StrCat("4 -> ", worlds[i]);
    ASSERT_EQ(resumed[i].losses.size(), 8u) << name;
    // Steps 1-4 are the 4-rank run's records, kept.
    for (int s = 0; s < 4; ++s) EXPECT_EQ(resumed[i].losses[s], saved.losses[s]) << name;
    ASSERT_EQ(resumed[i].resumes.size(), 1u) << name;
    const nlohmann::json& r = resumed[i].resumes[0];
    EXPECT_EQ(r["step"], 4) << name;
    EXPECT_EQ(r["from_world_size"], 4) << name;
    EXPECT_EQ(r["world_size"], worlds[i]) << name;
    EXPECT_EQ(r["global_batch"], worlds[i] * first.batch) << name;
    EXPECT_EQ(r["full_param_fnv1a64"], saved.checkpoints[0]["full_param_fnv1a64"]) << name;
    ASSERT_TRUE(resumed[i].final_record.is_object()) << name;
    // Training continues: the loss keeps falling after the resume.
    const std::vector<double>& l = resumed[i].losses;
    EXPECT_LT(l[7], l[3]) << name;
    EXPECT_LT(l[4] + l[5] + l[6] + l[7], l[0] + l[1] + l[2] + l[3]) << name;
    // The resumed run's own checkpoint (step 8) is sharded at its world size.
    ASSERT_EQ(resumed[i].checkpoints.size(), 2u) << name;
    EXPECT_EQ(resumed[i].checkpoints[1]["step"], 8) << name;
    EXPECT_EQ(resumed[i].checkpoints[1]["world_size"], worlds[i]) << name;
  }
}

}  // namespace
}  // namespace fairscale::examples::gpt
