// //examples:train_gpt end to end, as real processes (the binary launches its own ranks over
// tcp on 127.0.0.1): the loss falls at 1 and 2 ranks, NO_SHARD ranks end with identical
// parameters, a run stopped and resumed from its checkpoint matches an uninterrupted one
// bitwise (every per-step loss and every rank's final parameters), an incomplete checkpoint is
// skipped, a corrupted one fails with the file's name, a rank killed with SIGKILL stops the
// job with a clear error, and with --max_restarts the job restarts from the last checkpoint and
// ends with the uninterrupted run's parameters. Tiny model, a few seconds per run.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "base/status_matchers.h"
#include "base/subprocess.h"
#include "examples/gpt/metrics_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/tmp.h"

namespace fairscale::examples {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

// Occurrences of `what` in `text`.
int Count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// sdp vs fsdp no_shard (and with vs without loss scaling), fp32, 2 ranks, 20 steps: measured
// bitwise equal losses on 2026-11-30 (a sum of two gradients rounds the same in any order); the
// tolerance leaves room for reduction-order rounding only.
constexpr double kSdpTolerance = 1e-6;

struct JobResult {
  int exit_code = -1;
  std::string output;  // stdout + stderr
  std::vector<double> train_losses;  // by step, from the metrics file
  std::map<int64_t, double> val_losses;
  nlohmann::json final_record;  // null if the run did not finish
};

class TrainGptTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fairscale::testing::TmpPath(absl::StrCat(
        "train_gpt_", ::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }

  static std::string Binary() {
    const char* srcdir = std::getenv("TEST_SRCDIR");
    const char* ws = std::getenv("TEST_WORKSPACE");
    return absl::StrCat(srcdir ? srcdir : ".", "/", ws ? ws : "fairscale_cpp",
                        "/examples/train_gpt");
  }

  // Runs the job with the tiny configuration plus `extra`, writing under <dir_>/<out>.
  JobResult Run(const std::string& out, std::vector<std::string> extra) {
    const std::string out_dir = absl::StrCat(dir_, "/", out);
    std::vector<std::string> args = {
        "--width=32", "--blocks=2", "--heads=2", "--seq=32", "--batch=8",
        "--lr=1e-2",  "--warmup_steps=4", "--eval_every=10", "--eval_batches=2",
        "--sample_tokens=40", "--log_every=5", absl::StrCat("--out_dir=", out_dir),
        "--failure_grace_s=5"};
    args.insert(args.end(), extra.begin(), extra.end());
    const std::string log = absl::StrCat(out_dir, ".log");
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    EXPECT_GE(fd, 0);
    absl::StatusOr<pid_t> pid = base::Spawn(Binary(), args, {}, {{fd, 1}, {fd, 2}});
    ::close(fd);
    JobResult r;
    if (!pid.ok()) {
      ADD_FAILURE() << pid.status();
      return r;
    }
    absl::StatusOr<int> code = base::WaitChild(*pid, absl::Seconds(150));
    r.exit_code = code.ok() ? *code : -1;
    std::ifstream in(log);
    std::stringstream ss;
    ss << in.rdbuf();
    r.output = ss.str();
    std::ifstream metrics(out_dir + "/metrics.jsonl");
    std::string line;
    while (std::getline(metrics, line)) {
      nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (!j.is_object()) {
        ADD_FAILURE() << "metrics line is not a JSON object: " << line;
        continue;
      }
      // Losses may be NaN / inf (written as strings, gpt::MetricNumber).
      const double loss = gpt::ReadMetricNumber(j.value("loss", nlohmann::json(0.0))).value_or(-1);
      if (j["type"] == "train") {
        EXPECT_EQ(j["step"].get<size_t>(), r.train_losses.size() + 1) << line;
        r.train_losses.push_back(loss);
      }
      if (j["type"] == "val") r.val_losses[j["step"].get<int64_t>()] = loss;
      if (j["type"] == "final") r.final_record = j;
    }
    return r;
  }

  std::string dir_;
};

TEST_F(TrainGptTest, LossFallsAtOneAndTwoRanks) {
  for (const auto& [nproc, precision] :
       std::vector<std::pair<int, std::string>>{{1, "fp32"}, {2, "bf16"}}) {
    SCOPED_TRACE(absl::StrCat(nproc, " ranks, ", precision));
    const std::string out = absl::StrCat("n", nproc);
    JobResult r = Run(out, {absl::StrCat("--nproc=", nproc), "--steps=30",
                            absl::StrCat("--precision=", precision)});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    ASSERT_EQ(r.train_losses.size(), 30u) << r.output;
    // ln(71) = 4.26 at the start (uniform over the vocabulary); clearly lower at the end.
    EXPECT_GT(r.train_losses.front(), 3.8);
    EXPECT_LT(r.train_losses.back(), r.train_losses.front() - 0.8);
    ASSERT_TRUE(r.final_record.is_object()) << r.output;
    EXPECT_LT(r.final_record["val_loss"].get<double>(), 3.6);
    EXPECT_EQ(r.final_record["param_fnv1a64"].size(), static_cast<size_t>(nproc));
    EXPECT_EQ(r.val_losses.size(), 3u);  // steps 10, 20, 30
    EXPECT_THAT(r.output, HasSubstr("sample (temperature"));
    EXPECT_THAT(r.output, HasSubstr("And God said"));
    EXPECT_THAT(r.output, HasSubstr("step 30/30"));
    std::ifstream svg(absl::StrCat(dir_, "/", out, "/loss.svg"));
    std::stringstream ss;
    ss << svg.rdbuf();
    EXPECT_THAT(ss.str(), HasSubstr("<polyline"));
    EXPECT_THAT(ss.str(), HasSubstr("</svg>"));
  }
}

TEST_F(TrainGptTest, NoShardRanksEndWithTheSameParameters) {
  JobResult r = Run("no_shard", {"--nproc=2", "--steps=8", "--strategy=no_shard",
                                 "--precision=fp32", "--sample_tokens=0"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_TRUE(r.final_record.is_object()) << r.output;
  const nlohmann::json& h = r.final_record["param_fnv1a64"];
  ASSERT_EQ(h.size(), 2u);
  EXPECT_EQ(h[0], h[1]);
}

// --data_parallel=sdp (oss::ShardedDataParallel + OSS Adam) computes the same math as FSDP
// NO_SHARD in fp32 (full replicas, gradients averaged over ranks, Adam on every element, the
// same global-norm clipping): the losses agree up to the rounding of the different reduction
// orders; the ranks end with the same full parameters; the loss falls at 1 and 2 ranks, with
// both partitions. --loss_scale (a power of two in fp32, no overflow here) changes nothing but
// rounding and records the scale.
TEST_F(TrainGptTest, ShardedDataParallelMatchesFsdpNoShardAndLossScaling) {
  const std::vector<std::string> job = {"--steps=20", "--precision=fp32", "--sample_tokens=0",
                                        "--checkpoint_dir=none"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = job;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  JobResult fsdp = Run("fsdp", with({"--nproc=2", "--strategy=no_shard"}));
  JobResult sdp = Run("sdp", with({"--nproc=2", "--data_parallel=sdp"}));
  JobResult sdp1 = Run("sdp1", with({"--nproc=1", "--data_parallel=sdp", "--oss_partition=flat"}));
  JobResult scaled = Run("scaled", with({"--nproc=2", "--strategy=no_shard", "--loss_scale"}));
  for (const JobResult* r : {&fsdp, &sdp, &sdp1, &scaled}) {
    ASSERT_EQ(r->exit_code, 0) << r->output;
    ASSERT_EQ(r->train_losses.size(), 20u) << r->output;
    EXPECT_GT(r->train_losses.front(), 3.8);
    EXPECT_LT(r->train_losses.back(), r->train_losses.front() - 0.8) << r->output;
    ASSERT_TRUE(r->final_record.is_object()) << r->output;
  }
  EXPECT_THAT(sdp.output, HasSubstr("sdp/greedy"));
  const nlohmann::json& h = sdp.final_record["full_param_fnv1a64"];
  ASSERT_EQ(h.size(), 2u);
  EXPECT_EQ(h[0], h[1]);
  double max_diff = 0, max_scaled_diff = 0;
  for (size_t i = 0; i < 20; ++i) {
    max_diff = std::max(max_diff, std::abs(sdp.train_losses[i] - fsdp.train_losses[i]));
    max_scaled_diff =
        std::max(max_scaled_diff, std::abs(scaled.train_losses[i] - fsdp.train_losses[i]));
  }
  EXPECT_EQ(sdp.train_losses.front(), fsdp.train_losses.front());  // same initial weights
  EXPECT_LT(max_diff, kSdpTolerance);
  EXPECT_LT(max_scaled_diff, kSdpTolerance);
  std::printf("max |loss sdp - loss fsdp no_shard| = %g, with loss scaling %g\n", max_diff,
              max_scaled_diff);
  std::ifstream metrics(dir_ + "/scaled/metrics.jsonl");
  std::string line;
  int scaled_records = 0;
  while (std::getline(metrics, line)) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (j["type"] != "train") continue;
    EXPECT_EQ(j["loss_scale"].get<double>(), 65536.0) << line;
    EXPECT_FALSE(j["step_skipped"].get<bool>()) << line;
    ++scaled_records;
  }
  EXPECT_EQ(scaled_records, 20);

  JobResult bf16 = Run("bad", {"--nproc=1", "--steps=2", "--data_parallel=sdp"});
  EXPECT_NE(bf16.exit_code, 0);
  EXPECT_THAT(bf16.output, HasSubstr("precision must be fp32"));
}

// sdp checkpoints (full parameters + the OSS state consolidated on rank 0; with --loss_scale the
// scaler's state in the trainer item): a run stopped at
// step 12 under the flat partition and resumed from step 10 under the greedy one matches an
// uninterrupted run bitwise (OSS saves the unsharded Adam's layout, loadable at any partition).
TEST_F(TrainGptTest, ShardedDataParallelResumeMatchesAnUninterruptedRunBitwise) {
  const std::vector<std::string> job = {"--nproc=2", "--steps=20", "--checkpoint_every=5",
                                        "--precision=fp32", "--data_parallel=sdp",
                                        "--loss_scale", "--sample_tokens=0"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = job;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  JobResult whole = Run("whole", job);
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  JobResult first = Run("parts", with({"--stop_after=12", "--oss_partition=flat"}));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  // The loss scaler's state is the trainer item's: 10 clean steps at the initial scale.
  {
    std::ifstream in(dir_ + "/parts/checkpoints/step_00000010/trainer/state.json");
    const nlohmann::json state = nlohmann::json::parse(in);
    const nlohmann::json& scaler = state["grad_scaler"];
    EXPECT_EQ(scaler["scale"].get<double>(), 65536.0) << state;
    EXPECT_EQ(scaler["growth_tracker"].get<int64_t>(), 10) << state;
  }
  JobResult second = Run("parts", with({"--resume"}));
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_THAT(second.output, HasSubstr("resumed at step 10"));
  EXPECT_EQ(second.train_losses, whole.train_losses);
  ASSERT_TRUE(second.final_record.is_object()) << second.output;
  EXPECT_EQ(second.final_record["full_param_fnv1a64"], whole.final_record["full_param_fnv1a64"]);
  // An FSDP run cannot resume from it: the recorded data_parallel differs.
  JobResult fsdp = Run("parts", {"--nproc=2", "--steps=20", "--precision=fp32", "--resume"});
  EXPECT_NE(fsdp.exit_code, 0);
  EXPECT_THAT(fsdp.output, HasSubstr("has data_parallel = \"sdp\", this run has \"fsdp\""));
}

TEST_F(TrainGptTest, ResumeMatchesAnUninterruptedRunBitwise) {
  const std::vector<std::string> job = {"--nproc=2", "--steps=20", "--checkpoint_every=5"};
  JobResult whole = Run("whole", job);
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  ASSERT_EQ(whole.train_losses.size(), 20u);

  // Asked to resume with nothing to resume from: a clear error.
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = job;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  JobResult none = Run("parts", with({"--resume"}));
  EXPECT_NE(none.exit_code, 0);
  EXPECT_THAT(none.output, HasSubstr("no complete checkpoint"));

  JobResult first = Run("parts", with({"--stop_after=12"}));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_EQ(first.train_losses.size(), 12u);
  EXPECT_TRUE(first.final_record.is_null());
  // A save that was killed before COMPLETE: skipped by resume.
  const std::string ckpt = dir_ + "/parts/checkpoints";
  fs::create_directories(ckpt + "/step_00000015/model");
  std::ofstream(ckpt + "/step_00000015/model/rank00000.shard") << "half a file";

  JobResult second = Run("parts", with({"--resume"}));
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_THAT(second.output, HasSubstr("resumed at step 10"));
  ASSERT_EQ(second.train_losses.size(), 20u);  // 1-10 kept from the first part, 11-20 new
  for (size_t i = 0; i < 20; ++i) {
    EXPECT_EQ(second.train_losses[i], whole.train_losses[i]) << "step " << i + 1;
  }
  EXPECT_EQ(second.val_losses, whole.val_losses);
  ASSERT_TRUE(second.final_record.is_object());
  EXPECT_EQ(second.final_record["param_fnv1a64"], whole.final_record["param_fnv1a64"]);
  // The stale directory was replaced by the resumed run's own step-15 checkpoint.
  EXPECT_TRUE(fs::exists(ckpt + "/step_00000015/COMPLETE"));
  EXPECT_GT(fs::file_size(ckpt + "/step_00000015/model/rank00000.shard"), 1000u);

  // --resume=auto on a finished run resumes at its last checkpoint (step 20): nothing to train,
  // same parameters.
  JobResult again = Run("parts", with({"--resume=auto"}));
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_THAT(again.output, HasSubstr("resumed at step 20"));
  EXPECT_EQ(again.final_record["param_fnv1a64"], whole.final_record["param_fnv1a64"]);
}

TEST_F(TrainGptTest, CorruptCheckpointFailsNamingTheFile) {
  const std::vector<std::string> job = {"--nproc=2", "--steps=10", "--checkpoint_every=5",
                                        "--sample_tokens=0"};
  JobResult r = Run("c", job);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string victim = dir_ + "/c/checkpoints/step_00000010/model/rank00001.shard";
  ASSERT_TRUE(fs::exists(victim));
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(victim) / 2));
    const char c = static_cast<char>(f.peek());
    f.put(static_cast<char>(c ^ 0x40));
  }
  std::vector<std::string> args = job;
  args.push_back("--resume");
  JobResult bad = Run("c", args);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.output, HasSubstr(victim + " is corrupt"));
  // Found before any rank starts, said once, with what to do: the older intact checkpoint.
  EXPECT_EQ(Count(bad.output, " is corrupt"), 1) << bad.output;
  EXPECT_THAT(bad.output, HasSubstr("the newest intact checkpoint before it is " + dir_ +
                                    "/c/checkpoints/step_00000005 (step 5): to resume from it, "
                                    "move the damaged one aside"));
  EXPECT_THAT(bad.output, Not(HasSubstr("[rank")));
  EXPECT_THAT(bad.output, Not(HasSubstr("train_gpt: 2 ranks")));  // nothing launched
  // Moved aside as the message says: resumes from step 5.
  fs::rename(dir_ + "/c/checkpoints/step_00000010", dir_ + "/c/checkpoints/step_00000010.damaged");
  JobResult older = Run("c", args);
  ASSERT_EQ(older.exit_code, 0) << older.output;
  EXPECT_THAT(older.output, HasSubstr("resumed at step 5"));
}

// A step directory train_gpt wrote before it used //train_state (here the sharded format of
// then: COMPLETE with "format": "fsdp_sharded" and the shards beside it) is refused before any
// rank starts, once, naming the directory and the format, with what to do; nothing is deleted.
TEST_F(TrainGptTest, OldCheckpointFormatIsRefusedNamingIt) {
  const std::string step = dir_ + "/old/checkpoints/step_00000006";
  fs::create_directories(step);
  std::ofstream(step + "/rank00000.shard") << "a shard";
  std::ofstream(step + "/manifest.json") << "{}";
  std::ofstream(step + "/COMPLETE")
      << R"({"step": 6, "world_size": 1, "format": "fsdp_sharded", "config": {}, )"
      << R"("trainer_state": {}, "files": [{"name": "rank00000.shard", "bytes": 7, )"
      << R"("fnv1a64": "0000000000000001"}, {"name": "manifest.json", "bytes": 2, )"
      << R"("fnv1a64": "0000000000000002"}]})";
  for (const std::string resume : {"--resume", "--resume=auto"}) {
    JobResult r = Run("old", {"--nproc=1", "--steps=8", resume});
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_EQ(Count(r.output, "checkpoint " + step +
                                  " is in train_gpt's format \"fsdp_sharded\" from before the "
                                  "job used //train_state"),
              1)
        << r.output;
    EXPECT_THAT(r.output, HasSubstr("--overwrite_checkpoints"));
    EXPECT_THAT(r.output, Not(HasSubstr("[rank")));
  }
  EXPECT_TRUE(fs::exists(step + "/COMPLETE"));
  // Without --resume it is a complete checkpoint a fresh run would delete: refused too.
  JobResult fresh = Run("old", {"--nproc=1", "--steps=8"});
  EXPECT_EQ(fresh.exit_code, 2) << fresh.output;
  EXPECT_THAT(fresh.output, HasSubstr("already holds 1 complete checkpoint"));
}

// Bad values stop the job before a rank starts, each said once, ending with what to do.
TEST_F(TrainGptTest, BadValuesStopTheJobBeforeAnyRankStarts) {
  struct Case {
    std::vector<std::string> flags;
    std::string message;
  };
  std::ofstream(dir_ + "/a_file") << "not a directory";
  const std::vector<Case> cases = {
      {{"--nproc_per_node=3", "--pipeline_stages=2", "--precision=fp32", "--strategy=no_shard"},
       "pipeline_stages 2 does not divide the rank count 3 (each of ranks / pipeline_stages "
       "replicas runs the whole pipeline); use --nproc_per_node=2 or a multiple of it"},
      {{"--nproc=2", "--resume"},
       "no complete checkpoint (a step_* directory with COMPLETE) under"},
      {{"--nproc=2", "--out_dir=" + dir_ + "/a_file/out"}, "; choose a writable --out_dir"},
      {{"--nproc=2", "--nproc_per_node=3"}, "--nproc=2 and --nproc_per_node=3 disagree"},
      {{"--nproc=4", "--strategy=hybrid_shard", "--hybrid_shard_group_size=3"},
       "hybrid_shard_group_size 3 does not divide the rank count 4"},
      // Every numeric flag has a range, said naming the flag (--threads=100000 hung a rank).
      {{"--nproc=2", "--threads=100000"}, "--threads=100000 is out of range: must be in [0, "},
      {{"--nproc=2", "--min_lr_ratio=1.5"},
       "--min_lr_ratio=1.5 is out of range: must be in [0, 1] (the final learning rate as a "
       "fraction of --lr)"},
      {{"--nproc=2", "--min_lr_ratio=-0.1"}, "--min_lr_ratio=-0.1 is out of range"},
      {{"--nproc=2", "--grad_clip=inf"},
       "--grad_clip=inf is out of range: must be in [0, 1.79769e+308] (finite; 0: off)"},
      {{"--nproc=2", "--grad_clip=nan"}, "--grad_clip=nan is out of range"},
      {{"--nproc=2", "--eval_batches=0"},
       "--eval_batches=0 is out of range: must be in [1, 1048576]"},
      {{"--nproc=2", "--batch=0"}, "--batch=0 is out of range: must be in [1, 1048576]"},
      {{"--nproc=2", "--seq=2000000"}, "--seq=2000000 is out of range: must be in [1, 1048576]"},
      {{"--nproc=2", "--lr=inf"}, "--lr=inf is out of range: must be finite and > 0"},
      {{"--nproc_per_node=-1"}, "--nproc_per_node=-1 is out of range: must be in [1, 1024]"},
      {{"--nproc=2", "--max_restarts=-1"},
       "--max_restarts=-1 and --failure_grace_s=5: must be in [0, 1000] and [0, 3600]"},
      // Within the sanity bound, beyond any machine's memory (the attention scores alone are
      // 8 x 2 x 100000^2 floats per block).
      {{"--nproc=2", "--seq=100000"},
       "--batch=8 and --seq=100000 (with --width=32, --blocks=2, --heads=2) need about "},
      {{"--nproc=2", "--seq=100000"}, " of memory holds for 2 ranks; lower --seq or --batch"},
      // Paths: an explicit --metrics in a missing directory.
      {{"--nproc=2", "--metrics=" + dir_ + "/missing/m.jsonl"},
       "--metrics=" + dir_ + "/missing/m.jsonl: the directory " + dir_ +
           "/missing does not exist; create it, or leave --metrics out to write under --out_dir"},
      {{"--nproc=2", "--overwrite_checkpoints", "--resume=auto"},
       "--overwrite_checkpoints deletes the checkpoints that --resume would continue from; give "
       "one of them"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].message);
    std::vector<std::string> flags = cases[i].flags;
    flags.push_back("--steps=4");
    JobResult r = Run(absl::StrCat("bad", i), flags);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_EQ(Count(r.output, cases[i].message), 1) << r.output;
    EXPECT_EQ(Count(r.output, "train_gpt: "), 1) << r.output;  // that line alone
    EXPECT_THAT(r.output, Not(HasSubstr("[rank")));
  }
  // The "no checkpoint" message says what to do.
  JobResult r = Run("bad1", {"--nproc=2", "--resume", "--steps=4"});
  EXPECT_THAT(r.output, HasSubstr("run without --resume to start from step 0, or with "
                                  "--resume=auto to resume only when there is one"));
}

// An out_dir that cannot be written is said with the OS error, naming --out_dir, before launching.
TEST_F(TrainGptTest, UnwritableOutDirIsRefusedWithTheOsError) {
  const std::string ro = dir_ + "/read_only";
  fs::create_directories(ro);
  fs::permissions(ro, fs::perms::owner_read | fs::perms::owner_exec, fs::perm_options::replace);
  if (::access(ro.c_str(), W_OK) == 0) {
    fs::permissions(ro, fs::perms::owner_all, fs::perm_options::replace);
    GTEST_SKIP() << "running as root: a 0500 directory is still writable";
  }
  const struct {
    std::string out_dir;
    std::string message;
  } cases[] = {
      {ro, "cannot write in " + ro + " (--out_dir): Permission denied; choose a writable "
           "--out_dir"},
      {ro + "/out", "cannot create " + ro + "/out (--out_dir): Permission denied; choose a "
                    "writable --out_dir"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.out_dir);
    // The last --out_dir wins; the log stays in dir_.
    JobResult r = Run("ro_log", {"--nproc=2", "--steps=4", "--out_dir=" + c.out_dir});
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_EQ(Count(r.output, c.message), 1) << r.output;
    EXPECT_EQ(Count(r.output, "train_gpt: "), 1) << r.output;
  }
  fs::permissions(ro, fs::perms::owner_all, fs::perm_options::replace);
}

// A run without --resume in an out_dir that holds checkpoints would delete them: refused, naming
// --resume and --overwrite_checkpoints, and nothing is deleted; with --overwrite_checkpoints it
// starts from step 0.
TEST_F(TrainGptTest, ExistingCheckpointsAreNotOverwrittenSilently) {
  const std::vector<std::string> job = {"--nproc=1", "--steps=4", "--checkpoint_every=2",
                                        "--sample_tokens=0"};
  JobResult first = Run("ow", job);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const std::string ckpt = dir_ + "/ow/checkpoints";
  JobResult again = Run("ow", job);
  EXPECT_EQ(again.exit_code, 2) << again.output;
  EXPECT_EQ(Count(again.output,
                  ckpt + " already holds 2 complete checkpoints (newest " + ckpt +
                      "/step_00000004), which a run from step 0 would delete: run with --resume "
                      "to continue from the newest, with --overwrite_checkpoints to delete them "
                      "and start from step 0, or with another --out_dir to keep them"),
            1)
      << again.output;
  EXPECT_THAT(again.output, Not(HasSubstr("train_gpt: 1 rank")));  // nothing launched
  EXPECT_TRUE(fs::exists(ckpt + "/step_00000002/COMPLETE"));
  EXPECT_TRUE(fs::exists(ckpt + "/step_00000004/COMPLETE"));
  std::vector<std::string> overwrite = job;
  overwrite.push_back("--overwrite_checkpoints");
  overwrite.push_back("--steps=3");
  JobResult fresh = Run("ow", overwrite);
  ASSERT_EQ(fresh.exit_code, 0) << fresh.output;
  EXPECT_THAT(fresh.output, Not(HasSubstr("resumed")));
  EXPECT_EQ(fresh.train_losses.size(), 3u);
  EXPECT_EQ(fresh.train_losses, std::vector<double>(first.train_losses.begin(),
                                                    first.train_losses.begin() + 3));
  EXPECT_TRUE(fs::exists(ckpt + "/step_00000002/COMPLETE"));
  EXPECT_TRUE(fs::exists(ckpt + "/step_00000003/COMPLETE"));
  EXPECT_FALSE(fs::exists(ckpt + "/step_00000004"));  // the old run's, after the new start
}

// --resume reads back a metrics file with NaN / inf losses (as written now, and as `null`, what
// older files hold) and skips a line that is not a record, warning with the file and line.
TEST_F(TrainGptTest, ResumeReadsNonFiniteLossesAndSkipsBadMetricsLines) {
  const std::vector<std::string> job = {"--nproc=1", "--steps=8", "--checkpoint_every=4",
                                        "--eval_every=2", "--sample_tokens=0"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = job;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  JobResult first = Run("m", with({"--stop_after=6"}));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const std::string path = dir_ + "/m/metrics.jsonl";
  std::vector<std::string> lines;
  {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      nlohmann::json j = nlohmann::json::parse(line);
      if (j["type"] == "train" && j["step"] == 2) j["loss"] = nullptr;  // an old file's NaN
      if (j["type"] == "train" && j["step"] == 3) j["loss"] = gpt::MetricNumber(std::nan(""));
      if (j["type"] == "val" && j["step"] == 4) {
        j["loss"] = gpt::MetricNumber(std::numeric_limits<double>::infinity());
      }
      lines.push_back(j.dump());
    }
  }
  ASSERT_GE(lines.size(), 3u);
  lines.insert(lines.begin() + 1, "{\"type\": \"train\", \"st");  // line 2: torn garbage
  lines.insert(lines.begin() + 2, R"({"type":"val","step":2,"loss":"fast"})");  // line 3
  {
    std::ofstream out(path, std::ios::trunc);
    for (const std::string& l : lines) out << l << "\n";
  }
  JobResult second = Run("m", with({"--resume"}));
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_THAT(second.output, HasSubstr("resumed at step 4"));
  EXPECT_EQ(Count(second.output, "train_gpt: warning: " + path +
                                     ":2: skipped a malformed metrics record (not valid JSON)"),
            1)
      << second.output;
  EXPECT_EQ(Count(second.output,
                  "train_gpt: warning: " + path +
                      ":3: skipped a malformed metrics record (\"loss\" is not a number: "
                      "\"fast\")"),
            1)
      << second.output;
  EXPECT_EQ(Count(second.output, "train_gpt: warning: "), 2) << second.output;
  ASSERT_EQ(second.train_losses.size(), 8u);
  EXPECT_EQ(second.train_losses[0], first.train_losses[0]);
  EXPECT_TRUE(std::isnan(second.train_losses[1]));
  EXPECT_TRUE(std::isnan(second.train_losses[2]));
  EXPECT_EQ(second.train_losses[3], first.train_losses[3]);
  EXPECT_EQ(second.val_losses[4], std::numeric_limits<double>::infinity());
  for (size_t i = 4; i < 8; ++i) EXPECT_TRUE(std::isfinite(second.train_losses[i])) << i;
  EXPECT_EQ(second.train_losses[4], first.train_losses[4]);  // the resume is exact
  ASSERT_TRUE(second.final_record.is_object());
}

// An error every rank meets after starting (here a prompt with a character outside the
// vocabulary) is printed once, naming the ranks, not once per rank.
TEST_F(TrainGptTest, TheSameErrorOnEveryRankIsPrintedOnce) {
  JobResult r = Run("prompt", {"--nproc=2", "--steps=4", "--prompt=\x7f"});
  EXPECT_NE(r.exit_code, 0) << r.output;
  // Once, naming the ranks that reported it: usually both ("all 2 ranks"); the launcher's
  // SIGTERM after the first failure may stop the other before it reports. Counted on the job's
  // error lines ("train_gpt: ..."): a rank that aborts its communicator with its own error may
  // also log "communicator broken: <the error>" as a glog warning, depending on whether a peer's
  // abort reached it first (a known duplicate, left for the hardening issue).
  int error_lines = 0;
  for (absl::string_view line : absl::StrSplit(r.output, '\n')) {
    if (absl::StartsWith(line, "train_gpt: ") &&
        absl::StrContains(line, "is not in the vocabulary")) {
      ++error_lines;
    }
  }
  EXPECT_EQ(error_lines, 1) << r.output;
  EXPECT_THAT(r.output, ::testing::ContainsRegex("train_gpt: (all 2 ranks|rank [01] of 2): "
                                                 "INVALID_ARGUMENT: CharTokenizer: byte 0x7f"));
}

// Training longer after a finished run: --resume with a larger --steps continues; the schedule
// is the finished run's, so the added steps hold its final learning rate (lr x min_lr_ratio),
// and a second extension keeps it. Fewer steps than the checkpoint is refused before launching.
TEST_F(TrainGptTest, ResumeWithMoreStepsExtendsAFinishedRun) {
  const std::vector<std::string> job = {"--nproc=2", "--checkpoint_every=6", "--sample_tokens=0"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = job;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  JobResult first = Run("ext", with({"--steps=12"}));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  JobResult longer = Run("ext", with({"--steps=16", "--resume"}));
  ASSERT_EQ(longer.exit_code, 0) << longer.output;
  EXPECT_THAT(longer.output, HasSubstr("resumed at step 12"));
  EXPECT_THAT(longer.output, HasSubstr("extended from 12 to 16 steps (learning rate held at "
                                       "0.001 after step 12)"));
  ASSERT_EQ(longer.train_losses.size(), 16u) << longer.output;
  for (size_t i = 0; i < 12; ++i) EXPECT_EQ(longer.train_losses[i], first.train_losses[i]);
  ASSERT_TRUE(longer.final_record.is_object()) << longer.output;
  JobResult again = Run("ext", with({"--steps=20", "--resume"}));
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_THAT(again.output, HasSubstr("extended from 12 to 20 steps"));
  std::ifstream metrics(dir_ + "/ext/metrics.jsonl");
  std::string line;
  int held = 0;
  while (std::getline(metrics, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j["type"] == "train" && j["step"].get<int>() > 12) {
      EXPECT_DOUBLE_EQ(j["lr"].get<double>(), 1e-3) << line;  // --lr=1e-2 x min_lr_ratio 0.1
      ++held;
    }
    if (j["type"] == "resume") {
      EXPECT_EQ(j["schedule_steps"].get<int>(), 12) << line;
    }
  }
  EXPECT_EQ(held, 8);
  JobResult shorter = Run("ext", with({"--steps=8", "--resume"}));
  EXPECT_EQ(shorter.exit_code, 2) << shorter.output;
  EXPECT_THAT(shorter.output, HasSubstr("is at step 20, past --steps=8; pass --steps greater "
                                        "than 20 to train longer from it"));
}

// A successful hybrid-shard run at 4 ranks ends cleanly: no warning or error lines (glog's
// W/E lines, "communicator broken", a peer's closed connection) and no store internals.
TEST_F(TrainGptTest, HybridShardRunEndsWithoutWarnings) {
  JobResult r = Run("hybrid", {"--nproc_per_node=4", "--strategy=hybrid_shard",
                               "--hybrid_shard_group_size=2", "--steps=4", "--sample_tokens=0",
                               "--checkpoint_every=2"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("train_gpt: done in"));
  for (absl::string_view line : absl::StrSplit(r.output, '\n')) {
    const bool glog_warning = line.size() > 5 && (line[0] == 'W' || line[0] == 'E') &&
                              std::isdigit(static_cast<unsigned char>(line[1])) &&
                              std::isdigit(static_cast<unsigned char>(line[4]));
    EXPECT_FALSE(glog_warning) << line;
    EXPECT_THAT(line, Not(HasSubstr("communicator broken"))) << r.output;
    EXPECT_THAT(line, Not(HasSubstr("closed the connection"))) << r.output;
    EXPECT_THAT(line, Not(HasSubstr("TCPStore server listening"))) << r.output;
  }
}

TEST_F(TrainGptTest, KilledRankStopsTheJobWithAClearError) {
  // Rank 1 SIGKILLs itself after step 7; the launcher (//launch, as fs_launch) names it, stops
  // rank 0 and exits with rank 1's status (no hang: the test's deadline is 150 s). Rank 0's own
  // error (its next collective fails naming peer 1) races with the launcher's SIGTERM, so it is
  // not required here; the comm conformance suite checks that error.
  JobResult r = Run("killed", {"--nproc=2", "--steps=20", "--checkpoint_every=5",
                               "--fault_kill=1:7", "--sample_tokens=0"});
  EXPECT_EQ(r.exit_code, 128 + 9);
  EXPECT_THAT(r.output, HasSubstr("fault injection: SIGKILL after step 7"));
  EXPECT_THAT(r.output, HasSubstr("rank 1 (local rank 1 on node 0, pid"));
  EXPECT_THAT(r.output, HasSubstr("job failed: rank 1 was killed by SIGKILL"));
  EXPECT_TRUE(r.final_record.is_null());
}

TEST_F(TrainGptTest, RestartAfterAKilledRankEndsWithTheUninterruptedParameters) {
  const std::vector<std::string> job = {"--nproc=2", "--steps=20", "--checkpoint_every=5",
                                        "--sample_tokens=0"};
  JobResult whole = Run("whole", job);
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  std::vector<std::string> faulty = job;
  faulty.insert(faulty.end(), {"--fault_kill=1:13", "--max_restarts=1"});
  JobResult r = Run("restarted", faulty);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("rank 1 was killed by SIGKILL"));
  EXPECT_THAT(r.output, HasSubstr("restarting the job (restart 1 of at most 1"));
  // Rank 0's error of the failed attempt (when it reported one before the launcher stopped it)
  // is marked as such: the job succeeded.
  EXPECT_THAT(r.output, Not(::testing::ContainsRegex("train_gpt: (rank [01] of 2|all 2 ranks):")));
  EXPECT_THAT(r.output, HasSubstr("resumed at step 10"));
  ASSERT_TRUE(r.final_record.is_object()) << r.output;
  EXPECT_EQ(r.final_record["param_fnv1a64"], whole.final_record["param_fnv1a64"]);
  EXPECT_EQ(r.train_losses, whole.train_losses);
}

}  // namespace
}  // namespace fairscale::examples
