// Activation checkpointing benchmark: one process trains the GPT-style model of //examples/gpt
// (token + position embeddings, pre-norm transformer blocks, LM head; Adam) with no block, every
// other block and every block checkpointed, and reports per configuration the median step time
// and the exact peak tensor memory (base::TrackingCpuAllocator), split into the activation part
// (peak during forward + backward minus the bytes live before the forward: parameters, gradients
// and optimizer state excluded). See README.md for the table and the command:
//
//   OMP_NUM_THREADS=1 ./bazelw run -c opt //checkpoint/bench:checkpoint_bench
//
// Target of the issue: every block checkpointed costs <= 1.4x the step time for >= 3x less
// activation memory.
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/flags.h"
#include "base/tracking_allocator.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/memory_tracker.h"
#include "examples/gpt/model.h"

ABSL_FLAG(int, blocks, 8, "transformer blocks");
ABSL_FLAG(int, width, 256, "model width");
ABSL_FLAG(int, heads, 8, "attention heads");
ABSL_FLAG(int, seq, 128, "sequence length");
ABSL_FLAG(int, batch, 8, "sequences per step");
ABSL_FLAG(int, vocab, 1024, "vocabulary size");
ABSL_FLAG(int, warmup, 2, "untimed steps per configuration");
ABSL_FLAG(int, steps, 6, "timed steps per configuration (the median is reported)");
ABSL_FLAG(int, rounds, 3,
          "the configurations run this many times in turn; the fastest round's median is "
          "reported (a loaded machine slows some rounds)");
ABSL_FLAG(int, threads, 1, "intra-op threads (at::set_num_threads)");
ABSL_FLAG(std::string, every_k, "0,2,1",
          "configurations: checkpoint block i when i % k == 0 (0: none, 1: every block)");
ABSL_FLAG(std::string, out, "", "also write the markdown table here");

namespace fairscale::checkpoint::bench {
namespace {

namespace gpt = ::fairscale::examples::gpt;
using Clock = std::chrono::steady_clock;

// The GPT of //examples/gpt built from its public parts, so blocks can be checkpointed.
class BenchGptImpl : public torch::nn::Module {
 public:
  explicit BenchGptImpl(const gpt::GptConfig& c) {
    embed_ = register_module("embed", gpt::Embeddings(c.vocab(), c.seq(), c.width()));
    for (int64_t i = 0; i < c.blocks(); ++i) {
      gpt::TransformerBlock b(c.width(), c.heads());
      register_module("block" + std::to_string(i), b);
      blocks_.emplace_back(b);
    }
    head_ = register_module("lm_head", gpt::LmHead(c.width(), c.vocab()));
  }
  at::Tensor forward(const at::Tensor& tokens, int64_t every_k, MemoryTracker* tracker) {
    at::Tensor x = embed_(tokens);
    if (tracker == nullptr) {
      x = checkpoint_every_kth(blocks_, x, every_k);
    } else {
      for (size_t i = 0; i < blocks_.size(); ++i) {
        torch::nn::AnyModule b = blocks_[i];
        x = tracker->forward("block" + std::to_string(i), *b.ptr(), x,
                             [b](const at::Tensor& in) mutable { return b.forward<at::Tensor>(in); });
      }
    }
    return head_(x);
  }

 private:
  gpt::Embeddings embed_{nullptr};
  std::vector<torch::nn::AnyModule> blocks_;
  gpt::LmHead head_{nullptr};
};
TORCH_MODULE(BenchGpt);

struct Row {
  int64_t every_k = 0;
  double step_ms = 0;
  int64_t peak_bytes = 0;        // all tensor memory during training steps
  int64_t activation_bytes = 0;  // peak during forward + backward - live before the forward
};

double MiB(int64_t b) { return static_cast<double>(b) / (1 << 20); }

int Main() {
  at::set_num_threads(absl::GetFlag(FLAGS_threads));
  base::TrackingCpuAllocator* alloc = base::TrackingCpuAllocator::Install();
  const gpt::GptConfig config = gpt::GptConfig()
                                    .vocab(absl::GetFlag(FLAGS_vocab))
                                    .seq(absl::GetFlag(FLAGS_seq))
                                    .width(absl::GetFlag(FLAGS_width))
                                    .heads(absl::GetFlag(FLAGS_heads))
                                    .blocks(absl::GetFlag(FLAGS_blocks));
  const int batch = absl::GetFlag(FLAGS_batch);
  std::vector<Row> rows;
  for (absl::string_view k : absl::StrSplit(absl::GetFlag(FLAGS_every_k), ',')) {
    Row row;
    row.every_k = std::stoll(std::string(k));
    row.step_ms = 1e300;
    rows.push_back(row);
  }
  for (int round = 0; round < absl::GetFlag(FLAGS_rounds); ++round) {
    for (Row& row : rows) {
      torch::manual_seed(0);
      BenchGpt model(config);
      torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-4));
      std::vector<double> times;
      alloc->reset_peak();
      for (int step = 0; step < absl::GetFlag(FLAGS_warmup) + absl::GetFlag(FLAGS_steps);
           ++step) {
        at::Tensor tokens = torch::randint(config.vocab(), {batch, config.seq() + 1});
        at::Tensor in = tokens.narrow(1, 0, config.seq());
        at::Tensor target = tokens.narrow(1, 1, config.seq());
        const auto t0 = Clock::now();
        opt.zero_grad();  // sets gradients to zero, keeps them allocated after the first step
        const int64_t before = alloc->live_bytes();
        const int64_t outer_peak = alloc->peak_bytes();
        alloc->reset_peak();
        at::Tensor logits = model->forward(in, row.every_k, nullptr);
        at::Tensor loss = torch::nn::functional::cross_entropy(
            logits.reshape({-1, config.vocab()}), target.reshape({-1}));
        loss.backward();
        const int64_t activation = alloc->peak_bytes() - before;
        alloc->raise_peak(outer_peak);
        opt.step();
        const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        if (step >= absl::GetFlag(FLAGS_warmup)) {
          times.push_back(ms);
          row.activation_bytes = std::max(row.activation_bytes, activation);
        }
      }
      std::sort(times.begin(), times.end());
      row.step_ms = std::min(row.step_ms, times[times.size() / 2]);
      row.peak_bytes = std::max(row.peak_bytes, alloc->peak_bytes());
    }
  }

  std::string table = absl::StrFormat(
      "GPT: %d blocks, width %d, %d heads, seq %d, batch %d, vocab %d; %d thread(s), median of %d "
      "steps\n\n"
      "| checkpointed blocks | step ms | x time | activation MiB | / activation | peak MiB |\n"
      "|---|---:|---:|---:|---:|---:|\n",
      config.blocks(), config.width(), config.heads(), config.seq(), batch, config.vocab(),
      absl::GetFlag(FLAGS_threads), absl::GetFlag(FLAGS_steps), absl::GetFlag(FLAGS_rounds));
  const Row* base_row = nullptr;
  for (const Row& r : rows) {
    if (r.every_k == 0) base_row = &r;
  }
  for (const Row& r : rows) {
    const std::string which = r.every_k == 0   ? "none"
                              : r.every_k == 1 ? "every block"
                                               : absl::StrFormat("1 in %d", r.every_k);
    table += absl::StrFormat(
        "| %s | %.1f | %.2f | %.2f | %.2f | %.2f |\n", which, r.step_ms,
        base_row ? r.step_ms / base_row->step_ms : 0.0, MiB(r.activation_bytes),
        base_row ? static_cast<double>(base_row->activation_bytes) / r.activation_bytes : 0.0,
        MiB(r.peak_bytes));
  }
  for (const Row& r : rows) {
    if (r.every_k == 1 && base_row != nullptr) {
      const double t = r.step_ms / base_row->step_ms;
      const double m = static_cast<double>(base_row->activation_bytes) / r.activation_bytes;
      table += absl::StrFormat(
          "\nevery block checkpointed: %.2fx step time (target <= 1.4x: %s), %.2fx less "
          "activation memory (target >= 3x: %s)\n",
          t, t <= 1.4 ? "met" : "missed", m, m >= 3.0 ? "met" : "missed");
    }
  }

  // The memory tracer on the plain model, and its suggestion for half the activation memory.
  {
    torch::manual_seed(0);
    BenchGpt model(config);
    MemoryTracker tracker(alloc);
    at::Tensor tokens = torch::randint(config.vocab(), {batch, config.seq() + 1});
    at::Tensor logits = model->forward(tokens.narrow(1, 0, config.seq()), 0, &tracker);
    torch::nn::functional::cross_entropy(logits.reshape({-1, config.vocab()}),
                                         tokens.narrow(1, 1, config.seq()).reshape({-1}))
        .backward();
    const CheckpointPlan all = tracker.suggest_checkpoints(0);
    table += "\nPer-block memory (MemoryTracker, no checkpointing):\n\n" + tracker.table() +
             "\nSuggestion for half the blocks' activation memory:\n\n" +
             tracker.suggestion_table(all.plain_bytes / 2);
  }
  std::cout << table;
  if (const std::string out = absl::GetFlag(FLAGS_out); !out.empty()) {
    const std::string tmp = out + ".tmp";
    std::ofstream f(tmp);
    f << table;
    f.close();
    if (!f || std::rename(tmp.c_str(), out.c_str()) != 0) {
      std::cerr << "checkpoint_bench: cannot write " << out << "\n";
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace fairscale::checkpoint::bench

constexpr char kUsage[] =
    "step time and activation memory of a GPT with no, every other and every\n"
    "block checkpointed, in one process (checkpoint/README.md).\n"
    "\n"
    "  OMP_NUM_THREADS=1 checkpoint_bench --every_k=0,2,1\n"
    "\n"
    "Environment read: none (OMP_NUM_THREADS by LibTorch).";

int main(int argc, char** argv) {
  fairscale::base::ParseCommandLine(argc, argv, kUsage);
  return fairscale::checkpoint::bench::Main();
}
