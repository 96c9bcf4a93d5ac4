// One rank of the side-by-side comparison with PyTorch (fsdp/bench/vs_pytorch.py, README.md
// "fairscale-cpp vs PyTorch DDP"): trains the model the driver describes, from the initial
// weights and batches the driver wrote, with one of our data-parallel configurations, and writes
// what it measured as JSON. The driver starts the ranks (FS_VS_PYTORCH_RANK/_SIZE/_DIR, a
// FileStore rendezvous in that directory, tcp on 127.0.0.1) interleaved with PyTorch's.
//
//   --config  NO_SHARD | FULL_SHARD | SHARD_GRAD_OP (FullyShardedDataParallel, every block /
//             layer its own unit), OSS_SDP (oss::OSS + ShardedDataParallel), unwrapped (no
//             communication: at n ranks, n independent trainings on the ranks' shares)
//   --data    the driver's torch.save file: {"model": "gpt"|"mlp", shape fields, "params":
//             {name: tensor}, "inputs": [steps, global batch, ...], "targets": ...}
//
// The rank's share of every global batch is rows [r B/n, (r+1) B/n): the losses of a run are the
// mean over ranks of each rank's mean loss, the same number PyTorch's side reports.
#include <ATen/Parallel.h>
#include <dirent.h>
#include <sys/resource.h>
#include <time.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/flags.h"
#include "comm/bench/harness.h"
#include "comm/communicator.h"
#include "examples/gpt/model.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/state_dict.h"
#include "fsdp/wrap.h"
#include "oss/oss.h"
#include "oss/sharded_data_parallel.h"

ABSL_FLAG(std::string, config, "NO_SHARD",
          "NO_SHARD, FULL_SHARD, SHARD_GRAD_OP, OSS_SDP, unwrapped");
ABSL_FLAG(std::string, data, "", "the driver's torch.save file (weights, batches, shape)");
ABSL_FLAG(std::string, out, "", "where to write this rank's JSON result");
ABSL_FLAG(int, warmup, 3, "untimed steps");
ABSL_FLAG(double, lr, 1e-3, "Adam learning rate");
ABSL_FLAG(double, bucket_cap_mb, 0, "FsdpOptions::bucket_cap_mb");
ABSL_FLAG(std::string, comm_options, "",
          "CommConfig options of our backend, key=value,... (e.g. tcp.cma_min_bytes=0)");
ABSL_FLAG(std::string, backend, "tcp",
          "our backend: tcp, or ucx (UCX picks its transports from UCX_TLS, e.g. posix,sysv,self "
          "for shared memory)");

namespace fairscale::fsdp::bench {
namespace {

namespace gpt = ::fairscale::examples::gpt;
using Clock = std::chrono::steady_clock;

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "vs_pytorch_rank: %s\n", what.c_str());
  std::exit(1);
}

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Per thread of this process (from /proc/self/task/<tid>/schedstat, nanoseconds): time on a CPU
// and time runnable but waiting for one; the name from .../comm.
struct ThreadTime {
  std::string name;
  double run_s = 0, runq_s = 0;
};
std::map<int, ThreadTime> ThreadTimesNow() {
  std::map<int, ThreadTime> out;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return out;
  while (dirent* e = readdir(dir)) {
    const int tid = std::atoi(e->d_name);
    if (tid <= 0) continue;
    const std::string base = absl::StrCat("/proc/self/task/", tid);
    ThreadTime t;
    std::ifstream comm_file(base + "/comm");
    std::getline(comm_file, t.name);  // may contain spaces: "fs-comm tcp"
    unsigned long long run = 0, wait = 0;
    std::ifstream(base + "/schedstat") >> run >> wait;
    t.run_s = run * 1e-9;
    t.runq_s = wait * 1e-9;
    out[tid] = t;
  }
  closedir(dir);
  return out;
}

// A JSON string literal of `s` (thread names are chosen by whoever started the thread).
std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (const unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// {"main": {...}, "others": [{"name", "run_s", "runq_s"}...]}: what each thread used between
// the two samples (a thread born in between counts from zero).
std::string ThreadJson(const std::map<int, ThreadTime>& before,
                       const std::map<int, ThreadTime>& after) {
  const int self = getpid();
  std::string main_json, others;
  for (const auto& [tid, t] : after) {
    ThreadTime d = t;
    if (auto it = before.find(tid); it != before.end()) {
      d.run_s -= it->second.run_s;
      d.runq_s -= it->second.runq_s;
    }
    const std::string j = absl::StrFormat("{\"name\": %s, \"run_s\": %.6f, \"runq_s\": %.6f}",
                                          JsonString(d.name), d.run_s, d.runq_s);
    if (tid == self) {
      main_json = j;
    } else {
      absl::StrAppend(&others, others.empty() ? "" : ", ", j);
    }
  }
  return absl::StrCat("{\"main\": ", main_json, ", \"others\": [", others, "]}");
}

// This thread's CPU time in seconds (exact, unlike schedstat's, which lags by up to a tick).
double ThreadBusy() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

c10::Dict<c10::IValue, c10::IValue> LoadData(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) Die(absl::StrCat("cannot read --data ", path));
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  c10::IValue v = torch::jit::pickle_load(bytes);
  if (!v.isGenericDict()) Die("--data is not a dict");
  return v.toGenericDict();
}

// The comm-bound comparison's MLP: `layers` Linear(width, width) named fc0, fc1, ..., a ReLU
// between two (PyTorch's side defines the same class). Each layer goes through fsdp::wrap().
class MlpImpl : public torch::nn::Module {
 public:
  MlpImpl(int64_t width, int64_t layers) {
    for (int64_t i = 0; i < layers; ++i) {
      fc_.push_back(fsdp::wrap(torch::nn::Linear(width, width)));
      register_module(absl::StrCat("fc", i), fc_.back().ptr());
    }
  }
  at::Tensor forward(at::Tensor x) {
    for (size_t i = 0; i < fc_.size(); ++i) {
      x = fc_[i](x);
      if (i + 1 < fc_.size()) x = x.relu();
    }
    return x;
  }

 private:
  std::vector<fsdp::Wrapped> fc_;
};
TORCH_MODULE(Mlp);

std::string Json(const std::vector<double>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i)
    absl::StrAppend(&s, i ? ", " : "", absl::StrFormat("%.9g", v[i]));
  return s + "]";
}

template <typename M>
int Train(M model, const c10::Dict<c10::IValue, c10::IValue>& data,
          const comm::bench::BenchRank& me, std::shared_ptr<comm::Communicator> comm,
          const std::string& config, const FsdpOptions& opts, const at::Tensor& inputs,
          const at::Tensor& targets) {
  const bool gpt_model = data.at("model").toStringRef() == "gpt";
  const int64_t steps = inputs.size(0), local = inputs.size(1) / me.size;
  // The driver's weights, by name (PyTorch's state_dict names are the unwrapped model's).
  const auto params = data.at("params").toGenericDict();
  auto load_plain = [&] {
    torch::NoGradGuard no_grad;
    int64_t loaded = 0;
    for (auto& item : model->named_parameters()) {
      if (!params.contains(item.key())) Die("--data has no weights for " + item.key());
      item.value().copy_(params.at(item.key()).toTensor());
      ++loaded;
    }
    if (loaded != static_cast<int64_t>(params.size())) Die("--data has weights the model lacks");
  };
  const auto adam = torch::optim::AdamOptions(absl::GetFlag(FLAGS_lr));
  FullyShardedDataParallel fsdp_model{nullptr};
  oss::ShardedDataParallel sdp{nullptr};
  std::shared_ptr<torch::optim::Optimizer> opt;
  std::function<at::Tensor(const at::Tensor&)> forward;
  if (config == "OSS_SDP") {
    std::shared_ptr<oss::OSS> sharded =
        oss::OSS::make<torch::optim::Adam>(model->parameters(), adam, comm);
    opt = sharded;
    load_plain();
    sdp = oss::ShardedDataParallel(torch::nn::AnyModule(model), sharded);
    forward = [&](const at::Tensor& x) { return sdp->forward(x); };
  } else if (config == "unwrapped") {
    // At n ranks: n independent trainings side by side (each rank its share of the batch), the
    // same per-rank compute and core contention without any communication.
    load_plain();
    opt = std::make_shared<torch::optim::Adam>(model->parameters(), adam);
    forward = [&](const at::Tensor& x) { return model->forward(x); };
  } else {
    fsdp_model = FullyShardedDataParallel(model, comm, opts);
    StateDict state;
    for (const auto& item : params) state.insert(item.key().toStringRef(), item.value().toTensor());
    load_full_state_dict(fsdp_model, state);
    opt = std::make_shared<torch::optim::Adam>(fsdp_model->parameters(), adam);
    forward = [&](const at::Tensor& x) { return fsdp_model->forward(x); };
  }

  const int warmup = absl::GetFlag(FLAGS_warmup);
  std::vector<double> losses, step_s, fwd_s, bwd_s, opt_s, blocked_s;
  std::map<int, ThreadTime> threads_before, threads_after;
  Clock::time_point window_start;
  int64_t faults_before = 0;
  for (int64_t step = 0; step < steps; ++step) {
    if (step == warmup) {
      threads_before = ThreadTimesNow();
      window_start = Clock::now();
      rusage ru{};
      getrusage(RUSAGE_SELF, &ru);
      faults_before = ru.ru_minflt + ru.ru_majflt;
    }
    const at::Tensor x = inputs[step].narrow(0, me.rank * local, local);
    const at::Tensor y = targets[step].narrow(0, me.rank * local, local);
    const double b0 = ThreadBusy();
    const auto t0 = Clock::now();
    opt->zero_grad();
    at::Tensor out = forward(x);
    at::Tensor loss = gpt_model ? torch::nn::functional::cross_entropy(
                                      out.reshape({-1, out.size(-1)}), y.reshape({-1}))
                                : torch::nn::functional::mse_loss(out, y);
    const double t_fwd = Since(t0), b1 = ThreadBusy();
    const auto t1 = Clock::now();
    loss.backward();
    const double t_bwd = Since(t1), b2 = ThreadBusy();
    const auto t2 = Clock::now();
    opt->step();
    const double t_opt = Since(t2), t_step = Since(t0), b3 = ThreadBusy();
    losses.push_back(loss.item<double>());
    if (!std::isfinite(losses.back())) Die("the loss is not finite");
    if (step >= warmup) {
      step_s.push_back(t_step);
      fwd_s.push_back(t_fwd);
      bwd_s.push_back(t_bwd);
      opt_s.push_back(t_opt);
      // Off-CPU: the wall time the training thread was not running (blocked, or waiting for a
      // core).
      blocked_s.push_back(t_fwd - (b1 - b0));
      blocked_s.push_back(t_bwd - (b2 - b1));
      blocked_s.push_back(t_opt - (b3 - b2));
    }
  }
  threads_after = ThreadTimesNow();
  const double window_s = Since(window_start);
  absl::Status st = comm->Barrier().Wait();
  if (!st.ok()) Die(st.ToString());

  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  std::ofstream out(absl::GetFlag(FLAGS_out));
  out << "{\"losses\": " << Json(losses) << ", \"step_s\": " << Json(step_s)
      << ", \"fwd_s\": " << Json(fwd_s) << ", \"bwd_s\": " << Json(bwd_s)
      << ", \"opt_s\": " << Json(opt_s) << ", \"blocked_s\": " << Json(blocked_s)
      << ", \"window_s\": " << window_s << ", \"peak_rss_kib\": " << ru.ru_maxrss
      << ", \"page_faults\": " << (ru.ru_minflt + ru.ru_majflt - faults_before)
      << ", \"threads\": " << ThreadJson(threads_before, threads_after) << "}\n";
  out.close();
  if (!out) Die("cannot write --out");
  return 0;
}

int RunRank(const comm::bench::BenchRank& me) {
  at::set_num_threads(1);
  auto data = LoadData(absl::GetFlag(FLAGS_data));
  const std::string model_kind = data.at("model").toStringRef();
  const at::Tensor inputs = data.at("inputs").toTensor(), targets = data.at("targets").toTensor();
  if (inputs.size(1) % me.size != 0) Die("the global batch is not divisible by the world size");
  if (model_kind != "gpt" && model_kind != "mlp") Die("unknown model " + model_kind);
  const std::string config = absl::GetFlag(FLAGS_config);
  const bool fsdp_config =
      config == "NO_SHARD" || config == "FULL_SHARD" || config == "SHARD_GRAD_OP";
  if (!fsdp_config && config != "OSS_SDP" && config != "unwrapped") {
    Die("unknown --config " + config);
  }

  absl::flat_hash_map<std::string, std::string> comm_options;
  for (absl::string_view kv :
       absl::StrSplit(absl::GetFlag(FLAGS_comm_options), ',', absl::SkipEmpty())) {
    std::pair<std::string, std::string> parts = absl::StrSplit(kv, absl::MaxSplits('=', 1));
    comm_options[parts.first] = parts.second;
  }
  auto created = comm::bench::Connect(me, absl::GetFlag(FLAGS_backend), absl::Minutes(5),
                                      comm_options);
  if (!created.ok()) Die(created.status().ToString());
  std::shared_ptr<comm::Communicator> comm = *std::move(created);

  FsdpOptions opts;
  if (fsdp_config) {
    opts.sharding_strategy(config == "NO_SHARD"     ? ShardingStrategy::kNoShard
                           : config == "FULL_SHARD" ? ShardingStrategy::kFullShard
                                                    : ShardingStrategy::kShardGradOp)
        .bucket_cap_mb(absl::GetFlag(FLAGS_bucket_cap_mb));
  }
  torch::manual_seed(0);  // the same (overwritten) initial weights on every rank
  auto run = [&](auto model) {
    return Train(model, data, me, comm, config, opts, inputs, targets);
  };
  if (model_kind == "gpt") {
    auto build = [&] {
      return gpt::Gpt(gpt::GptConfig()
                          .vocab(data.at("vocab").toInt())
                          .seq(data.at("seq").toInt())
                          .width(data.at("width").toInt())
                          .heads(data.at("heads").toInt())
                          .blocks(data.at("blocks").toInt()));
    };
    if (!fsdp_config) return run(build());
    // Built inside the scope: every block becomes its own unit.
    EnableWrap scope(comm, opts, gpt::GptWrapPolicy());
    return run(build());
  }
  auto build = [&] { return Mlp(data.at("width").toInt(), data.at("layers").toInt()); };
  if (!fsdp_config) return run(build());
  EnableWrap scope(comm, opts, fsdp::module_type_auto_wrap_policy<torch::nn::LinearImpl>());
  return run(build());
}

}  // namespace
}  // namespace fairscale::fsdp::bench

constexpr char kUsage[] =
    "one rank of fsdp/bench/vs_pytorch.py's comparison with PyTorch DDP (started by it)";

int main(int argc, char** argv) {
  fairscale::base::ParseCommandLine(argc, argv, kUsage);
  auto me = fairscale::comm::bench::RankFromEnv("FS_VS_PYTORCH");
  if (!me) {
    std::fprintf(stderr, "vs_pytorch_rank: run it through fsdp/bench/vs_pytorch.py\n");
    return 2;
  }
  return fairscale::fsdp::bench::RunRank(*me);
}
