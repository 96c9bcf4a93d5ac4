// MEVO benchmark: the LM head of the main job (//examples/gpt: a torch::nn::Linear(D, V) with
// bias, then cross-entropy over the vocabulary) at a large vocabulary, plain (at::linear +
// cross_entropy, the [T, V] logits materialized) against mevo::mevo_cross_entropy at a few tile
// sizes. Per configuration: the median forward + backward time over interleaved repeats (each
// repeat runs every configuration once, in turn, so a load change hits them alike) and the exact
// peak tensor bytes of forward + backward above what was live before (base::TrackingCpuAllocator;
// it includes the gradients of input, weight and bias, which both variants allocate, and the
// table also shows it without them). Ratios are against plain in the same run. See README.md:
//
//   OMP_NUM_THREADS=1 ./bazelw run -c opt //mevo/bench:mevo_bench -- --threads=1
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/flags.h"
#include "base/tracking_allocator.h"
#include "mevo/mevo.h"

ABSL_FLAG(int64_t, tokens, 512, "tokens per step (batch x sequence: 4 x 128)");
ABSL_FLAG(int64_t, dim, 512, "model width D");
ABSL_FLAG(std::string, vocab, "32768,65536", "vocabulary sizes V, comma separated");
ABSL_FLAG(std::string, tiles, "512x4096,256x2048,128x1024",
          "MEVO tile sizes token_chunk x vocab_chunk, comma separated");
ABSL_FLAG(int, repeats, 5, "interleaved repeats (the median is reported)");
ABSL_FLAG(int, warmup, 1, "untimed repeats first");
ABSL_FLAG(int, threads, 1, "intra-op threads (at::set_num_threads)");
ABSL_FLAG(std::string, out, "", "also write the markdown table here");

namespace fairscale::mevo::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kUsage[] =
    "mevo_bench: forward + backward time and peak bytes of the LM head's projection + "
    "cross-entropy, plain vs MEVO.\n"
    "  OMP_NUM_THREADS=1 mevo_bench [--tokens=512] [--dim=512] [--vocab=32768,65536] "
    "[--tiles=512x4096,...] [--threads=1]";

struct Config {
  std::string name;
  int64_t token_chunk = 0;  // 0: plain
  int64_t vocab_chunk = 0;
  std::vector<double> ms;
  int64_t peak = 0;   // max over repeats (it is the same every time)
  double loss = 0;    // of the last repeat
  double err = 0;     // max |grad - plain grad| / max |plain grad| over input, weight, bias
};

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

double RelErr(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(1e-30, b.abs().max().item<double>());
}

std::string Table(int64_t tokens, int64_t dim, int64_t vocab, std::vector<Config>& configs) {
  const Config& plain = configs[0];
  const double plain_ms = Median(plain.ms);
  const int64_t grads = (tokens * dim + vocab * dim + vocab) * 4;
  std::string t = absl::StrFormat(
      "T = %d tokens, D = %d, V = %d (logits [T, V] f32 = %.0f MiB; gradients of input, weight "
      "and bias = %.1f MiB)\n\n"
      "| variant | fwd+bwd ms (median) | x plain time | peak MiB | x plain peak | peak - grads "
      "MiB | x plain (- grads) | loss | max grad err vs plain |\n"
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
      tokens, dim, vocab, MiB(4.0 * tokens * vocab), MiB(grads));
  for (const Config& c : configs) {
    const double ms = Median(c.ms);
    t += absl::StrFormat("| %s | %.0f | %.2f | %.1f | %.3f | %.1f | %.3f | %.6f | %.1e |\n", c.name,
                         ms, ms / plain_ms, MiB(c.peak),
                         static_cast<double>(c.peak) / plain.peak, MiB(c.peak - grads),
                         static_cast<double>(c.peak - grads) / (plain.peak - grads), c.loss,
                         c.err);
  }
  return t;
}

int Main() {
  const int threads = absl::GetFlag(FLAGS_threads);
  at::set_num_threads(threads);
  base::TrackingCpuAllocator* alloc = base::TrackingCpuAllocator::Install();
  const int64_t tokens = absl::GetFlag(FLAGS_tokens), dim = absl::GetFlag(FLAGS_dim);
  const std::string load_before = LoadAvg();
  const auto start = Clock::now();
  std::string out = absl::StrFormat(
      "MEVO vs plain linear + cross_entropy (mean), f32, forward + backward; %d intra-op "
      "thread(s); median of %d interleaved repeats after %d warm-up\n\n",
      threads, absl::GetFlag(FLAGS_repeats), absl::GetFlag(FLAGS_warmup));
  for (absl::string_view v : absl::StrSplit(absl::GetFlag(FLAGS_vocab), ',')) {
    int64_t vocab = 0;
    if (!absl::SimpleAtoi(v, &vocab) || vocab <= 0) {
      std::cerr << "bad --vocab entry " << v << "\n";
      return 1;
    }
    std::vector<Config> configs(1);
    configs[0].name = "plain";
    for (absl::string_view tile : absl::StrSplit(absl::GetFlag(FLAGS_tiles), ',')) {
      const std::vector<std::string> tv = absl::StrSplit(tile, 'x');
      Config c;
      if (tv.size() != 2 || !absl::SimpleAtoi(tv[0], &c.token_chunk) ||
          !absl::SimpleAtoi(tv[1], &c.vocab_chunk)) {
        std::cerr << "bad --tiles entry " << tile << " (want TOKENSxVOCAB)\n";
        return 1;
      }
      c.name = absl::StrFormat("MEVO %d x %d", c.token_chunk, c.vocab_chunk);
      configs.push_back(c);
    }

    torch::manual_seed(0);
    torch::nn::Linear head(torch::nn::LinearOptions(dim, vocab));  // the main job's head
    const at::Tensor input = at::randn({tokens, dim});
    const at::Tensor targets = at::randint(vocab, {tokens}, at::kLong);
    at::Tensor x = input.clone().requires_grad_(true);
    at::Tensor plain_gx, plain_gw, plain_gb;
    for (int r = 0; r < absl::GetFlag(FLAGS_warmup) + absl::GetFlag(FLAGS_repeats); ++r) {
      for (Config& c : configs) {
        x.mutable_grad() = at::Tensor();
        head->weight.mutable_grad() = at::Tensor();
        head->bias.mutable_grad() = at::Tensor();
        const int64_t before = alloc->live_bytes();
        alloc->reset_peak();
        const auto t0 = Clock::now();
        at::Tensor loss =
            c.token_chunk == 0
                ? torch::nn::functional::cross_entropy(head(x), targets)
                : mevo_cross_entropy(
                      x, head->weight, head->bias, targets,
                      MevoOptions().token_chunk(c.token_chunk).vocab_chunk(c.vocab_chunk));
        loss.backward();
        const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        const int64_t peak = alloc->peak_bytes() - before;
        c.loss = loss.item<double>();
        if (c.token_chunk == 0) {
          plain_gx = x.grad().clone(), plain_gw = head->weight.grad().clone();
          plain_gb = head->bias.grad().clone();
        } else {
          c.err = std::max({RelErr(x.grad(), plain_gx), RelErr(head->weight.grad(), plain_gw),
                            RelErr(head->bias.grad(), plain_gb)});
        }
        if (r >= absl::GetFlag(FLAGS_warmup)) {
          c.ms.push_back(ms);
          c.peak = std::max(c.peak, peak);
        }
        std::fprintf(stderr, "V=%ld %s repeat %d: %.0f ms, peak %.1f MiB (loadavg %s)\n",
                     static_cast<long>(vocab), c.name.c_str(), r, ms, MiB(peak),
                     LoadAvg().c_str());
      }
    }
    out += Table(tokens, dim, vocab, configs) + "\n";
  }
  out += absl::StrFormat("loadavg before: %s; after: %s; wall %.0f s\n", load_before, LoadAvg(),
                         std::chrono::duration<double>(Clock::now() - start).count());
  std::cout << out;
  if (!absl::GetFlag(FLAGS_out).empty()) std::ofstream(absl::GetFlag(FLAGS_out)) << out;
  return 0;
}

}  // namespace
}  // namespace fairscale::mevo::bench

int main(int argc, char** argv) {
  fairscale::base::ParseCommandLine(argc, argv, fairscale::mevo::bench::kUsage);
  return fairscale::mevo::bench::Main();
}
