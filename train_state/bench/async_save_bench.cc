// How long a save blocks the training loop, synchronous vs asynchronous CheckpointManager saves,
// at 2 ranks (real processes over the tcp backend), for an FSDP (FULL_SHARD) GPT model with Adam:
// the main job's model (examples/gpt defaults: width 128, 4 blocks) and the 26.3 M-parameter
// model of //fsdp/bench. See README.md in this directory for the table and the command.
//
//   OMP_NUM_THREADS=1 ./bazelw run -c opt //train_state/bench:async_save_bench
//
// Per model, the two modes are interleaved (sync, async, sync, ... --repeats times); each repeat
// trains --steps_between steps, then saves, --saves times, and records the time save() blocked
// (async: the snapshot, plus any wait for the previous background save still writing) and the
// wall time of the whole loop (training steps + saves + the final wait), which shows what the
// background writes cost the training steps they overlap. Each rank writes its medians; the
// parent reports the slowest rank's.
#include <ATen/ops/randint.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "comm/bench/harness.h"
#include "examples/gpt/model.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/wrap.h"
#include "train_state/checkpoint_manager.h"
#include "train_state/fsdp_item.h"
#include "train_state/items.h"

ABSL_FLAG(int, ranks, 2, "world size");
ABSL_FLAG(std::string, models, "main,fsdp_bench", "models to run: main, fsdp_bench");
ABSL_FLAG(int, repeats, 3, "interleaved repeats of each mode per model");
ABSL_FLAG(int, saves, 3, "saves per repeat");
ABSL_FLAG(int, steps_between, 3, "training steps between two saves");
ABSL_FLAG(int, rank_timeout_s, 3600, "ranks still running after this long are killed");

namespace fairscale::train_state {
namespace {

namespace gpt = fairscale::examples::gpt;
using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

gpt::GptConfig ModelConfig(const std::string& name) {
  if (name == "main") return gpt::GptConfig().vocab(65).seq(64).width(128).heads(4).blocks(4);
  if (name == "fsdp_bench") {
    return gpt::GptConfig().vocab(1024).seq(64).width(512).heads(8).blocks(8);
  }
  std::fprintf(stderr, "unknown model '%s'\n", name.c_str());
  std::exit(2);
}

int RunRank(const comm::bench::BenchRank& me) {
  auto comm = comm::bench::Connect(me);
  if (!comm.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", me.rank, comm.status().ToString().c_str());
    return 1;
  }
  std::ofstream out(absl::StrCat(me.dir, "/rank", me.rank, ".tsv"));
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_models), ',')) {
    const gpt::GptConfig cfg = ModelConfig(std::string(name));
    torch::manual_seed(0);
    fsdp::FsdpOptions opts;
    std::optional<fsdp::FullyShardedDataParallel> model;
    {
      fsdp::EnableWrap scope(*comm, opts,
                             fsdp::module_type_auto_wrap_policy<gpt::TransformerBlockImpl>());
      model.emplace(gpt::Gpt(cfg), *comm, opts);
    }
    torch::optim::Adam opt((*model)->parameters(), torch::optim::AdamOptions(1e-4));
    int64_t params = 0;
    for (const auto& p : gpt::Gpt(cfg)->parameters()) params += p.numel();
    TrainState state;
    state.add("model", fsdp_item(*model, &opt));
    int64_t step = 0;
    auto train = [&](int n) {
      for (int i = 0; i < n; ++i, ++step) {
        torch::manual_seed(1000 + 7919 * me.rank + step);
        at::Tensor data = at::randint(cfg.vocab(), {4, cfg.seq() + 1}, at::kLong);
        opt.zero_grad();
        at::Tensor logits = (*model)(data.narrow(1, 0, cfg.seq()));
        torch::nn::functional::cross_entropy(logits.reshape({-1, cfg.vocab()}),
                                             data.narrow(1, 1, cfg.seq()).reshape({-1}))
            .backward();
        opt.step();
      }
    };
    train(2);  // warm up: Adam's state exists
    std::map<bool, std::vector<double>> blocked, loop;
    for (int rep = 0; rep < absl::GetFlag(FLAGS_repeats); ++rep) {
      for (bool async : {false, true}) {
        const std::string root = absl::StrCat(me.dir, "/ckpt_", name, "_", async, "_", rep);
        CheckpointManager m(*comm, CheckpointManagerOptions(root).async(async).keep_last(1));
        const auto start = Clock::now();
        for (int s = 0; s < absl::GetFlag(FLAGS_saves); ++s) {
          train(absl::GetFlag(FLAGS_steps_between));
          const auto t0 = Clock::now();
          m.save(step, state);  // async: includes waiting for the previous save, if still writing
          blocked[async].push_back(Ms(Clock::now() - t0));
        }
        m.wait();
        loop[async].push_back(Ms(Clock::now() - start));
      }
    }
    out << name << "\t" << params << "\t" << Median(blocked[false]) << "\t"
        << Median(blocked[true]) << "\t" << Median(loop[false]) << "\t" << Median(loop[true])
        << "\n";
  }
  return 0;
}

}  // namespace
}  // namespace fairscale::train_state

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  namespace ts = fairscale::train_state;
  if (auto me = fairscale::comm::bench::RankFromEnv("FS_TS_BENCH")) return ts::RunRank(*me);
  const int n = absl::GetFlag(FLAGS_ranks);
  absl::StatusOr<std::string> dir = fairscale::comm::bench::RunRanks(
      "FS_TS_BENCH", n,
      fairscale::comm::bench::ForwardFlags({"models", "repeats", "saves", "steps_between"}),
      absl::Seconds(absl::GetFlag(FLAGS_rank_timeout_s)));
  if (!dir.ok()) {
    std::fprintf(stderr, "%s\n", dir.status().ToString().c_str());
    return 1;
  }
  // The slowest rank's medians per model.
  std::map<std::string, std::vector<double>> worst;
  std::map<std::string, std::string> params;
  for (int r = 0; r < n; ++r) {
    std::ifstream in(absl::StrCat(*dir, "/rank", r, ".tsv"));
    std::string line;
    while (std::getline(in, line)) {
      std::vector<std::string> f = absl::StrSplit(line, '\t');
      if (f.size() != 6) continue;
      params[f[0]] = f[1];
      std::vector<double>& w = worst[f[0]];
      w.resize(4, 0);
      for (int i = 0; i < 4; ++i) {
        double v = 0;
        (void)absl::SimpleAtod(f[2 + i], &v);
        w[i] = std::max(w[i], v);
      }
    }
  }
  std::printf("| model | parameters | sync save blocks (ms) | async save blocks (ms) | async / sync | "
              "loop, sync (ms) | loop, async (ms) |\n|---|---|---|---|---|---|---|\n");
  for (const auto& [name, w] : worst) {
    std::printf("| %s | %s | %.1f | %.1f | %.3f | %.1f | %.1f |\n", name.c_str(),
                params[name].c_str(), w[0], w[1], w[0] > 0 ? w[1] / w[0] : 0.0, w[2], w[3]);
  }
  return 0;
}
