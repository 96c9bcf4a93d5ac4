// Offload benchmark: one process trains the GPT-style model of //examples/gpt (token + position
// embeddings, pre-norm transformer blocks, LM head) as a torch::nn::Sequential, in memory and
// offloaded to the disk tier, and reports per configuration the median step time, throughput
// relative to in-memory training, and the exact peak of CPU tensor memory
// (base::TrackingCpuAllocator). The tier directory should be on local disk with the files in
// the page cache (the default /tmp/offload_bench is). See README.md for the table and command:
//
//   OMP_NUM_THREADS=1 ./bazelw run -c opt //offload/bench:offload_bench
//
// Target of the issue: offloaded throughput >= 0.5x in-memory with the tier in the page cache.
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "base/flags.h"
#include "base/tracking_allocator.h"
#include "examples/gpt/model.h"
#include "offload/offload_model.h"
#include "offload/offloaded_optimizer.h"

ABSL_FLAG(int, blocks, 8, "transformer blocks");
ABSL_FLAG(int, width, 256, "model width");
ABSL_FLAG(int, heads, 8, "attention heads");
ABSL_FLAG(int, seq, 128, "sequence length");
ABSL_FLAG(int, batch, 8, "sequences per step");
ABSL_FLAG(int, vocab, 1024, "vocabulary size");
ABSL_FLAG(int, microbatches, 1, "OffloadModel micro-batches");
ABSL_FLAG(int, warmup, 2, "untimed steps per configuration");
ABSL_FLAG(int, steps, 5, "timed steps per configuration (the median is reported)");
ABSL_FLAG(int, rounds, 2,
          "the configurations run this many times in turn; the fastest round's median is "
          "reported (a loaded machine slows some rounds)");
ABSL_FLAG(int, threads, 1, "intra-op threads (at::set_num_threads)");
ABSL_FLAG(std::string, dir, "/tmp/offload_bench", "directory of the disk tier");
ABSL_FLAG(int64_t, chunk_bytes, 4 << 20, "offload chunk size in bytes");
ABSL_FLAG(std::string, out, "", "also write the markdown table here");

namespace fairscale::offload::bench {
namespace {

namespace gpt = ::fairscale::examples::gpt;
using Clock = std::chrono::steady_clock;

torch::nn::Sequential MakeGpt() {
  torch::manual_seed(0);
  torch::nn::Sequential seq;
  seq->push_back(gpt::Embeddings(absl::GetFlag(FLAGS_vocab), absl::GetFlag(FLAGS_seq),
                                 absl::GetFlag(FLAGS_width)));
  for (int i = 0; i < absl::GetFlag(FLAGS_blocks); ++i) {
    seq->push_back(gpt::TransformerBlock(absl::GetFlag(FLAGS_width), absl::GetFlag(FLAGS_heads)));
  }
  seq->push_back(gpt::LmHead(absl::GetFlag(FLAGS_width), absl::GetFlag(FLAGS_vocab)));
  return seq;
}

at::Tensor Loss(const at::Tensor& logits, const at::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                              targets.reshape({-1}));
}

struct Config {
  std::string name;
  // Builds the model and optimizer; returns one training step.
  std::function<std::function<void(const at::Tensor&, const at::Tensor&)>()> make;
};

struct Result {
  double step_s = 1e30;
  int64_t peak = 0;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int Main() {
  at::set_num_threads(absl::GetFlag(FLAGS_threads));
  base::TrackingCpuAllocator* alloc = base::TrackingCpuAllocator::Install();
  const std::string dir = absl::GetFlag(FLAGS_dir);
  const int64_t chunk = absl::GetFlag(FLAGS_chunk_bytes);

  int64_t numel = 0;
  {
    auto m = MakeGpt();
    for (const auto& p : m->parameters()) numel += p.numel();
  }

  std::vector<Config> configs;
  configs.push_back({"in memory, torch Adam", [] {
                       auto model = MakeGpt();
                       auto opt = std::make_shared<torch::optim::Adam>(
                           model->parameters(), torch::optim::AdamOptions(1e-3));
                       return [model, opt](const at::Tensor& x, const at::Tensor& y) mutable {
                         opt->zero_grad();
                         Loss(model->forward(x), y).backward();
                         opt->step();
                       };
                     }});
  configs.push_back({"in memory, OffloadedAdam (state on disk tier)", [dir, chunk] {
                       auto model = MakeGpt();
                       auto opt = std::make_shared<OffloadedAdam>(
                           std::vector{torch::optim::OptimizerParamGroup(model->parameters())},
                           torch::optim::AdamOptions(1e-3),
                           OffloadOptions(dir).name("bench_adam").chunk_bytes(chunk));
                       return [model, opt](const at::Tensor& x, const at::Tensor& y) mutable {
                         opt->zero_grad();
                         Loss(model->forward(x), y).backward();
                         opt->step();
                       };
                     }});
  for (bool ckpt : {false, true}) {
    configs.push_back(
        {ckpt ? "OffloadModel, 1 module per slice, checkpoint_activation"
              : "OffloadModel, 1 module per slice",
         [dir, chunk, ckpt] {
           auto seq = MakeGpt();
           const int64_t n = static_cast<int64_t>(seq->size());
           auto model = std::make_shared<OffloadModel>(
               seq, OffloadModelOptions(dir)
                        .name("bench_model")
                        .num_slices(n)
                        .num_microbatches(absl::GetFlag(FLAGS_microbatches))
                        .checkpoint_activation(ckpt)
                        .chunk_bytes(chunk),
               torch::optim::AdamOptions(1e-3));
           return [model](const at::Tensor& x, const at::Tensor& y) mutable {
             (*model)->zero_grad();
             Loss((*model)(x), y).backward();
             (*model)->step();
           };
         }});
  }

  torch::manual_seed(1);
  const int64_t vocab = absl::GetFlag(FLAGS_vocab);
  at::Tensor tokens =
      torch::randint(vocab, {absl::GetFlag(FLAGS_batch), absl::GetFlag(FLAGS_seq)}, at::kLong);
  at::Tensor targets = torch::roll(tokens, -1, 1);

  std::vector<Result> results(configs.size());
  for (int round = 0; round < absl::GetFlag(FLAGS_rounds); ++round) {
    for (size_t c = 0; c < configs.size(); ++c) {
      alloc->reset_peak();
      const int64_t live_before = alloc->live_bytes();
      std::vector<double> times;
      {
        auto step = configs[c].make();
        for (int i = 0; i < absl::GetFlag(FLAGS_warmup); ++i) step(tokens, targets);
        for (int i = 0; i < absl::GetFlag(FLAGS_steps); ++i) {
          const auto t0 = Clock::now();
          step(tokens, targets);
          times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
        }
      }
      results[c].step_s = std::min(results[c].step_s, Median(times));
      results[c].peak = std::max(results[c].peak, alloc->peak_bytes() - live_before);
    }
  }

  const double tokens_per_step =
      static_cast<double>(absl::GetFlag(FLAGS_batch)) * absl::GetFlag(FLAGS_seq);
  std::string table = absl::StrFormat(
      "GPT: %d blocks, width %d, %d heads, seq %d, batch %d, vocab %d: %.2f M parameters, "
      "params + grads + Adam state %.1f MiB; micro-batches %d, chunk %lld B, %d thread(s)\n\n",
      absl::GetFlag(FLAGS_blocks), absl::GetFlag(FLAGS_width), absl::GetFlag(FLAGS_heads),
      absl::GetFlag(FLAGS_seq), absl::GetFlag(FLAGS_batch), vocab, numel / 1e6,
      16.0 * numel / (1 << 20), absl::GetFlag(FLAGS_microbatches),
      static_cast<long long>(chunk), absl::GetFlag(FLAGS_threads));
  table += "| configuration | step (ms) | tokens/s | throughput vs in memory | tracked peak (MiB) |\n";
  table += "|---|---|---|---|---|\n";
  for (size_t c = 0; c < configs.size(); ++c) {
    table += absl::StrFormat("| %s | %.1f | %.0f | %.2fx | %.1f |\n", configs[c].name,
                             1e3 * results[c].step_s, tokens_per_step / results[c].step_s,
                             results[0].step_s / results[c].step_s,
                             results[c].peak / double(1 << 20));
  }
  std::cout << table << std::flush;
  if (!absl::GetFlag(FLAGS_out).empty()) std::ofstream(absl::GetFlag(FLAGS_out)) << table;
  return 0;
}

}  // namespace fairscale::offload::bench

constexpr char kUsage[] =
    "step time, throughput and peak memory of a GPT trained in memory and offloaded\n"
    "to the disk tier (--dir), in one process (offload/bench/README.md).\n"
    "\n"
    "  OMP_NUM_THREADS=1 offload_bench --dir=/tmp/offload_bench\n"
    "\n"
    "Environment read: none (OMP_NUM_THREADS by LibTorch).";

int main(int argc, char** argv) {
  fairscale::base::ParseCommandLine(argc, argv, kUsage);
  return fairscale::offload::bench::Main();
}
