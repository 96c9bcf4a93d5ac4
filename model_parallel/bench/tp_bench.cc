// Tensor-parallel / MoE benchmark (issue 23 item 6): the main job's GPT (//examples/gpt) made
// wider, trained with Adam as real rank processes over the tcp backend on 127.0.0.1, in these
// configurations (see README.md in this directory for the table, the command and the reading):
//
//   dense_1   plain Gpt, 1 rank, batch B                       (the baseline)
//   dense_1_2t  the same with twice the intra-op threads (one process using both cores)
//   tp_2      TpGpt, T = 2 (Megatron), both ranks the same batch B (the same global batch)
//   fsdp_2    Gpt under FSDP FULL_SHARD (GptWrapPolicy), each rank B/2 rows of the same batch B
//   moe_1     Gpt with moe_experts E, 1 rank (all experts local), batch B; vs dense_1, which has
//             the same active parameters (a token's 2 experts of hidden 2C = the 4C dense MLP)
//   dense_2   plain Gpt, 2 ranks, each its own batch B, gradients all-reduced
//   moe_2     Gpt with moe_experts E over 2 ranks (E/2 experts each), each its own batch B, the
//             non-expert gradients all-reduced; vs dense_2
//
// The parent runs `--repeats` rounds; each round runs every configuration once, in order
// (interleaved repeats), each as fresh rank processes (comm::bench::RunRanks: posix_spawn of
// /proc/self/exe, FileStore rendezvous). A rank builds its model and Adam, then runs `--warmup`
// untimed and `--steps` timed steps; a step is zero_grad + forward + loss + backward (+ the
// gradient all-reduce of dense_2/moe_2) + Adam step, started together on every rank (barrier)
// and its time the slowest rank's (all-reduce max on the uncounted communicator). The rank's
// model communicator is wrapped in comm::testing::CountingCommunicator, reset before the last
// timed step, so the bytes are those of one step. Reported per configuration: the median over
// rounds of each round's median step, tokens/s, the median over rounds of the round's ratio
// (tokens/s vs the baseline of the same round), the step's process CPU time summed over the ranks
// and CPU per token vs the baseline (the load-robust number on a shared machine), per-rank
// parameter bytes, bytes per collective (checked against the theory: "check ...: equal").
//
//   OMP_NUM_THREADS=1 ./bazelw run //model_parallel/bench:tp_bench -- --repeats=5 --warmup=1 --steps=3
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/ops/randint.h>
#include <c10/util/Exception.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "base/flags.h"
#include "comm/bench/harness.h"
#include "comm/communicator.h"
#include "comm/testing/counting_communicator.h"
#include "examples/gpt/model.h"
#include "examples/gpt/tp_model.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/wrap.h"
#include "pipe/grid.h"

ABSL_FLAG(std::string, configs, "dense_1,dense_1_2t,tp_2,fsdp_2,moe_1,dense_2,moe_2",
          "configurations, run in this order in every round (dense_1 is the baseline of every "
          "row but moe_2, whose baseline is dense_2)");
ABSL_FLAG(int, repeats, 5, "rounds over the configurations (medians over rounds)");
ABSL_FLAG(int, warmup, 1, "untimed steps per run");
ABSL_FLAG(int, steps, 3, "timed steps per run (the run's median)");
ABSL_FLAG(int, blocks, 4, "transformer blocks");
ABSL_FLAG(int, width, 512, "model width C");
ABSL_FLAG(int, heads, 8, "attention heads");
ABSL_FLAG(int, seq, 128, "tokens per sequence");
ABSL_FLAG(int, vocab, 1024, "vocabulary size");
ABSL_FLAG(int, batch, 4, "sequences per step per data-parallel replica (B)");
ABSL_FLAG(int, experts, 4, "experts per MoE block (moe_1, moe_2)");
ABSL_FLAG(double, aux_coef, 0.01, "weight of the MoE load-balancing loss");
ABSL_FLAG(int, threads, 1, "intra-op threads per rank (dense_1_2t: twice this)");
ABSL_FLAG(int, rank_timeout_s, 1800, "ranks still running after this long are killed");
ABSL_FLAG(std::string, out, "", "also write the table here");
// Set by the parent for its ranks.
ABSL_FLAG(std::string, run_config, "", "(internal) the configuration a rank process runs");

namespace fairscale::model_parallel::bench {
namespace {

namespace gpt = ::fairscale::examples::gpt;
using Clock = std::chrono::steady_clock;
using comm::OpType;

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "tp_bench: %s\n", what.c_str());
  std::exit(1);
}

void Check(const absl::Status& s) {
  if (!s.ok()) Die(s.ToString());
}

struct ConfigInfo {
  std::string name;
  int ranks;
  bool own_batch;        // each rank its own B rows (else the global batch is B)
  std::string baseline;  // the row its ratio is against
};

ConfigInfo InfoOf(const std::string& name) {
  if (name == "dense_1") return {name, 1, true, "dense_1"};
  if (name == "dense_1_2t") return {name, 1, true, "dense_1"};
  if (name == "tp_2") return {name, 2, false, "dense_1"};
  if (name == "fsdp_2") return {name, 2, false, "dense_1"};
  if (name == "moe_1") return {name, 1, true, "dense_1"};
  if (name == "dense_2") return {name, 2, true, "dense_1"};
  if (name == "moe_2") return {name, 2, true, "dense_2"};
  Die(absl::StrCat("unknown configuration '", name, "' in --configs"));
}

std::vector<std::string> Configs() {
  std::vector<std::string> out = absl::StrSplit(absl::GetFlag(FLAGS_configs), ',',
                                                absl::SkipEmpty());
  for (const std::string& c : out) InfoOf(c);
  return out;
}

gpt::GptConfig DenseConfig() {
  return gpt::GptConfig()
      .vocab(absl::GetFlag(FLAGS_vocab))
      .seq(absl::GetFlag(FLAGS_seq))
      .width(absl::GetFlag(FLAGS_width))
      .heads(absl::GetFlag(FLAGS_heads))
      .blocks(absl::GetFlag(FLAGS_blocks));
}

int64_t Bytes(const std::vector<at::Tensor>& params) {
  int64_t n = 0;
  for (const at::Tensor& p : params) n += p.numel() * p.element_size();
  return n;
}

// CPU time of this process, every thread (the tcp backend's included).
double ProcessCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

bool IsExpert(const std::string& name) { return name.find(".moe.experts.") != std::string::npos; }

// What one configuration trains on a rank: its parameters and the loss of a batch.
struct Model {
  std::vector<at::Tensor> params;
  std::function<at::Tensor(const at::Tensor& tokens, const at::Tensor& targets)> loss;
  std::function<void()> after_backward = [] {};
  std::shared_ptr<torch::nn::Module> holder;  // keeps the module alive
};

at::Tensor CrossEntropy(const at::Tensor& logits, const at::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                              targets.reshape({-1}));
}

Model Build(const std::string& config, const std::shared_ptr<comm::Communicator>& comm) {
  Model m;
  torch::manual_seed(0);  // the same initial weights on every rank
  const double aux = absl::GetFlag(FLAGS_aux_coef);
  if (config == "dense_1" || config == "dense_1_2t" || config == "dense_2") {
    gpt::Gpt model(DenseConfig());
    m.holder = model.ptr();
    m.params = model->parameters();
    m.loss = [model](const at::Tensor& x, const at::Tensor& y) mutable {
      return CrossEntropy(model(x), y);
    };
    if (config == "dense_2") {
      m.after_backward = [params = m.params, comm] { pipe::all_reduce_gradients(params, *comm); };
    }
  } else if (config == "moe_1" || config == "moe_2") {
    gpt::Gpt model(DenseConfig().moe_experts(absl::GetFlag(FLAGS_experts)), comm);
    m.holder = model.ptr();
    m.params = model->parameters();
    m.loss = [model, aux](const at::Tensor& x, const at::Tensor& y) mutable {
      at::Tensor ce = CrossEntropy(model(x), y);  // before aux_loss(): the forward sets it
      return ce + aux * model->aux_loss();
    };
    if (config == "moe_2") {
      // The experts are rank-local (their gradients already hold both ranks' tokens); every
      // other parameter is replicated: average its gradient.
      std::vector<at::Tensor> replicated;
      for (const auto& p : model->named_parameters()) {
        if (!IsExpert(p.key())) replicated.push_back(p.value());
      }
      m.after_backward = [replicated, comm] { pipe::all_reduce_gradients(replicated, *comm); };
    }
  } else if (config == "tp_2") {
    gpt::TpGpt model(DenseConfig(), comm, /*init_seed=*/0);
    m.holder = model.ptr();
    m.params = model->parameters();
    m.loss = [model](const at::Tensor& x, const at::Tensor& y) mutable {
      return model->loss(x, y);
    };
  } else if (config == "fsdp_2") {
    auto opts = fsdp::FsdpOptions().sharding_strategy(fsdp::ShardingStrategy::kFullShard);
    fsdp::FullyShardedDataParallel model{nullptr};
    {
      fsdp::EnableWrap scope(comm, opts, gpt::GptWrapPolicy());
      model = fsdp::FullyShardedDataParallel(gpt::Gpt(DenseConfig()), comm, opts);
    }
    m.holder = model.ptr();
    m.params = model->parameters();
    m.loss = [model](const at::Tensor& x, const at::Tensor& y) mutable {
      return CrossEntropy(model(x), y);
    };
  } else {
    Die(absl::StrCat("unknown configuration ", config));
  }
  return m;
}

constexpr OpType kCounted[] = {OpType::kAllReduce, OpType::kAllGather, OpType::kReduceScatter,
                               OpType::kAllToAll};

// One rank process: builds the configuration, trains, writes one line to <dir>/rank<r>.tsv:
// median step seconds (the slowest rank's per step), parameter bytes, the last loss, then
// (ops, bytes) of all_reduce, all_gather, reduce_scatter, all_to_all in the last timed step.
int RunRankBody(const comm::bench::BenchRank& me) {
  const std::string config = absl::GetFlag(FLAGS_run_config);
  const ConfigInfo info = InfoOf(config);
  if (info.ranks != me.size) Die(absl::StrCat(config, " runs at ", info.ranks, " ranks"));
  at::set_num_threads((config == "dense_1_2t" ? 2 : 1) * absl::GetFlag(FLAGS_threads));
  auto created = comm::bench::Connect(me);
  if (!created.ok()) Die(created.status().ToString());
  std::shared_ptr<comm::Communicator> world = *std::move(created);
  auto counting = std::make_shared<comm::testing::CountingCommunicator>(world);

  Model model = Build(config, counting);
  torch::optim::Adam opt(model.params, torch::optim::AdamOptions(1e-4));
  const int64_t batch = absl::GetFlag(FLAGS_batch), seq = absl::GetFlag(FLAGS_seq),
                vocab = absl::GetFlag(FLAGS_vocab);
  const int warmup = absl::GetFlag(FLAGS_warmup), steps = absl::GetFlag(FLAGS_steps);
  std::vector<double> times, cpu_times;
  double last_loss = 0;
  for (int step = 0; step < warmup + steps; ++step) {
    // The step's global batch: its own for an own-batch configuration, else the same B rows on
    // every rank (tp_2 reads them all, fsdp_2 its B/2 rows).
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(
        1000 + 7919 * step + (info.own_batch ? 104729 * me.rank : 0));
    at::Tensor data = at::randint(0, vocab, {batch, seq + 1}, gen, at::TensorOptions(at::kLong));
    if (config == "fsdp_2") {
      if (batch % me.size != 0) Die("fsdp_2: --batch must be even");
      data = data.narrow(0, me.rank * batch / me.size, batch / me.size);
    }
    const at::Tensor tokens = data.narrow(1, 0, seq), targets = data.narrow(1, 1, seq);
    const bool last = step == warmup + steps - 1;
    Check(world->Barrier().Wait());
    if (last) counting->Reset();
    const auto t0 = Clock::now();
    const double cpu0 = ProcessCpuSeconds();
    opt.zero_grad();
    at::Tensor loss = model.loss(tokens, targets);
    loss.backward();
    model.after_backward();
    opt.step();
    double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    const double cpu = ProcessCpuSeconds() - cpu0;
    double slowest = dt;
    Check(world->AllReduce(comm::MakeConstBuffer(&dt, 1), comm::MakeBuffer(&slowest, 1),
                           comm::ReduceOp::kMax)
              .Wait());
    last_loss = loss.item<double>();
    if (!std::isfinite(last_loss)) Die(absl::StrCat(config, ": loss is not finite"));
    if (step >= warmup) {
      times.push_back(slowest);
      cpu_times.push_back(cpu);
    }
  }
  std::sort(times.begin(), times.end());
  std::sort(cpu_times.begin(), cpu_times.end());
  std::ofstream out(absl::StrCat(me.dir, "/rank", me.rank, ".tsv"));
  out << times[times.size() / 2] << '\t' << Bytes(model.params) << '\t' << last_loss;
  for (OpType t : kCounted) {
    const auto c = counting->count(t);
    out << '\t' << c.ops << '\t' << c.bytes;
  }
  out << '\t' << cpu_times[cpu_times.size() / 2] << '\n';
  out.close();
  Check(world->Barrier().Wait());
  return 0;
}

int RunRank(const comm::bench::BenchRank& me) {
  try {
    return RunRankBody(me);
  } catch (const c10::Error& e) {
    Die(e.what_without_backtrace());
  }
}

// One run of a configuration, aggregated over its ranks.
struct Run {
  double step_s = 0;
  double cpu_s = 0;  // CPU seconds per step, summed over the ranks (each rank's median)
  int64_t param_bytes = 0;  // the largest rank's
  double loss = 0;          // rank 0's
  int64_t ops[4] = {0, 0, 0, 0}, bytes[4] = {0, 0, 0, 0};  // rank 0's, per kCounted
};

Run RunOnce(const std::string& config) {
  const ConfigInfo info = InfoOf(config);
  std::vector<std::string> args = comm::bench::ForwardFlags(
      {"warmup", "steps", "blocks", "width", "heads", "seq", "vocab", "batch", "experts",
       "aux_coef", "threads"});
  args.push_back(absl::StrCat("--run_config=", config));
  absl::StatusOr<std::string> ran =
      comm::bench::RunRanks("FS_TP_BENCH", info.ranks, args,
                            absl::Seconds(absl::GetFlag(FLAGS_rank_timeout_s)));
  if (!ran.ok()) Die(absl::StrCat(config, ": ", ran.status().ToString()));
  Run run;
  for (int r = 0; r < info.ranks; ++r) {
    std::ifstream in(absl::StrCat(*ran, "/rank", r, ".tsv"));
    std::string line;
    std::getline(in, line);
    std::vector<std::string> f = absl::StrSplit(line, '\t');
    if (f.size() != 4 + 2 * std::size(kCounted)) Die(absl::StrCat(config, ": bad rank file"));
    double step = 0, loss = 0;
    int64_t params = 0;
    (void)absl::SimpleAtod(f[0], &step);
    (void)absl::SimpleAtoi(f[1], &params);
    (void)absl::SimpleAtod(f[2], &loss);
    run.step_s = std::max(run.step_s, step);
    double cpu = 0;
    (void)absl::SimpleAtod(f.back(), &cpu);
    run.cpu_s += cpu;
    run.param_bytes = std::max(run.param_bytes, params);
    if (r == 0) {
      run.loss = loss;
      for (size_t k = 0; k < std::size(kCounted); ++k) {
        (void)absl::SimpleAtoi(f[3 + 2 * k], &run.ops[k]);
        (void)absl::SimpleAtoi(f[4 + 2 * k], &run.bytes[k]);
      }
    }
  }
  std::error_code ignored;
  std::filesystem::remove_all(*ran, ignored);
  return run;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double MiB(double b) { return b / 1048576.0; }

std::string LoadAvg() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return absl::StrCat(a, " ", b, " ", c);
}

int64_t TokensPerStep(const std::string& config) {
  const ConfigInfo info = InfoOf(config);
  const int64_t replicas = info.own_batch ? info.ranks : 1;
  return replicas * absl::GetFlag(FLAGS_batch) * absl::GetFlag(FLAGS_seq);
}

// The theoretical bytes of the configuration's main collective(s) per step, as counted by
// CountingCommunicator (all_reduce and reduce_scatter: the send buffer; all_gather and
// all_to_all: the full receive buffer). `dense_params`: parameter bytes of the dense model,
// `replicated`: those of moe_2's non-expert parameters.
std::string Theory(const std::string& config, int64_t dense_params, int64_t replicated) {
  const int64_t b = absl::GetFlag(FLAGS_batch), t = absl::GetFlag(FLAGS_seq),
                c = absl::GetFlag(FLAGS_width), blocks = absl::GetFlag(FLAGS_blocks),
                e = absl::GetFlag(FLAGS_experts);
  const int64_t act = b * t * c * 4;  // one [B, t, C] f32 activation
  if (config == "tp_2") {
    // Per block 2 all-reduces forward (attention proj, fc2) and 2 backward (the inputs of the
    // column-parallel qkv and fc1); the vocab-parallel embedding forward and the head's input
    // backward; the cross-entropy's max and (sum-exp, target logit) over [B t].
    const int64_t bytes = (4 * blocks + 2) * act + 3 * b * t * 4;
    return absl::StrFormat("all_reduce %.2f", MiB(bytes));
  }
  if (config == "fsdp_2") {
    return absl::StrFormat("all_gather 2P = %.2f, reduce_scatter P = %.2f", MiB(2 * dense_params),
                           MiB(dense_params));
  }
  if (config == "dense_2") return absl::StrFormat("all_reduce P = %.2f", MiB(dense_params));
  if (config == "moe_2") {
    // Per MoE block: dispatch and combine forward, their transposes backward, each [E, C, C_model]
    // with E * C = 2 S (capacity factor 1, S = B t tokens of this rank).
    const int64_t moe_blocks = blocks / 2;
    const int64_t cap = (2 * b * t + e - 1) / e;
    const int64_t a2a = 4 * moe_blocks * e * cap * c * 4;
    return absl::StrFormat("all_reduce P_non-expert = %.2f, all_to_all %.2f", MiB(replicated),
                           MiB(a2a));
  }
  return "-";
}

int Main() {
  const std::vector<std::string> configs = Configs();
  const int repeats = absl::GetFlag(FLAGS_repeats);
  if (repeats < 1) Die("--repeats must be >= 1");
  const std::string load_before = LoadAvg();
  std::map<std::string, std::vector<Run>> runs;
  std::vector<std::string> round_load;  // /proc/loadavg at the start of each round
  const auto t0 = Clock::now();
  for (int r = 0; r < repeats; ++r) {
    round_load.push_back(LoadAvg());
    for (const std::string& c : configs) {
      std::fprintf(stderr, "round %d/%d: %s...\n", r + 1, repeats, c.c_str());
      runs[c].push_back(RunOnce(c));
      std::fprintf(stderr, "  %.1f ms/step, %.1f CPU ms/step (loadavg %s)\n",
                   runs[c].back().step_s * 1e3, runs[c].back().cpu_s * 1e3,
                   LoadAvg().c_str());
    }
  }
  const double wall_s = std::chrono::duration<double>(Clock::now() - t0).count();
  const std::string load_after = LoadAvg();

  // Parameter bytes of the dense model and of moe's non-expert part, for the theory column.
  int64_t dense_params = 0, replicated = 0;
  {
    torch::NoGradGuard no_grad;
    gpt::Gpt dense(DenseConfig());
    dense_params = Bytes(dense->parameters());
    // The non-expert parameters of the MoE model: the dense ones minus the replaced MLPs plus
    // the gates (C x E weights).
    const int64_t c = absl::GetFlag(FLAGS_width), moe_blocks = absl::GetFlag(FLAGS_blocks) / 2;
    replicated = dense_params - moe_blocks * (8 * c * c + 5 * c) * 4 +
                 moe_blocks * c * absl::GetFlag(FLAGS_experts) * 4;
  }

  const int threads = absl::GetFlag(FLAGS_threads);
  std::string table = absl::StrFormat(
      "GPT: %d blocks, width %d, %d heads, seq %d, vocab %d, batch B = %d per replica; MoE: %d "
      "experts of hidden 2C in blocks 1, 3, ..., capacity factor 1, aux coef %g; Adam, f32; %d "
      "round(s) x (%d warm-up + %d timed steps) per configuration, interleaved; %d intra-op "
      "thread(s) per rank (dense_1_2t: %d); tcp on 127.0.0.1\n"
      "loadavg before: %s; after: %s; wall %.0f s\n\n"
      "| config | ranks | tokens/step | step ms | tokens/s | vs | ratio (tokens/s) | CPU ms/step "
      "(all ranks) | CPU/token ratio | param MiB "
      "per rank | all_reduce MiB | all_gather MiB | reduce_scatter MiB | all_to_all MiB | "
      "theory MiB | loss |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
      absl::GetFlag(FLAGS_blocks), absl::GetFlag(FLAGS_width), absl::GetFlag(FLAGS_heads),
      absl::GetFlag(FLAGS_seq), absl::GetFlag(FLAGS_vocab), absl::GetFlag(FLAGS_batch),
      absl::GetFlag(FLAGS_experts), absl::GetFlag(FLAGS_aux_coef), repeats,
      absl::GetFlag(FLAGS_warmup), absl::GetFlag(FLAGS_steps), threads, 2 * threads, load_before,
      load_after, wall_s);
  for (const std::string& c : configs) {
    const ConfigInfo info = InfoOf(c);
    const std::vector<Run>& rs = runs[c];
    std::vector<double> steps, ratios, cpus, cpu_ratios;
    const bool has_base = runs.count(info.baseline) > 0;
    for (int r = 0; r < repeats; ++r) {
      steps.push_back(rs[r].step_s);
      cpus.push_back(rs[r].cpu_s);
      if (has_base) {
        const double base_tps = TokensPerStep(info.baseline) / runs[info.baseline][r].step_s;
        ratios.push_back(TokensPerStep(c) / rs[r].step_s / base_tps);
        const double base_cpt = runs[info.baseline][r].cpu_s / TokensPerStep(info.baseline);
        cpu_ratios.push_back(rs[r].cpu_s / TokensPerStep(c) / base_cpt);
      }
    }
    const double step = Median(steps);
    // Bytes and parameters do not depend on the round: the last one's.
    const Run& last = rs.back();
    std::string cells;
    for (size_t k = 0; k < std::size(kCounted); ++k) {
      absl::StrAppend(&cells, last.ops[k] == 0
                                  ? std::string("-")
                                  : absl::StrFormat("%.2f (%d ops)", MiB(last.bytes[k]),
                                                    last.ops[k]),
                      " | ");
    }
    absl::StrAppend(
        &table,
        absl::StrFormat("| %s | %d | %d | %.0f | %.0f | %s | %s | %.0f | %s | %.1f | %s%s | %.3f |\n",
                        c,
                        info.ranks, TokensPerStep(c), step * 1e3, TokensPerStep(c) / step,
                        c == info.baseline ? "-" : info.baseline,
                        has_base ? absl::StrFormat("%.2f", Median(ratios)) : "-",
                        Median(cpus) * 1e3,
                        has_base ? absl::StrFormat("%.2f", Median(cpu_ratios)) : "-",
                        MiB(last.param_bytes), cells, Theory(c, dense_params, replicated),
                        last.loss));
  }
  // Every round's step time (the spread shows the load changing during the run).
  absl::StrAppend(&table, "\nstep ms per round:\n\n| config |");
  for (int r = 0; r < repeats; ++r) absl::StrAppend(&table, " round ", r + 1, " |");
  absl::StrAppend(&table, "\n|---|");
  for (int r = 0; r < repeats; ++r) absl::StrAppend(&table, "---|");
  absl::StrAppend(&table, "\n");
  for (const std::string& c : configs) {
    absl::StrAppend(&table, "| ", c, " |");
    for (const Run& run : runs[c]) absl::StrAppend(&table, absl::StrFormat(" %.0f |", run.step_s * 1e3));
    absl::StrAppend(&table, "\n");
  }
  absl::StrAppend(&table, "| loadavg at round start |");
  for (const std::string& l : round_load) absl::StrAppend(&table, " ", l, " |");
  absl::StrAppend(&table, "\n");

  // The main collectives, measured against the theory in bytes.
  absl::StrAppend(&table, "\n");
  const int64_t tp_bytes = [] {
    const int64_t b = absl::GetFlag(FLAGS_batch), t = absl::GetFlag(FLAGS_seq);
    return (4 * absl::GetFlag(FLAGS_blocks) + 2) * b * t * absl::GetFlag(FLAGS_width) * 4 +
           3 * b * t * 4;
  }();
  const struct {
    const char* config;
    size_t op;  // index into kCounted
    int64_t theory;
  } checks[] = {{"tp_2", 0, tp_bytes},
                {"fsdp_2", 1, 2 * dense_params},
                {"fsdp_2", 2, dense_params},
                {"dense_2", 0, dense_params},
                {"moe_2", 0, replicated},
                {"moe_2", 3, [] {
                   const int64_t s = absl::GetFlag(FLAGS_batch) * absl::GetFlag(FLAGS_seq),
                                 e = absl::GetFlag(FLAGS_experts);
                   return 4 * (absl::GetFlag(FLAGS_blocks) / 2) * e * ((2 * s + e - 1) / e) *
                          absl::GetFlag(FLAGS_width) * 4;
                 }()}};
  for (const auto& check : checks) {
    auto it = runs.find(check.config);
    if (it == runs.end()) continue;
    const int64_t measured = it->second.back().bytes[check.op];
    absl::StrAppend(&table,
                    absl::StrFormat("check %s %s: measured %d bytes, theory %d bytes: %s\n",
                                    check.config, comm::OpTypeName(kCounted[check.op]), measured,
                                    check.theory,
                                    measured == check.theory
                                        ? "equal"
                                        : absl::StrFormat("differ by %+d", measured - check.theory)));
  }
  std::fputs(table.c_str(), stdout);
  if (!absl::GetFlag(FLAGS_out).empty()) std::ofstream(absl::GetFlag(FLAGS_out)) << table;
  return 0;
}

}  // namespace
}  // namespace fairscale::model_parallel::bench

constexpr char kUsage[] =
    "step time, tokens/s, per-rank parameter bytes and bytes per collective of the GPT\n"
    "at 1 rank vs tensor parallel (T=2) vs FSDP (2 ranks), and MoE vs dense at 1 and 2\n"
    "ranks, ranks as processes over tcp (model_parallel/bench/README.md).\n"
    "\n"
    "  OMP_NUM_THREADS=1 tp_bench --repeats=5\n"
    "\n"
    "Environment read: TEST_TMPDIR (where the ranks' directories go, else /tmp);\n"
    "FS_TP_BENCH_RANK, FS_TP_BENCH_SIZE, FS_TP_BENCH_DIR are set by the\n"
    "benchmark for its ranks.";

int main(int argc, char** argv) {
  fairscale::base::ParseCommandLine(argc, argv, kUsage);
  if (auto me = fairscale::comm::bench::RankFromEnv("FS_TP_BENCH")) {
    return fairscale::model_parallel::bench::RunRank(*me);
  }
  return fairscale::model_parallel::bench::Main();
}
