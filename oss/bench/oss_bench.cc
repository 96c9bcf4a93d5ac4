// oss_bench: step time, peak tensor memory and optimizer-state bytes of DDP-style training
// (all-reduce + Adam) against OSS (ZeRO-1) and OSS + ShardedDataParallel (ZeRO-2), both partition
// modes and the bf16 wire, on the main job's GPT model. Ranks are real processes over tcp on
// 127.0.0.1 (copies of this binary, FileStore rendezvous), as in //fsdp/bench. See README.md.
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/flags.h"
#include "base/subprocess.h"
#include "comm/bench/harness.h"
#include "comm/communicator.h"
#include "comm/registry.h"
#include "comm/store/file_store.h"
#include "comm/torch/tensor_buffer.h"
#include "examples/gpt/model.h"
#include "base/tracking_allocator.h"
#include "oss/oss.h"
#include "oss/sharded_data_parallel.h"

ABSL_FLAG(int, rank_timeout_s, 3600, "ranks still running after this long are killed");
ABSL_FLAG(std::string, ranks, "1,2,4", "world sizes to run");
ABSL_FLAG(int, blocks, 8, "transformer blocks");
ABSL_FLAG(int, width, 512, "model width");
ABSL_FLAG(int, heads, 8, "attention heads");
ABSL_FLAG(int, seq, 64, "sequence length");
ABSL_FLAG(int, batch, 4, "sequences per rank per step");
ABSL_FLAG(int, vocab, 1024, "vocabulary size");
ABSL_FLAG(int, warmup, 2, "untimed steps per configuration");
ABSL_FLAG(int, steps, 6, "timed steps per configuration (the median is reported)");
ABSL_FLAG(int, threads, 1, "intra-op threads per rank (at::set_num_threads)");
ABSL_FLAG(std::string, configs, "ddp,oss,oss_flat,sdp,sdp_flat,sdp_flat_bf16",
          "configurations, in order");
ABSL_FLAG(std::string, out, "", "also write the markdown table here");

namespace fairscale::oss::bench {
namespace {

namespace gpt = ::fairscale::examples::gpt;
using Clock = std::chrono::steady_clock;
using ::fairscale::base::TrackingCpuAllocator;

void Die(const std::string& what) {
  std::fprintf(stderr, "oss_bench: %s\n", what.c_str());
  std::exit(1);
}

std::vector<std::string> Configs() {
  return absl::StrSplit(absl::GetFlag(FLAGS_configs), ',', absl::SkipEmpty());
}

gpt::GptConfig ModelConfig() {
  return gpt::GptConfig()
      .vocab(absl::GetFlag(FLAGS_vocab))
      .seq(absl::GetFlag(FLAGS_seq))
      .width(absl::GetFlag(FLAGS_width))
      .heads(absl::GetFlag(FLAGS_heads))
      .blocks(absl::GetFlag(FLAGS_blocks));
}

// DDP's gradient mean: one all-reduce of all gradients, flattened.
void AllReduceGrads(torch::nn::Module& m, comm::Communicator& comm) {
  std::vector<at::Tensor> grads;
  for (const at::Tensor& p : m.parameters()) {
    if (p.grad().defined()) grads.push_back(p.grad().view({-1}));
  }
  at::Tensor flat = at::cat(grads);
  auto buf = comm::ToBuffer(flat);
  if (!buf.ok()) Die(buf.status().ToString());
  absl::Status s = comm.AllReduce(*buf, *buf, comm::ReduceOp::kSum).Wait();
  if (!s.ok()) Die(s.ToString());
  flat.div_(comm.size());
  int64_t off = 0;
  for (at::Tensor& g : grads) {
    g.copy_(flat.narrow(0, off, g.numel()));
    off += g.numel();
  }
}

struct RankResult {
  double median_s = 0;
  int64_t peak_bytes = 0;
  int64_t state_bytes = 0;
  int64_t param_bytes = 0;
};

RankResult RunConfig(const std::string& config, TrackingCpuAllocator* tracker, int rank,
                     std::shared_ptr<comm::Communicator> comm) {
  torch::manual_seed(0);  // same initial weights on every rank
  gpt::Gpt model(ModelConfig());
  RankResult r;
  for (const at::Tensor& p : model->parameters()) r.param_bytes += p.nbytes();
  const auto adam = torch::optim::AdamOptions(1e-4);
  std::unique_ptr<torch::optim::Adam> plain;
  std::shared_ptr<OSS> sharded;
  ShardedDataParallel sdp{nullptr};
  if (config == "ddp") {
    plain = std::make_unique<torch::optim::Adam>(model->parameters(), adam);
  } else {
    OssOptions options;
    if (config.find("flat") != std::string::npos) options.partition(PartitionMode::kFlat);
    if (config.find("bf16") != std::string::npos) options.broadcast_dtype(at::kBFloat16);
    sharded = OSS::make<torch::optim::Adam>(model->parameters(), adam, comm, options);
    if (config.rfind("sdp", 0) == 0) sdp = ShardedDataParallel(torch::nn::AnyModule(model), sharded);
  }
  torch::optim::Optimizer& opt = plain ? static_cast<torch::optim::Optimizer&>(*plain) : *sharded;
  const int64_t vocab = absl::GetFlag(FLAGS_vocab), seq = absl::GetFlag(FLAGS_seq);
  std::vector<double> times;
  const int warmup = absl::GetFlag(FLAGS_warmup), steps = absl::GetFlag(FLAGS_steps);
  tracker->reset_peak();
  for (int step = 0; step < warmup + steps; ++step) {
    torch::manual_seed(1000 + 7919 * rank + step);  // each rank its own tokens
    at::Tensor data = at::randint(vocab, {absl::GetFlag(FLAGS_batch), seq + 1}, at::kLong);
    at::Tensor tokens = data.narrow(1, 0, seq), targets = data.narrow(1, 1, seq);
    const auto t0 = Clock::now();
    opt.zero_grad();
    at::Tensor logits = sdp ? sdp->forward(tokens) : model(tokens);
    at::Tensor loss =
        torch::nn::functional::cross_entropy(logits.reshape({-1, vocab}), targets.reshape({-1}));
    loss.backward();
    if (!sdp && comm->size() > 1) AllReduceGrads(*model, *comm);
    opt.step();
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    if (!std::isfinite(loss.item<double>())) Die(config + ": loss is not finite");
    if (step >= warmup) times.push_back(dt);
  }
  r.peak_bytes = tracker->peak_bytes();
  if (plain) {
    for (const auto& item : plain->state()) {
      const auto& s = static_cast<const torch::optim::AdamParamState&>(*item.second);
      r.state_bytes += s.exp_avg().nbytes() + s.exp_avg_sq().nbytes();
    }
  } else {
    r.state_bytes = sharded->local_state_bytes();
  }
  std::sort(times.begin(), times.end());
  r.median_s = times[times.size() / 2];
  absl::Status st = comm->Barrier().Wait();
  if (!st.ok()) Die(st.ToString());
  return r;
}

int RunRank(int rank, int n, const std::string& dir) {
  TrackingCpuAllocator* tracker = TrackingCpuAllocator::Install();
  at::set_num_threads(absl::GetFlag(FLAGS_threads));
  auto created = comm::bench::Connect({rank, n, dir});
  if (!created.ok()) Die(created.status().ToString());
  std::shared_ptr<comm::Communicator> comm = *std::move(created);
  std::ofstream out(absl::StrCat(dir, "/rank", rank, ".tsv"));
  for (const std::string& c : Configs()) {
    const RankResult r = RunConfig(c, tracker, rank, comm);
    out << c << '\t' << r.median_s << '\t' << r.peak_bytes << '\t' << r.state_bytes << '\t'
        << r.param_bytes << '\n';
  }
  out.close();
  absl::Status st = comm->Barrier().Wait();
  if (!st.ok()) Die(st.ToString());
  return 0;
}

struct Row {
  std::string config;
  double step_s = 0;         // slowest rank's median
  int64_t peak_bytes = 0;    // largest rank's
  int64_t state_max = 0;     // largest rank's optimizer state
  int64_t state_total = 0;   // all ranks' optimizer state
  int64_t param_bytes = 0;
};

std::vector<Row> RunWorld(int n) {
  absl::StatusOr<std::string> ran = comm::bench::RunRanks(
      "FS_OSS_BENCH", n,
      comm::bench::ForwardFlags({"blocks", "width", "heads", "seq", "batch", "vocab", "warmup",
                                 "steps", "threads", "configs"}),
      absl::Seconds(absl::GetFlag(FLAGS_rank_timeout_s)));
  if (!ran.ok()) Die(absl::StrCat("at ", n, " ranks: ", ran.status().ToString()));
  const std::string dir = *ran;
  std::map<std::string, Row> by_config;
  for (int r = 0; r < n; ++r) {
    std::ifstream in(absl::StrCat(dir, "/rank", r, ".tsv"));
    std::string line;
    while (std::getline(in, line)) {
      std::vector<std::string> f = absl::StrSplit(line, '\t');
      if (f.size() != 5) continue;
      double median = 0;
      int64_t peak = 0, state = 0, params = 0;
      (void)absl::SimpleAtod(f[1], &median);
      (void)absl::SimpleAtoi(f[2], &peak);
      (void)absl::SimpleAtoi(f[3], &state);
      (void)absl::SimpleAtoi(f[4], &params);
      Row& row = by_config[f[0]];
      row.config = f[0];
      row.step_s = std::max(row.step_s, median);
      row.peak_bytes = std::max(row.peak_bytes, peak);
      row.state_max = std::max(row.state_max, state);
      row.state_total += state;
      row.param_bytes = params;
    }
  }
  std::vector<Row> rows;
  for (const std::string& c : Configs()) {
    if (!by_config.count(c)) Die(absl::StrCat("no result for ", c, " at ", n, " ranks"));
    rows.push_back(by_config[c]);
  }
  return rows;
}

double MiB(int64_t b) { return b / 1048576.0; }

int Main() {
  std::string table = absl::StrFormat(
      "GPT: %d blocks, width %d, %d heads, seq %d, batch %d/rank, vocab %d; Adam; %d warm-up + "
      "%d timed steps; tcp, %d intra-op thread(s) per rank\n\n"
      "| ranks | config | step ms | vs ddp | peak MiB | vs ddp | Adam state MiB (max rank) | "
      "x N / unsharded |\n|---|---|---|---|---|---|---|---|\n",
      absl::GetFlag(FLAGS_blocks), absl::GetFlag(FLAGS_width), absl::GetFlag(FLAGS_heads),
      absl::GetFlag(FLAGS_seq), absl::GetFlag(FLAGS_batch), absl::GetFlag(FLAGS_vocab),
      absl::GetFlag(FLAGS_warmup), absl::GetFlag(FLAGS_steps), absl::GetFlag(FLAGS_threads));
  for (absl::string_view w : absl::StrSplit(absl::GetFlag(FLAGS_ranks), ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(w, &n) || n < 1) Die(absl::StrCat("bad --ranks entry '", w, "'"));
    std::fprintf(stderr, "world size %d...\n", n);
    const std::vector<Row> rows = RunWorld(n);
    const Row* ddp = nullptr;
    for (const Row& row : rows) {
      if (row.config == "ddp") ddp = &row;
    }
    for (const Row& row : rows) {
      // Unsharded Adam state = 2 x parameter bytes; a perfect partition holds 1/N of it.
      const double balance = static_cast<double>(row.state_max) * n / (2.0 * row.param_bytes);
      absl::StrAppend(
          &table,
          absl::StrFormat("| %d | %s | %.1f | %s | %.1f | %s | %.2f | %.4f |\n", n, row.config,
                          row.step_s * 1e3,
                          ddp ? absl::StrFormat("%.3f", row.step_s / ddp->step_s) : "-",
                          MiB(row.peak_bytes),
                          ddp ? absl::StrFormat("%.3f", static_cast<double>(row.peak_bytes) /
                                                            ddp->peak_bytes)
                              : "-",
                          MiB(row.state_max), balance));
    }
  }
  std::fputs(table.c_str(), stdout);
  if (!absl::GetFlag(FLAGS_out).empty()) std::ofstream(absl::GetFlag(FLAGS_out)) << table;
  return 0;
}

}  // namespace
}  // namespace fairscale::oss::bench

constexpr char kUsage[] =
    "step time, peak memory and optimizer-state bytes of DDP-style Adam vs OSS (ZeRO-1)\n"
    "and OSS + ShardedDataParallel (ZeRO-2) on the GPT model, ranks as processes over tcp\n"
    "(oss/bench/README.md).\n"
    "\n"
    "  OMP_NUM_THREADS=1 oss_bench --ranks=1,2,4\n"
    "\n"
    "Environment read: TEST_TMPDIR (where the ranks' directory goes, else /tmp);\n"
    "FS_OSS_BENCH_RANK, FS_OSS_BENCH_SIZE, FS_OSS_BENCH_DIR are set by the\n"
    "benchmark for its ranks.";

int main(int argc, char** argv) {
  fairscale::base::ParseCommandLine(argc, argv, kUsage);
  if (auto me = fairscale::comm::bench::RankFromEnv("FS_OSS_BENCH")) {
    return fairscale::oss::bench::RunRank(me->rank, me->size, me->dir);
  }
  return fairscale::oss::bench::Main();
}
