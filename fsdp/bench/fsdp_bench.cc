// FSDP benchmark: a GPT-style model (token + position embeddings, pre-norm transformer blocks,
// LM head) trained with Adam at 1, 2, 4, ... ranks as real processes over the tcp backend, for
// each sharding strategy (every block its own FSDP unit, plus the root), against the same model
// unwrapped. See README.md in this directory for the table, the command and the reading.
//
//   OMP_NUM_THREADS=1 ./bazelw run -c opt //fsdp/bench:fsdp_bench -- --ranks=1,2,4
//
// The parent spawns `n` copies of itself per world size (posix_spawn of /proc/self/exe, a
// FileStore rendezvous in a fresh directory). Each copy installs TrackingCpuAllocator, creates
// one tcp communicator and runs the configurations in turn; every rank trains on its own batch
// (weak scaling), so the unwrapped row at n ranks is n independent single-process trainings
// running side by side: the same per-rank work and core contention, without communication.
// Per configuration each rank writes its median step time and its peak tensor bytes (the peak is
// reset after the model and optimizer are built, so it covers the training steps only; the
// optimizer state is allocated in the first step and counted). The parent reports the slowest
// rank's median and the largest peak.
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
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
#include "examples/gpt/model.h"
#include "base/tracking_allocator.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/wrap.h"


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
ABSL_FLAG(std::string, configs, "unwrapped,FULL_SHARD,FULL_SHARD_LOWMEM,SHARD_GRAD_OP,NO_SHARD",
          "configurations to run, in this order (unwrapped is required: it is the baseline); "
          "an FSDP one with the suffix _PP (FULL_SHARD_PP, ...) runs the per-parameter layout, "
          "flatten_parameters(false)");
ABSL_FLAG(std::string, out, "", "also write the markdown table here");

namespace fairscale::fsdp::bench {
namespace {

namespace gpt = ::fairscale::examples::gpt;
using ::fairscale::base::TrackingCpuAllocator;

using Clock = std::chrono::steady_clock;

struct Shape {
  int64_t blocks, width, heads, seq, batch, vocab;
};

Shape FlagShape() {
  return {absl::GetFlag(FLAGS_blocks), absl::GetFlag(FLAGS_width), absl::GetFlag(FLAGS_heads),
          absl::GetFlag(FLAGS_seq),    absl::GetFlag(FLAGS_batch), absl::GetFlag(FLAGS_vocab)};
}

// The model is //examples/gpt:model's Gpt (the main job's model): inside an fsdp::EnableWrap
// scope every block becomes its own FullyShardedDataParallel unit, outside one it is the plain
// model.
gpt::GptConfig ConfigOf(const Shape& s) {
  return gpt::GptConfig().vocab(s.vocab).seq(s.seq).width(s.width).heads(s.heads).blocks(s.blocks);
}

int64_t ParamBytes(torch::nn::Module& m) {
  int64_t n = 0;
  for (const at::Tensor& p : m.parameters()) n += p.numel() * p.element_size();
  return n;
}

void Die(const std::string& what) {
  std::fprintf(stderr, "fsdp_bench: %s\n", what.c_str());
  std::exit(1);
}

// One configuration's per-rank result, as written to the rank's result file.
struct RankResult {
  std::string config;
  double median_s = 0;
  int64_t peak_bytes = 0;
  int64_t activation_bytes = 0;       // tensor bytes that forward (and the loss) add
  int64_t phase_peak[3] = {0, 0, 0};  // forward, backward, optimizer step
};

std::vector<std::string> Configs() {
  return absl::StrSplit(absl::GetFlag(FLAGS_configs), ',', absl::SkipEmpty());
}

// FULL_SHARD variants (not in the default --configs): the prefetch modes and the all-gather limit.
//   FULL_SHARD_BWD_POST      backward_prefetch(kBackwardPost)
//   FULL_SHARD_NO_PREFETCH   backward_prefetch(kNone).forward_prefetch(false)
//   FULL_SHARD_AG<k>         all_gathers_in_flight(k), k in 1..9
// Returns false for a name that is not a FULL_SHARD variant.
bool ApplyFullShardVariant(const std::string& config, FsdpOptions* opts) {
  if (config == "FULL_SHARD") return true;
  // The low-memory setting: no backward prefetch, no reduction left running while the next
  // unit assembles its gradient.
  if (config == "FULL_SHARD_LOWMEM") {
    opts->backward_prefetch(BackwardPrefetch::kNone).reductions_in_flight(0);
    return true;
  }
  if (config == "FULL_SHARD_BWD_POST") {
    opts->backward_prefetch(BackwardPrefetch::kBackwardPost);
    return true;
  }
  if (config == "FULL_SHARD_NO_PREFETCH") {
    opts->backward_prefetch(BackwardPrefetch::kNone).forward_prefetch(false);
    return true;
  }
  if (config.size() == 14 && absl::StartsWith(config, "FULL_SHARD_AG") && config[13] >= '1' &&
      config[13] <= '9') {
    opts->all_gathers_in_flight(config[13] - '0');
    return true;
  }
  return false;
}

// "<config>_DET": the same in deterministic mode (deterministic(true).micro_batches(world):
// each rank's batch is one micro-batch, the same work as the default mode), after any _PP.
bool Det(const std::string& config) { return absl::EndsWith(config, "_DET"); }
std::string NoDet(const std::string& config) {
  return Det(config) ? config.substr(0, config.size() - 4) : config;
}
// "<config>_PP": the same with flatten_parameters(false), the per-parameter (FSDP2) layout.
bool PerParam(const std::string& config) { return absl::EndsWith(NoDet(config), "_PP"); }
std::string FlatConfig(const std::string& config) {
  const std::string c = NoDet(config);
  return PerParam(c) ? c.substr(0, c.size() - 3) : c;
}

// HYBRID_SHARD_G<g> / HYBRID_SHARD_ZERO2_G<g> (not in the default --configs): hybrid sharding
// over groups of g consecutive ranks, g in 1..9; run only at world sizes g divides. Returns g, or
// 0 for a name that is not one of them.
int HybridGroupOf(const std::string& with_pp) {
  const std::string config = FlatConfig(with_pp);
  for (const char* prefix : {"HYBRID_SHARD_G", "HYBRID_SHARD_ZERO2_G"}) {
    const std::string p = prefix;
    if (config.size() == p.size() + 1 && absl::StartsWith(config, p) && config.back() >= '1' &&
        config.back() <= '9') {
      return config.back() - '0';
    }
  }
  return 0;
}

// Whether `config` runs at world size `n`.
bool RunsAt(const std::string& config, int n) {
  const int g = HybridGroupOf(config);
  return g == 0 || n % g == 0;
}

ShardingStrategy StrategyOf(const std::string& with_pp) {
  const std::string config = FlatConfig(with_pp);
  FsdpOptions ignored;
  if (ApplyFullShardVariant(config, &ignored)) return ShardingStrategy::kFullShard;
  if (HybridGroupOf(config) > 0) {
    return absl::StartsWith(config, "HYBRID_SHARD_ZERO2") ? ShardingStrategy::kHybridShardZero2
                                                          : ShardingStrategy::kHybridShard;
  }
  if (config == "SHARD_GRAD_OP") return ShardingStrategy::kShardGradOp;
  if (config == "NO_SHARD") return ShardingStrategy::kNoShard;
  Die(absl::StrCat("unknown configuration '", config, "' in --configs"));
  return ShardingStrategy::kNoShard;
}

// Trains one configuration on this rank and measures it. The peak is tracked per phase (the
// tracker's peak is reset at each phase start), so the table can say where it occurs.
template <typename M>
RankResult Train(const std::string& config, M& model, TrackingCpuAllocator* tracker, const Shape& s,
                 int rank, comm::Communicator* comm) {
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-4));
  RankResult r;
  r.config = config;
  std::vector<double> times;
  const int warmup = absl::GetFlag(FLAGS_warmup), steps = absl::GetFlag(FLAGS_steps);
  for (int step = 0; step < warmup + steps; ++step) {
    // Each rank its own tokens; the targets are the next tokens.
    torch::manual_seed(1000 + 7919 * rank + step);
    at::Tensor data = at::randint(s.vocab, {s.batch, s.seq + 1}, at::kLong);
    at::Tensor tokens = data.narrow(1, 0, s.seq), targets = data.narrow(1, 1, s.seq);
    const auto t0 = Clock::now();
    opt.zero_grad();
    const int64_t before_forward = tracker->live_bytes();
    tracker->reset_peak();
    at::Tensor logits = model(tokens);
    at::Tensor loss =
        torch::nn::functional::cross_entropy(logits.reshape({-1, s.vocab}), targets.reshape({-1}));
    r.phase_peak[0] = std::max(r.phase_peak[0], tracker->peak_bytes());
    r.activation_bytes = std::max(r.activation_bytes, tracker->peak_bytes() - before_forward);
    tracker->reset_peak();
    loss.backward();
    r.phase_peak[1] = std::max(r.phase_peak[1], tracker->peak_bytes());
    tracker->reset_peak();
    opt.step();
    r.phase_peak[2] = std::max(r.phase_peak[2], tracker->peak_bytes());
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    if (!std::isfinite(loss.item<double>())) Die(absl::StrCat(config, ": loss is not finite"));
    if (step >= warmup) times.push_back(dt);
  }
  r.peak_bytes = *std::max_element(r.phase_peak, r.phase_peak + 3);
  std::sort(times.begin(), times.end());
  r.median_s = times[times.size() / 2];
  if (comm != nullptr) {
    absl::Status st = comm->Barrier().Wait();
    if (!st.ok()) Die(st.ToString());
  }
  return r;
}

int RunRank(int rank, int n, const std::string& dir) {
  TrackingCpuAllocator* tracker = TrackingCpuAllocator::Install();
  at::set_num_threads(absl::GetFlag(FLAGS_threads));
  const Shape s = FlagShape();
  auto created = comm::bench::Connect({rank, n, dir});
  if (!created.ok()) Die(created.status().ToString());
  std::shared_ptr<comm::Communicator> comm = *std::move(created);

  std::ofstream out(absl::StrCat(dir, "/rank", rank, ".tsv"));
  for (const std::string& config_name : Configs()) {
    if (!RunsAt(config_name, comm->size())) continue;
    RankResult r;
    int64_t param_bytes = 0;
    torch::manual_seed(0);  // same initial weights on every rank
    if (config_name == "unwrapped") {
      gpt::Gpt model(ConfigOf(s));
      param_bytes = ParamBytes(*model);
      r = Train(config_name, model, tracker, s, rank, comm.get());
    } else {
      auto opts = FsdpOptions()
                      .sharding_strategy(StrategyOf(config_name))
                      .flatten_parameters(!PerParam(config_name));
      ApplyFullShardVariant(FlatConfig(config_name), &opts);
      if (HybridGroupOf(config_name) > 0) opts.hybrid_shard_group_size(HybridGroupOf(config_name));
      if (Det(config_name)) opts.deterministic(true).micro_batches(comm->size());
      FullyShardedDataParallel model{nullptr};
      {
        EnableWrap scope(comm, opts, gpt::GptWrapPolicy());
        model = FullyShardedDataParallel(gpt::Gpt(ConfigOf(s)), comm, opts);
      }
      r = Train(config_name, model, tracker, s, rank, comm.get());
    }
    out << r.config << '\t' << r.median_s << '\t' << r.peak_bytes << '\t' << r.activation_bytes
        << '\t' << param_bytes << '\t' << r.phase_peak[0] << '\t' << r.phase_peak[1] << '\t'
        << r.phase_peak[2] << '\n';
  }
  out.close();
  absl::Status st = comm->Barrier().Wait();
  if (!st.ok()) Die(st.ToString());
  return 0;
}

// Aggregated over the ranks of one world size.
struct Row {
  int n = 0;
  std::string config;
  double step_s = 0;       // slowest rank's median
  int64_t peak_bytes = 0;  // largest rank's peak
  int64_t phase_peak[3] = {0, 0, 0};
};

struct WorldResult {
  std::vector<Row> rows;
  int64_t activation_bytes = 0;
  int64_t param_bytes = 0;
};

int RunWorld(int n, WorldResult* result) {
  absl::StatusOr<std::string> ran = comm::bench::RunRanks(
      "FS_FSDP_BENCH", n,
      comm::bench::ForwardFlags({"blocks", "width", "heads", "seq", "batch", "vocab", "warmup",
                                 "steps", "threads", "configs"}),
      absl::Seconds(absl::GetFlag(FLAGS_rank_timeout_s)));
  if (!ran.ok()) {
    std::fprintf(stderr, "fsdp_bench: at %d ranks: %s\n", n, ran.status().ToString().c_str());
    return 1;
  }
  const std::string dir = *ran;
  std::map<std::string, Row> by_config;
  for (int r = 0; r < n; ++r) {
    std::ifstream in(absl::StrCat(dir, "/rank", r, ".tsv"));
    std::string line;
    while (std::getline(in, line)) {
      std::vector<std::string> f = absl::StrSplit(line, '\t');
      if (f.size() != 8) continue;
      double median = 0;
      int64_t peak = 0, act = 0, params = 0;
      (void)absl::SimpleAtod(f[1], &median);
      (void)absl::SimpleAtoi(f[2], &peak);
      (void)absl::SimpleAtoi(f[3], &act);
      (void)absl::SimpleAtoi(f[4], &params);
      Row& row = by_config[f[0]];
      row.n = n;
      row.config = f[0];
      row.step_s = std::max(row.step_s, median);
      row.peak_bytes = std::max(row.peak_bytes, peak);
      for (int k = 0; k < 3; ++k) {
        int64_t v = 0;
        (void)absl::SimpleAtoi(f[5 + k], &v);
        row.phase_peak[k] = std::max(row.phase_peak[k], v);
      }
      // The activations enter the bounds: those of the unwrapped model.
      if (f[0] == "unwrapped") result->activation_bytes = std::max(result->activation_bytes, act);
      result->param_bytes = std::max(result->param_bytes, params);
    }
  }
  for (const std::string& c : Configs()) {
    if (!RunsAt(c, n)) continue;
    if (!by_config.count(c)) Die(absl::StrCat("no result for ", c, " at ", n, " ranks"));
    result->rows.push_back(by_config[c]);
  }
  return 0;
}

double MiB(int64_t b) { return b / 1048576.0; }

// The peak-memory bound of `row` (see README.md): params + grads + Adam's two moments = 4 P;
// sharded strategies divide it by N. FULL_SHARD then holds one full unit at a time (the issue's
// bound); SHARD_GRAD_OP keeps every full parameter from forward to backward; NO_SHARD and
// unwrapped hold everything. `p`: parameter bytes, `a`: activation bytes.
int64_t BoundBytes(const Row& row, int64_t p, int64_t a, int64_t unit_bytes) {
  if (row.config == "unwrapped") return 4 * p + a;
  switch (StrategyOf(row.config)) {
    case ShardingStrategy::kFullShard:
      return 4 * p / row.n + unit_bytes + a;
    case ShardingStrategy::kShardGradOp:
      return 4 * p / row.n + p + a;
    case ShardingStrategy::kHybridShard:  // sharded over g
      return 4 * p / HybridGroupOf(row.config) + unit_bytes + a;
    case ShardingStrategy::kHybridShardZero2:
      return 4 * p / HybridGroupOf(row.config) + p + a;
    default:
      return 4 * p + a;
  }
}

// The step time of configuration `config` in `w` (0 if it did not run).
double StepOf(const WorldResult& w, const std::string& config) {
  for (const Row& row : w.rows) {
    if (row.config == config) return row.step_s;
  }
  return 0;
}

// The lines under the table for one world size: overhead at 1 rank, per-parameter vs flat,
// FULL_SHARD vs NO_SHARD at 2 ranks.
std::string Summary(const WorldResult& w) {
  std::string summary;
  const double unwrapped_s = StepOf(w, "unwrapped");
  double unwrapped_peak = 0;
  for (const Row& row : w.rows) {
    if (row.config == "unwrapped") unwrapped_peak = static_cast<double>(row.peak_bytes);
  }
  const int n = w.rows.front().n;
  if (n == 1) {
    for (const Row& row : w.rows) {
      if (row.config == "unwrapped") continue;
      absl::StrAppend(&summary,
                      absl::StrFormat("overhead at 1 rank, %s: %+.1f%% (target <= 5%%)\n",
                                      row.config, (row.step_s / unwrapped_s - 1) * 100));
    }
  }
  for (const Row& row : w.rows) {
    if (!Det(row.config)) continue;
    const double base_s = StepOf(w, NoDet(row.config));
    double base_peak = 0;
    for (const Row& base : w.rows) {
      if (base.config == NoDet(row.config)) base_peak = static_cast<double>(base.peak_bytes);
    }
    if (base_s <= 0 || base_peak <= 0) continue;
    absl::StrAppend(&summary,
                    absl::StrFormat("%s / %s at %d ranks: step time %.3f%s, peak %.3f\n",
                                    row.config, NoDet(row.config), n, row.step_s / base_s,
                                    n == 2 ? " (target <= 1.25)" : "",
                                    static_cast<double>(row.peak_bytes) / base_peak));
  }
  for (const Row& row : w.rows) {
    if (!PerParam(row.config) || Det(row.config)) continue;
    for (const Row& flat : w.rows) {
      if (flat.config != FlatConfig(row.config)) continue;
      absl::StrAppend(&summary,
                      absl::StrFormat("%s vs %s at %d ranks: step time %.3f, peak %.3f; vs "
                                      "unwrapped: step time %.3f, peak %.3f\n",
                                      row.config, flat.config, n, row.step_s / flat.step_s,
                                      static_cast<double>(row.peak_bytes) / flat.peak_bytes,
                                      row.step_s / unwrapped_s,
                                      static_cast<double>(row.peak_bytes) / unwrapped_peak));
    }
  }
  const double full_s = StepOf(w, "FULL_SHARD"), no_s = StepOf(w, "NO_SHARD");
  if (n == 2 && full_s > 0 && no_s > 0) {
    absl::StrAppend(&summary,
                    absl::StrFormat("FULL_SHARD / NO_SHARD at 2 ranks: %.3f (target <= 1.15)\n",
                                    full_s / no_s));
  }
  return summary;
}

int Main() {
  const Shape s = FlagShape();
  std::vector<WorldResult> worlds;
  for (absl::string_view r : absl::StrSplit(absl::GetFlag(FLAGS_ranks), ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(r, &n) || n < 1) Die(absl::StrCat("bad --ranks entry '", r, "'"));
    std::fprintf(stderr, "world size %d...\n", n);
    WorldResult w;
    if (RunWorld(n, &w) != 0) return 1;
    worlds.push_back(std::move(w));
  }
  // The units: each transformer block (12 w^2 + 13 w parameters), the embeddings
  // ((vocab + seq) w) and the head (final LayerNorm + linear: w vocab + vocab + 2 w).
  const int64_t unit_bytes =
      std::max({12 * s.width * s.width + 13 * s.width, (s.vocab + s.seq) * s.width,
                s.width * s.vocab + s.vocab + 2 * s.width}) *
      4;
  std::string table = absl::StrFormat(
      "GPT: %d blocks, width %d, %d heads, seq %d, batch %d/rank, vocab %d; Adam; "
      "%d warm-up + %d timed steps; params %.1f MiB, largest unit %.1f MiB, activations %.1f "
      "MiB\n\n"
      "| ranks | config | step ms | vs unwrapped | tokens/s | peak MiB | bound MiB | "
      "peak/bound | peak fwd / bwd / step MiB |\n|---|---|---|---|---|---|---|---|---|\n",
      s.blocks, s.width, s.heads, s.seq, s.batch, s.vocab, absl::GetFlag(FLAGS_warmup),
      absl::GetFlag(FLAGS_steps), MiB(worlds.empty() ? 0 : worlds[0].param_bytes), MiB(unit_bytes),
      MiB(worlds.empty() ? 0 : worlds[0].activation_bytes));
  std::string summary;
  for (const WorldResult& w : worlds) {
    const int64_t p = w.param_bytes, a = w.activation_bytes;
    const double unwrapped_s = StepOf(w, "unwrapped");
    for (const Row& row : w.rows) {
      const int64_t bound = BoundBytes(row, p, a, unit_bytes);
      const double tokens = static_cast<double>(row.n) * s.batch * s.seq;
      absl::StrAppend(
          &table,
          absl::StrFormat("| %d | %s | %.1f | %.3f | %.0f | %.1f | %.1f | %.3f | "
                          "%.0f / %.0f / %.0f |\n",
                          row.n, row.config, row.step_s * 1e3, row.step_s / unwrapped_s,
                          tokens / row.step_s, MiB(row.peak_bytes), MiB(bound),
                          static_cast<double>(row.peak_bytes) / bound, MiB(row.phase_peak[0]),
                          MiB(row.phase_peak[1]), MiB(row.phase_peak[2])));
    }
    absl::StrAppend(&summary, Summary(w));
  }
  table += "\n" + summary;
  std::fputs(table.c_str(), stdout);
  if (!absl::GetFlag(FLAGS_out).empty()) std::ofstream(absl::GetFlag(FLAGS_out)) << table;
  return 0;
}

}  // namespace
}  // namespace fairscale::fsdp::bench

constexpr char kUsage[] =
    "step time and peak memory of a GPT trained with each FSDP strategy against the\n"
    "unwrapped model, ranks as processes over tcp (fsdp/bench/README.md).\n"
    "\n"
    "  OMP_NUM_THREADS=1 fsdp_bench --ranks=1,2,4\n"
    "\n"
    "Environment read: TEST_TMPDIR (where the ranks' directory goes, else /tmp);\n"
    "FS_FSDP_BENCH_RANK, FS_FSDP_BENCH_SIZE, FS_FSDP_BENCH_DIR are set by the\n"
    "benchmark for its ranks.";

int main(int argc, char** argv) {
  fairscale::base::ParseCommandLine(argc, argv, kUsage);
  if (auto me = fairscale::comm::bench::RankFromEnv("FS_FSDP_BENCH")) {
    return fairscale::fsdp::bench::RunRank(me->rank, me->size, me->dir);
  }
  return fairscale::fsdp::bench::Main();
}
