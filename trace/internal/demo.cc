#include "trace/internal/demo.h"

#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/communicator.h"
#include "comm/config.h"
#include "comm/registry.h"
#include "comm/store/hash_store.h"
#include "trace/chrome_trace.h"
#include "trace/profile.h"
#include "trace/recorder.h"
#include "trace/tracing_communicator.h"

namespace fairscale::trace::internal {
namespace {

constexpr size_t kShard = 1 << 14;  // floats per rank in the fake parameter shards

// Deterministic busy work standing in for a layer's math.
float Compute(std::vector<float>& x, int rounds) {
  float acc = 0.0f;
  for (int r = 0; r < rounds; ++r) {
    for (float& v : x) {
      v = v * 0.999f + 0.001f;
      acc += v;
    }
  }
  return acc;
}

absl::Status RunRank(const DemoOptions& options, std::shared_ptr<comm::Store> store, int rank) {
  comm::CommConfig config;
  config.rank = rank;
  config.size = options.ranks;
  config.store = std::move(store);
  config.timeout = options.timeout;
  config.name = "trace_demo";
  absl::StatusOr<std::shared_ptr<comm::Communicator>> plain =
      comm::CreateCommunicator("inproc", config);
  if (!plain.ok()) return plain.status();
  auto recorder = std::make_shared<Recorder>(rank);
  recorder->SetThreadName("main");
  auto comm = std::make_shared<TracingCommunicator>(*plain, recorder);

  const int n = options.ranks;
  std::vector<float> shard(kShard, 1.0f + rank), full(kShard * n), grads(kShard * n, 0.5f),
      grad_shard(kShard), activations(kShard * 4, 0.1f);
  float sink = 0.0f;
  for (int step = 0; step < options.steps; ++step) {
    {
      Scope s(*recorder, "forward", kCategoryCompute, {Arg("step", step)});
      // Prefetch the full parameters while the first layers compute.
      comm::Work gather = comm->AllGather(comm::MakeConstBuffer(shard.data(), kShard),
                                          comm::MakeBuffer(full.data(), full.size()));
      sink += Compute(activations, options.compute_rounds);
      absl::Status st = gather.Wait();
      if (!st.ok()) return st;
      sink += Compute(activations, options.compute_rounds / 2);
    }
    comm::Work reduce;
    {
      Scope s(*recorder, "backward", kCategoryCompute, {Arg("step", step)});
      sink += Compute(activations, options.compute_rounds);
      // Gradients of the last layers are ready: reduce them while the rest of backward runs.
      reduce = comm->ReduceScatter(comm::MakeConstBuffer(grads.data(), grads.size()),
                                   comm::MakeBuffer(grad_shard.data(), kShard),
                                   comm::ReduceOp::kAvg);
      sink += Compute(activations, options.compute_rounds);
    }
    absl::Status st = reduce.Wait();
    if (!st.ok()) return st;
    {
      Scope s(*recorder, "optimizer", kCategoryCompute, {Arg("step", step)});
      for (size_t i = 0; i < kShard; ++i) shard[i] -= 0.01f * grad_shard[i];
      sink += Compute(shard, options.compute_rounds / 4);
    }
    float loss = sink * 1e-9f, total = 0.0f;
    st = comm->AllReduce(comm::MakeConstBuffer(&loss, 1), comm::MakeBuffer(&total, 1),
                         comm::ReduceOp::kSum)
             .Wait();
    if (!st.ok()) return st;
    recorder->Counter("activation_mb",
                      static_cast<double>(activations.size() * sizeof(float)) / (1 << 20));
    recorder->Instant("step_end", "app", {Arg("step", step)});
  }
  absl::Status st = recorder->WriteChromeTrace(RankTracePath(options.trace_path, rank));
  if (!st.ok()) return st;
  // Everyone has written before rank 0 merges (untraced: the files are already closed).
  st = (*plain)->Barrier().Wait();
  if (!st.ok()) return st;
  if (rank == 0) {
    std::vector<std::string> inputs;
    for (int r = 0; r < n; ++r) inputs.push_back(RankTracePath(options.trace_path, r));
    st = MergeChromeTraces(inputs, options.trace_path);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> RunDemo(const DemoOptions& options) {
  if (options.ranks < 1 || options.steps < 1) {
    return absl::InvalidArgumentError(absl::StrCat("trace_demo: ranks (", options.ranks,
                                                   ") and steps (", options.steps,
                                                   ") must be >= 1"));
  }
  auto store = std::make_shared<comm::HashStore>();
  std::vector<absl::Status> statuses(options.ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < options.ranks; ++r) {
    threads.emplace_back([&, r] { statuses[r] = RunRank(options, store, r); });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < options.ranks; ++r) {
    if (!statuses[r].ok()) {
      return absl::Status(statuses[r].code(),
                          absl::StrCat("trace_demo rank ", r, ": ", statuses[r].message()));
    }
  }
  absl::StatusOr<std::vector<ProfileSummary>> summaries = SummarizeTraceFile(options.trace_path);
  if (!summaries.ok()) return summaries.status();
  return FormatProfileTable(*summaries);
}

}  // namespace fairscale::trace::internal
