// SlowMo / LocalSGD benchmark: the main job's Gpt (//examples/gpt:model, GptConfig() defaults)
// trained data-parallel by n rank processes over tcp on 127.0.0.1 (copies of this binary, FileStore
// rendezvous: //comm/bench:harness), three ways, interleaved over --repeats:
//   ddp      the gradients all-reduced (one flat f32 buffer, sum / n) before every Adam step
//   localsgd Adam on local gradients, slowmo::SlowMo H = --h (alpha 1, beta 0)
//   slowmo   the same with alpha 1, beta 0.5
// Reported per mode: the median and the mean step time (forward + backward + Adam +
// communication; per repeat the slowest rank's, then the median over repeats; the mean counts
// the averaging step that the median skips), all-reduce bytes per step and rank
// (comm::testing::CountingCommunicator), and the loss on a fixed held-out batch after --steps
// steps, i.e. after the same number of tokens for every mode. Data: synthetic sequences
// t[i+1] = (5 t[i] + 3) mod vocab from a random start (learnable), each rank and step its own.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
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
#include "comm/torch/tensor_buffer.h"
#include "examples/gpt/model.h"
#include "slowmo/slowmo.h"

ABSL_FLAG(std::string, ranks, "2,4", "world sizes, comma-separated");
ABSL_FLAG(int, steps, 40, "training steps per run (a multiple of --h)");
ABSL_FLAG(int, h, 4, "LocalSGD / SlowMo averaging period H");
ABSL_FLAG(int, batch, 4, "sequences per rank and step");
ABSL_FLAG(int, repeats, 3, "interleaved repeats of the three modes");
ABSL_FLAG(double, lr, 1e-3, "Adam learning rate (SlowMo's base_lr)");
ABSL_FLAG(int, threads, 1, "intra-op threads per process");
ABSL_FLAG(std::string, model_size, "default",
          "default: GptConfig() as is; tiny: width 16, 1 block (smoke test)");
ABSL_FLAG(std::string, out, "", "also write the table here");

namespace fairscale::slowmo::bench {
namespace {

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "slowmo_bench: %s\n", message.c_str());
  std::exit(1);
}

const std::vector<std::string> kModes = {"ddp", "localsgd", "slowmo"};

examples::gpt::GptConfig Config() {
  examples::gpt::GptConfig c;
  if (absl::GetFlag(FLAGS_model_size) == "tiny") c.width(16).heads(2).blocks(1).seq(16);
  return c;
}

// [batch, seq + 1] tokens from generator seed `seed`.
at::Tensor Batch(uint64_t seed, int batch) {
  const auto c = Config();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor t = at::empty({batch, c.seq() + 1}, at::kLong);
  t.select(1, 0).copy_(at::randint(c.vocab(), {batch}, gen, at::kLong));
  for (int64_t i = 1; i <= c.seq(); ++i) {
    t.select(1, i).copy_((t.select(1, i - 1) * 5 + 3).remainder(c.vocab()));
  }
  return t;
}

at::Tensor Loss(examples::gpt::Gpt& model, const at::Tensor& tokens) {
  const int64_t s = tokens.size(1) - 1;
  at::Tensor logits = model->forward(tokens.narrow(1, 0, s));
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}),
                                tokens.narrow(1, 1, s).reshape({-1}));
}

struct Result {
  double median_s = 0;
  double mean_s = 0;  // the median hides the averaging step (1 in H); the mean includes it
  double bytes_per_step = 0;
  double eval_loss = 0;
};

Result Train(const std::string& mode, const comm::bench::BenchRank& me,
             const std::shared_ptr<comm::Communicator>& inner) {
  auto counting = std::make_shared<comm::testing::CountingCommunicator>(inner);
  torch::manual_seed(0);  // the same initial weights in every process
  examples::gpt::Gpt model(Config());
  std::vector<at::Tensor> params = model->parameters();
  const double lr = absl::GetFlag(FLAGS_lr);
  torch::optim::Adam opt(params, torch::optim::AdamOptions(lr));
  std::unique_ptr<SlowMo> slowmo;
  if (mode != "ddp") {
    slowmo = std::make_unique<SlowMo>(
        params, counting,
        SlowMoOptions().frequency(absl::GetFlag(FLAGS_h)).slowmo_momentum(mode == "slowmo" ? 0.5 : 0)
            .base_lr(lr));
  }
  const int steps = absl::GetFlag(FLAGS_steps);
  std::vector<double> times;
  at::Tensor flat;
  for (int step = 0; step < steps; ++step) {
    at::Tensor tokens = Batch(1 + 100000ull * me.rank + step, absl::GetFlag(FLAGS_batch));
    const auto t0 = std::chrono::steady_clock::now();
    opt.zero_grad();
    Loss(model, tokens).backward();
    if (mode == "ddp") {
      std::vector<at::Tensor> grads;
      for (const at::Tensor& p : params) grads.push_back(p.grad().reshape({-1}));
      flat = at::cat(grads);
      comm::Buffer buf = comm::ToBuffer(flat).value();
      absl::Status s = counting->AllReduce(buf, buf, comm::ReduceOp::kSum).Wait(absl::Minutes(5));
      if (!s.ok()) Die(s.ToString());
      flat.div_(me.size);
      int64_t off = 0;
      for (const at::Tensor& p : params) {
        p.mutable_grad().view({-1}).copy_(flat.narrow(0, off, p.numel()));
        off += p.numel();
      }
    }
    opt.step();
    if (slowmo) slowmo->step_completed();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  Result r;
  for (double t : times) r.mean_s += t / times.size();
  std::sort(times.begin(), times.end());
  r.median_s = times[times.size() / 2];
  r.bytes_per_step =
      static_cast<double>(counting->count(comm::OpType::kAllReduce).bytes) / steps;
  torch::NoGradGuard no_grad;
  r.eval_loss = Loss(model, Batch(987654321, 16)).item<double>();
  return r;
}

int RunRank(const comm::bench::BenchRank& me) {
  at::set_num_threads(absl::GetFlag(FLAGS_threads));
  auto comm = comm::bench::Connect(me);
  if (!comm.ok()) Die(comm.status().ToString());
  std::ofstream out(absl::StrCat(me.dir, "/rank", me.rank, ".tsv"));
  for (int rep = 0; rep < absl::GetFlag(FLAGS_repeats); ++rep) {
    for (const std::string& mode : kModes) {
      const Result r = Train(mode, me, *comm);
      out << absl::StrFormat("%s\t%d\t%.9g\t%.9g\t%.9g\t%.9g\n", mode, rep, r.median_s, r.mean_s,
                             r.bytes_per_step, r.eval_loss);
    }
  }
  return 0;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::string LoadAvg() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return absl::StrCat(a, " ", b, " ", c);
}

int Main() {
  const int h = absl::GetFlag(FLAGS_h), steps = absl::GetFlag(FLAGS_steps);
  if (h < 1 || steps % h != 0) Die("--steps must be a multiple of --h >= 1");
  const auto c = Config();
  int64_t nparams = 0;
  {
    torch::manual_seed(0);
    examples::gpt::Gpt m(c);
    for (const auto& p : m->parameters()) nparams += p.numel();
  }
  std::string table = absl::StrFormat(
      "Gpt(GptConfig()): vocab %d, seq %d, width %d, heads %d, blocks %d (%d f32 parameters, "
      "%.2f MiB); Adam lr %g; %d steps x %d sequences x %d tokens per rank; H = %d; %d "
      "interleaved repeats; tcp on 127.0.0.1, %d intra-op thread(s) per process; loadavg before: "
      "%s\n\n| ranks | mode | ms/step (median) | ms/step (mean) | all-reduce bytes/step/rank | vs ddp bytes | "
      "held-out loss after %d steps |\n|---|---|---|---|---|---|---|\n",
      c.vocab(), c.seq(), c.width(), c.heads(), c.blocks(), nparams, nparams * 4.0 / 1048576.0,
      absl::GetFlag(FLAGS_lr), steps, absl::GetFlag(FLAGS_batch), c.seq(), h,
      absl::GetFlag(FLAGS_repeats), absl::GetFlag(FLAGS_threads), LoadAvg(), steps);
  for (absl::string_view w : absl::StrSplit(absl::GetFlag(FLAGS_ranks), ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(w, &n) || n < 1) Die(absl::StrCat("bad --ranks entry ", w));
    std::fprintf(stderr, "%d ranks...\n", n);
    auto dir = comm::bench::RunRanks(
        "FS_SLOWMO_BENCH", n,
        comm::bench::ForwardFlags(
            {"steps", "h", "batch", "repeats", "lr", "threads", "model_size"}),
        absl::Minutes(30));
    if (!dir.ok()) Die(dir.status().ToString());
    // mode -> repeat -> slowest rank's median; bytes and loss from rank 0
    std::map<std::string, std::map<int, double>> slowest, slowest_mean;
    std::map<std::string, double> bytes, loss;
    for (int r = 0; r < n; ++r) {
      std::ifstream in(absl::StrCat(*dir, "/rank", r, ".tsv"));
      std::string line;
      while (std::getline(in, line)) {
        std::vector<std::string> f = absl::StrSplit(line, '\t');
        if (f.size() != 6) continue;
        int rep = 0;
        double t = 0, m = 0, b = 0, l = 0;
        (void)absl::SimpleAtoi(f[1], &rep);
        (void)absl::SimpleAtod(f[2], &t);
        (void)absl::SimpleAtod(f[3], &m);
        (void)absl::SimpleAtod(f[4], &b);
        (void)absl::SimpleAtod(f[5], &l);
        slowest[f[0]][rep] = std::max(slowest[f[0]][rep], t);
        slowest_mean[f[0]][rep] = std::max(slowest_mean[f[0]][rep], m);
        if (r == 0) { bytes[f[0]] = b; loss[f[0]] = l; }
      }
    }
    for (const std::string& mode : kModes) {
      std::vector<double> per_rep, per_rep_mean;
      for (const auto& [rep, t] : slowest[mode]) per_rep.push_back(t);
      for (const auto& [rep, t] : slowest_mean[mode]) per_rep_mean.push_back(t);
      if (per_rep.empty()) Die(absl::StrCat("no result for ", mode, " at ", n, " ranks"));
      absl::StrAppend(&table, absl::StrFormat("| %d | %s | %.1f | %.1f | %.0f | %.3fx | %.4f |\n", n,
                                              mode == "slowmo" ? "slowmo (beta 0.5)" : mode,
                                              Median(per_rep) * 1e3, Median(per_rep_mean) * 1e3, bytes[mode],
                                              bytes[mode] / bytes["ddp"], loss[mode]));
    }
  }
  absl::StrAppend(&table, "\nloadavg after: ", LoadAvg(), "\n");
  std::fputs(table.c_str(), stdout);
  if (!absl::GetFlag(FLAGS_out).empty()) std::ofstream(absl::GetFlag(FLAGS_out)) << table;
  return 0;
}

}  // namespace
}  // namespace fairscale::slowmo::bench

constexpr char kUsage[] =
    "SlowMo / LocalSGD vs DDP-style gradient all-reduce on the main job's Gpt, ranks as\n"
    "processes over tcp (slowmo/README.md).\n"
    "\n"
    "  slowmo_bench --ranks=2,4 --steps=40 --h=4\n"
    "\n"
    "Environment read: TEST_TMPDIR (where the ranks' directory goes, else /tmp);\n"
    "FS_SLOWMO_BENCH_RANK, _SIZE, _DIR are set by the benchmark for its ranks.";

int main(int argc, char** argv) {
  fairscale::base::ParseCommandLine(argc, argv, kUsage);
  if (auto me = fairscale::comm::bench::RankFromEnv("FS_SLOWMO_BENCH")) {
    return fairscale::slowmo::bench::RunRank(*me);
  }
  return fairscale::slowmo::bench::Main();
}
