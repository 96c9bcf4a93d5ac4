// FSDP in your own code: a small model trained on every rank a launcher starts.
//   fs_launch --nproc_per_node=2 -- bazel-bin/train_fsdp   (or torchrun, mpirun: see README)
#include <torch/torch.h>

#include <cstdio>

#include "comm/registry.h"
#include "fsdp/fully_sharded_data_parallel.h"

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
  torch::manual_seed(1 + (*comm)->rank());  // each rank its own data
  const torch::Tensor w = torch::linspace(-0.5, 0.5, 16).unsqueeze(1);
  for (int step = 1; step <= 100; ++step) {
    const torch::Tensor x = torch::randn({32, 16});
    torch::Tensor loss = torch::mse_loss(model(x), torch::tanh(x.matmul(w)));
    opt.zero_grad();
    loss.backward();  // gradients reduce-scattered into this rank's shards
    opt.step();
    if ((*comm)->rank() == 0 && (step == 1 || step % 25 == 0)) {
      std::printf("step %d loss %.4f\n", step, loss.item<float>());
    }
  }
}
