// Pipeline benchmark: a stack of residual MLP blocks trained one step at a time, un-pipelined in
// one process and as pipe::Pipe over p stage processes on 127.0.0.1 (tcp; copies of this binary,
// FileStore rendezvous, as in //oss/bench). Per configuration (stages, schedule, chunks):
// throughput against one process, the measured bubble fraction next to the theoretical
// (p - 1) / (m + p - 1), and each stage's peak activation memory (tensor bytes above what was
// live before the step, gradients already allocated: //base:tracking_allocator). See README.md.
#include <ATen/ops/gelu.h>
#include <ATen/ops/mse_loss.h>
#include <ATen/ops/randn.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/utils.h>

#include <algorithm>
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
#include "absl/time/clock.h"
#include "base/flags.h"
#include "base/subprocess.h"
#include "base/tracking_allocator.h"
#include "comm/bench/harness.h"
#include "examples/gpt/model.h"
#include "comm/registry.h"
#include "comm/store/file_store.h"
#include "pipe/pipe.h"

ABSL_FLAG(std::string, stages, "2,4", "pipeline depths to run, comma-separated");
ABSL_FLAG(std::string, chunks, "1,4,8,16", "micro-batch counts, comma-separated");
ABSL_FLAG(std::string, virtual_stages, "2",
          "interleaved 1F1B rows: virtual stages per rank, comma-separated (each run where the "
          "chunks are a multiple of the stages and the model has blocks for every virtual "
          "stage); empty: none");
ABSL_FLAG(std::string, model, "mlp",
          "mlp: residual MLP blocks on [batch, width]; gpt: the main job's TransformerBlocks "
          "(causal attention + MLP, //examples/gpt:model) on [batch, seq, width]");
ABSL_FLAG(int, seq, 64, "gpt: tokens per sequence");
ABSL_FLAG(int, heads, 4, "gpt: attention heads");
ABSL_FLAG(int, blocks, 8, "blocks");
ABSL_FLAG(int, width, 256, "block width");
ABSL_FLAG(int, hidden, 1024, "block hidden width");
ABSL_FLAG(int, batch, 64, "rows per step");
ABSL_FLAG(int, warmup, 1, "untimed steps");
ABSL_FLAG(int, steps, 4, "timed steps (median reported)");
ABSL_FLAG(int, threads, 1, "intra-op threads per process");
ABSL_FLAG(std::string, out, "", "also write the table here");

namespace fairscale::pipe::bench {
namespace {

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "pipe_bench: %s\n", message.c_str());
  std::exit(1);
}

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(int64_t width, int64_t hidden)
      : fc1_(register_module("fc1", torch::nn::Linear(width, hidden))),
        fc2_(register_module("fc2", torch::nn::Linear(hidden, width))) {}
  at::Tensor forward(const at::Tensor& x) { return x + fc2_(at::gelu(fc1_(x))); }

 private:
  torch::nn::Linear fc1_, fc2_;
};
TORCH_MODULE(Block);

bool Gpt() { return absl::GetFlag(FLAGS_model) == "gpt"; }

torch::nn::Sequential MakeModel() {
  torch::manual_seed(0);  // the same weights in every process
  torch::nn::Sequential m;
  for (int b = 0; b < absl::GetFlag(FLAGS_blocks); ++b) {
    if (Gpt()) {
      m->push_back(examples::gpt::TransformerBlock(absl::GetFlag(FLAGS_width),
                                                   absl::GetFlag(FLAGS_heads)));
    } else {
      m->push_back(Block(absl::GetFlag(FLAGS_width), absl::GetFlag(FLAGS_hidden)));
    }
  }
  return m;
}

// One step's input (and, shaped alike, its regression target).
at::Tensor MakeInput() {
  if (Gpt()) {
    return at::randn(
        {absl::GetFlag(FLAGS_batch), absl::GetFlag(FLAGS_seq), absl::GetFlag(FLAGS_width)});
  }
  return at::randn({absl::GetFlag(FLAGS_batch), absl::GetFlag(FLAGS_width)});
}

at::Tensor Loss(const at::Tensor& out, const at::Tensor& y) { return at::mse_loss(out, y); }

// Zeroes the gradients in place: after the warm-up step they stay allocated, so the bytes a
// timed step adds over what was live before it are its activations (and transient buffers),
// not the gradient buffers.
void ZeroGrad(const std::vector<at::Tensor>& params) {
  for (const at::Tensor& p : params) {
    if (p.grad().defined()) p.grad().zero_();
  }
}

std::vector<int> ParseList(const std::string& flag, const std::string& value) {
  std::vector<int> out;
  for (absl::string_view v : absl::StrSplit(value, ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(v, &n) || n < 1) Die(absl::StrCat("bad --", flag, " entry '", v, "'"));
    out.push_back(n);
  }
  return out;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Config {
  Schedule schedule;
  int chunks;
  int virtual_stages = 1;
  std::string Label() const {
    return virtual_stages == 1 ? ScheduleName(schedule)
                               : absl::StrCat(ScheduleName(schedule), " v=", virtual_stages);
  }
  std::string Name() const { return absl::StrCat(Label(), "/", chunks); }
};

// The configurations run at `stages` stages.
std::vector<Config> Configs(int stages) {
  std::vector<Config> out;
  const std::string vs = absl::GetFlag(FLAGS_virtual_stages);
  const std::vector<int> virtual_stages = vs.empty() ? std::vector<int>{}
                                                     : ParseList("virtual_stages", vs);
  for (int m : ParseList("chunks", absl::GetFlag(FLAGS_chunks))) {
    for (Schedule s : {Schedule::kGPipe, Schedule::k1F1B}) out.push_back({s, m});
    for (int v : virtual_stages) {
      if (v > 1 && m % stages == 0 && stages * v <= absl::GetFlag(FLAGS_blocks)) {
        out.push_back({Schedule::kInterleaved1F1B, m, v});
      }
    }
  }
  return out;
}

// The un-pipelined step over `chunks` micro-batches in turn (gradients accumulated, as Pipe
// does): median seconds and peak activation bytes.
std::pair<double, int64_t> RunOneProcess(base::TrackingCpuAllocator* tracker, int chunks) {
  torch::nn::Sequential model = MakeModel();
  const at::Tensor x = MakeInput();
  const at::Tensor y = at::randn_like(x);
  std::vector<double> times;
  int64_t peak = 0;
  for (int step = 0; step < absl::GetFlag(FLAGS_warmup) + absl::GetFlag(FLAGS_steps); ++step) {
    ZeroGrad(model->parameters());
    const int64_t live = tracker->live_bytes();
    tracker->reset_peak();
    const absl::Time t0 = absl::Now();
    for (int i = 0; i < chunks; ++i) {
      const int64_t rows = x.size(0) / chunks;
      (Loss(model->forward(x.narrow(0, i * rows, rows)), y.narrow(0, i * rows, rows)) / chunks)
          .backward();
    }
    const double dt = absl::ToDoubleSeconds(absl::Now() - t0);
    if (step >= absl::GetFlag(FLAGS_warmup)) {
      times.push_back(dt);
      peak = std::max(peak, tracker->peak_bytes() - live);
    }
  }
  return {Median(times), peak};
}

// One stage process: every configuration in turn; one line per configuration:
// name, median step seconds, median bubble fraction, peak activation bytes. The pipe raises
// c10::Error (RunStage reports it).
int RunConfigs(int rank, int n, const std::string& dir) {
  base::TrackingCpuAllocator* tracker = base::TrackingCpuAllocator::Install();
  at::set_num_threads(absl::GetFlag(FLAGS_threads));
  auto created = comm::bench::Connect({rank, n, dir});
  if (!created.ok()) Die(created.status().ToString());
  std::shared_ptr<comm::Communicator> comm = *std::move(created);
  std::ofstream out(absl::StrCat(dir, "/rank", rank, ".tsv"));
  const at::Tensor x = MakeInput();
  const at::Tensor y = at::randn_like(x);
  for (const Config& c : Configs(n)) {
    std::unique_ptr<Pipe> pipe = Pipe::Create(MakeModel(), comm,
                                              PipeOptions()
                                                  .chunks(c.chunks)
                                                  .schedule(c.schedule)
                                                  .virtual_stages(c.virtual_stages)
                                                  .checkpoint(CheckpointMode::kNever));
    std::vector<double> times, bubbles;
    int64_t peak = 0;
    for (int step = 0; step < absl::GetFlag(FLAGS_warmup) + absl::GetFlag(FLAGS_steps); ++step) {
      ZeroGrad(pipe->parameters());
      // Start every stage together, so that the step time is the pipeline's.
      absl::Status s = comm->Barrier().Wait();
      if (!s.ok()) Die(s.ToString());
      const int64_t live = tracker->live_bytes();
      tracker->reset_peak();
      const absl::Time t0 = absl::Now();
      pipe->train_step(x, y, Loss);
      const double dt = absl::ToDoubleSeconds(absl::Now() - t0);
      double busy = 0;
      for (const PipeEvent& e : pipe->trace()) busy += absl::ToDoubleSeconds(e.end - e.start);
      // The pipeline's step time is the slowest stage's: the last stage returns as soon as its
      // last backward is sent, while the first one still computes (its own dt would count that
      // tail as outside the step and understate its idle share).
      double step_s = 0;
      s = comm->AllReduce(comm::MakeConstBuffer(&dt, 1), comm::MakeBuffer(&step_s, 1),
                          comm::ReduceOp::kMax)
              .Wait();
      if (!s.ok()) Die(s.ToString());
      if (step >= absl::GetFlag(FLAGS_warmup)) {
        peak = std::max(peak, tracker->peak_bytes() - live);
        times.push_back(step_s);
        bubbles.push_back(1.0 - busy / step_s);
      }
    }
    out << c.Name() << '\t' << Median(times) << '\t' << Median(bubbles) << '\t' << peak << '\n';
  }
  out.close();
  absl::Status s = comm->Barrier().Wait();
  if (!s.ok()) Die(s.ToString());
  return 0;
}

int RunStage(int rank, int n, const std::string& dir) {
  try {
    return RunConfigs(rank, n, dir);
  } catch (const c10::Error& e) {
    Die(e.what_without_backtrace());
  }
}

struct Row {
  double step_s = 0;             // slowest stage's median
  double bubble = 0;             // mean over stages
  std::vector<int64_t> peaks;    // per stage
};

std::map<std::string, Row> RunPipeline(int n) {
  absl::StatusOr<std::string> ran = comm::bench::RunRanks(
      "FS_PIPE_BENCH", n,
      comm::bench::ForwardFlags(
          {"chunks", "virtual_stages", "model", "seq", "heads", "blocks", "width", "hidden", "batch", "warmup",
           "steps", "threads"}),
      absl::Minutes(20));
  if (!ran.ok()) Die(absl::StrCat("at ", n, " stages: ", ran.status().ToString()));
  const std::string dir = *ran;
  std::map<std::string, Row> rows;
  for (int r = 0; r < n; ++r) {
    std::ifstream in(absl::StrCat(dir, "/rank", r, ".tsv"));
    std::string line;
    while (std::getline(in, line)) {
      std::vector<std::string> f = absl::StrSplit(line, '\t');
      if (f.size() != 4) continue;
      double step = 0, bubble = 0;
      int64_t peak = 0;
      (void)absl::SimpleAtod(f[1], &step);
      (void)absl::SimpleAtod(f[2], &bubble);
      (void)absl::SimpleAtoi(f[3], &peak);
      Row& row = rows[f[0]];
      row.step_s = std::max(row.step_s, step);
      row.bubble += bubble / n;
      row.peaks.push_back(peak);
    }
  }
  return rows;
}

double MiB(int64_t b) { return static_cast<double>(b) / 1048576.0; }

int Main() {
  base::TrackingCpuAllocator* tracker = base::TrackingCpuAllocator::Install();
  at::set_num_threads(absl::GetFlag(FLAGS_threads));
  const auto [one_s, one_peak] = RunOneProcess(tracker, 1);
  std::map<int, double> one_chunked_s;
  for (int m : ParseList("chunks", absl::GetFlag(FLAGS_chunks))) {
    if (absl::GetFlag(FLAGS_batch) % m != 0) Die(absl::StrCat("--chunks ", m, " must divide --batch"));
    one_chunked_s[m] = RunOneProcess(tracker, m).first;
  }
  const int batch = absl::GetFlag(FLAGS_batch);
  std::string table = absl::StrFormat(
      "%d %s (width %d, hidden %d), batch %d, f32, no checkpointing; %d "
      "warm-up + %d timed steps (median); tcp on 127.0.0.1, %d intra-op thread(s) per "
      "process\n\none process: %.1f ms/step, %.0f rows/s, peak activations %.2f MiB\n\n"
      "| stages | schedule | chunks | ms/step | rows/s | vs 1 process | 1 process, same chunks "
      "ms/step | bubble | theory (p-1)/(vm+p-1) | peak activation MiB per stage |\n"
      "|---|---|---|---|---|---|---|---|---|---|\n",
      absl::GetFlag(FLAGS_blocks),
      Gpt() ? absl::StrFormat("GPT TransformerBlocks of //examples/gpt (heads %d, seq %d; hidden "
                              "= 4 x width)",
                              absl::GetFlag(FLAGS_heads), absl::GetFlag(FLAGS_seq))
            : std::string("residual MLP blocks"),
      absl::GetFlag(FLAGS_width), Gpt() ? 4 * absl::GetFlag(FLAGS_width) : absl::GetFlag(FLAGS_hidden),
      batch, absl::GetFlag(FLAGS_warmup), absl::GetFlag(FLAGS_steps),
      absl::GetFlag(FLAGS_threads), one_s * 1e3, batch / one_s, MiB(one_peak));
  for (int p : ParseList("stages", absl::GetFlag(FLAGS_stages))) {
    std::fprintf(stderr, "%d stages...\n", p);
    std::map<std::string, Row> rows = RunPipeline(p);
    for (const Config& c : Configs(p)) {
      auto it = rows.find(c.Name());
      if (it == rows.end() || static_cast<int>(it->second.peaks.size()) != p) {
        Die(absl::StrCat("no result for ", c.Name(), " at ", p, " stages"));
      }
      const Row& row = it->second;
      std::string peaks;
      for (int64_t b : row.peaks) absl::StrAppend(&peaks, peaks.empty() ? "" : " / ",
                                                  absl::StrFormat("%.2f", MiB(b)));
      absl::StrAppend(
          &table, absl::StrFormat("| %d | %s | %d | %.1f | %.0f | %.2fx | %.1f | %.2f | %.2f | %s |\n",
                                  p, c.Label(), c.chunks, row.step_s * 1e3,
                                  batch / row.step_s, one_s / row.step_s,
                                  one_chunked_s[c.chunks] * 1e3, row.bubble,
                                  (p - 1.0) / (c.virtual_stages * c.chunks + p - 1.0), peaks));
    }
  }
  std::fputs(table.c_str(), stdout);
  if (!absl::GetFlag(FLAGS_out).empty()) std::ofstream(absl::GetFlag(FLAGS_out)) << table;
  return 0;
}

}  // namespace
}  // namespace fairscale::pipe::bench

constexpr char kUsage[] =
    "pipeline throughput, bubble and per-stage activation memory against one process,\n"
    "stages as processes over tcp (pipe/bench/README.md).\n"
    "\n"
    "  pipe_bench --stages=2,4 --chunks=1,4,8,16\n"
    "\n"
    "Environment read: TEST_TMPDIR (where the stages' directory goes, else /tmp);\n"
    "FS_PIPE_BENCH_RANK, FS_PIPE_BENCH_SIZE, FS_PIPE_BENCH_DIR are set by the\n"
    "benchmark for its stages.";

int main(int argc, char** argv) {
  fairscale::base::ParseCommandLine(argc, argv, kUsage);
  if (auto me = fairscale::comm::bench::RankFromEnv("FS_PIPE_BENCH")) {
    return fairscale::pipe::bench::RunStage(me->rank, me->size, me->dir);
  }
  return fairscale::pipe::bench::Main();
}
