// FSDP in your own code: a small model trained on every rank a launcher starts.
//   fs_launch --nproc_per_node=2 -- bazel-bin/train_fsdp   (or torchrun, mpirun: see README)
#include <torch/torch.h>

#include <cstdio>

#include <cstdlib>
#include <optional>
#include <string>

#include "comm/registry.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "train_state/checkpoint_manager.h"
#include "train_state/fsdp_item.h"
#include "train_state/items.h"

struct NetImpl : torch::nn::Module {
  torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(16, 64))};
  torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(64, 1))};
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
};
TORCH_MODULE(Net);

int main() {
  // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the launcher; the network is the linked
  // backend (@fairscale_cpp//comm/tcp).
  auto comm = fairscale::comm::CreateCommunicatorFromEnv();
  if (!comm.ok()) return std::fprintf(stderr, "%s\n", comm.status().ToString().c_str()), 1;
  torch::manual_seed(0);  // the same initial model on every rank
  fairscale::fsdp::FullyShardedDataParallel model(Net(), *comm);  // FULL_SHARD by default
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  // The model, its optimizer and the step, checkpointed every 50 steps under $CKPT_DIR (if set)
  // in the background; a run started again resumes from the newest checkpoint.
  namespace ts = fairscale::train_state;
  int step = 0;
  ts::TrainState state;
  state.add("model", ts::fsdp_item(model, &opt))
      .add("step", ts::json_item([&] { return nlohmann::json(step); },
                                 [&](const nlohmann::json& j) { step = j.get<int>(); }));
  const char* ckpt = std::getenv("CKPT_DIR");
  std::optional<ts::CheckpointManager> manager;
  if (ckpt != nullptr) {
    manager.emplace(*comm, ts::CheckpointManagerOptions(ckpt).async(true));
    if (manager->restore(state) && (*comm)->rank() == 0) std::printf("resumed at step %d\n", step);
  }
  torch::manual_seed(1 + (*comm)->rank() + 1000 * step);  // each rank its own data
  const torch::Tensor w = torch::linspace(-0.5, 0.5, 16).unsqueeze(1);
  while (++step <= 100) {
    const torch::Tensor x = torch::randn({32, 16});
    torch::Tensor loss = torch::mse_loss(model(x), torch::tanh(x.matmul(w)));
    opt.zero_grad();
    loss.backward();  // gradients reduce-scattered into this rank's shards
    opt.step();
    if ((*comm)->rank() == 0 && (step == 1 || step % 25 == 0)) {
      std::printf("step %d loss %.4f\n", step, loss.item<float>());
    }
    if (manager && step % 50 == 0) manager->save(step, state);
  }
  if (manager) manager->wait();
}
