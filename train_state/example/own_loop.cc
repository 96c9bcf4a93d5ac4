// A user's own training loop with the CheckpointManager (//train_state/example:own_loop): an FSDP
// model, its Adam and the data position saved every --save_every steps, restored on start. Launch
// it with fs_launch (or torchrun's environment); run it again after a crash and it continues
// where the newest complete checkpoint left off, exactly: own_loop_test.sh checks that a run
// killed and resumed ends bitwise equal to an uninterrupted one.
//
//   bazel-bin/launch/fs_launch --nproc_per_node=2 -- bazel-bin/train_state/example/own_loop
//       --ckpt=/tmp/ckpt --steps=40
#include <torch/torch.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "base/fnv1a.h"
#include "comm/registry.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "train_state/checkpoint_manager.h"
#include "train_state/distributed_sampler.h"
#include "train_state/fsdp_item.h"
#include "train_state/items.h"

ABSL_FLAG(std::string, ckpt, "/tmp/own_loop_ckpt", "checkpoint root");
ABSL_FLAG(int64_t, steps, 40, "steps to train");
ABSL_FLAG(int64_t, save_every, 5, "steps between checkpoints");
ABSL_FLAG(int64_t, die_after, -1, "exit(3) after this step without saving it (a crash)");
ABSL_FLAG(bool, async, true, "asynchronous checkpoints");

namespace ts = fairscale::train_state;
using fairscale::fsdp::FullyShardedDataParallel;

// A regression dataset: x in R^8, y = a fixed linear function of x.
struct Points : torch::data::datasets::Dataset<Points> {
  torch::data::Example<> get(size_t i) override {
    torch::Tensor x = torch::sin(torch::arange(8, torch::kFloat) * static_cast<float>(i + 1));
    return {x, x.sum(0, true) * 0.5};
  }
  torch::optional<size_t> size() const override { return 1000; }
};

struct NetImpl : torch::nn::Module {
  torch::nn::Linear fc1 = register_module("fc1", torch::nn::Linear(8, 32));
  torch::nn::Linear fc2 = register_module("fc2", torch::nn::Linear(32, 1));
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
};
TORCH_MODULE(Net);

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  auto comm = fairscale::comm::CreateCommunicatorFromEnv().value();  // throws on failure
  const int rank = comm->rank(), world = comm->size();
  torch::manual_seed(0);  // the same initial weights on every rank
  FullyShardedDataParallel model(Net(), comm);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  ts::DistributedSampler sampler(1000, rank, world, ts::DistributedSamplerOptions().seed(1));
  auto loader = torch::data::make_data_loader(Points().map(torch::data::transforms::Stack<>()),
                                              sampler, torch::data::DataLoaderOptions(16 / world));

  ts::TrainState state;
  int64_t step = 0;
  state.add("model", ts::fsdp_item(model, &opt))
      .add("data", ts::sampler_item(sampler))
      .add("step", ts::json_item([&] { return nlohmann::json(step); },
                                 [&](const nlohmann::json& j) { step = j.get<int64_t>(); }));
  ts::CheckpointManager manager(
      comm, ts::CheckpointManagerOptions(absl::GetFlag(FLAGS_ckpt)).async(absl::GetFlag(FLAGS_async)));
  if (manager.restore(state)) std::printf("rank %d resumed at step %lld\n", rank, (long long)step);

  while (step < absl::GetFlag(FLAGS_steps)) {
    for (auto& batch : *loader) {
      opt.zero_grad();
      torch::mse_loss(model->forward(batch.data), batch.target).backward();
      opt.step();
      if (++step == absl::GetFlag(FLAGS_die_after)) std::exit(3);
      if (step % absl::GetFlag(FLAGS_save_every) == 0) manager.save(step, state);
      if (step == absl::GetFlag(FLAGS_steps)) break;
    }
  }
  manager.wait();
  uint64_t hash = fairscale::base::kFnv1a64Basis;  // of this rank's shards, to compare runs
  for (const auto& p : model->parameters()) {
    hash = fairscale::base::Fnv1a64(p.data_ptr(), p.nbytes(), hash);
  }
  std::printf("rank %d step %lld param_hash %016llx\n", rank, (long long)step,
              (unsigned long long)hash);
  return 0;
}
