// OSS + ShardedDataParallel (ZeRO-2) in your own code: Adam's state and the gradients sharded
// over the ranks a launcher starts, the model replicated.
//   fs_launch --nproc_per_node=2 -- bazel-bin/train_oss
#include <torch/torch.h>

#include <cstdio>
#include <memory>

#include "comm/registry.h"
#include "oss/oss.h"
#include "oss/sharded_data_parallel.h"

namespace oss = fairscale::oss;

struct NetImpl : torch::nn::Module {
  torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(16, 64))};
  torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(64, 1))};
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::tanh(fc1(x))); }
};
TORCH_MODULE(Net);

int main() {
  auto comm = fairscale::comm::CreateCommunicatorFromEnv();
  if (!comm.ok()) return std::fprintf(stderr, "%s\n", comm.status().ToString().c_str()), 1;
  torch::manual_seed(0);  // the same initial model on every rank
  Net net;
  std::shared_ptr<oss::OSS> opt =
      oss::OSS::make<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(1e-2), *comm);
  oss::ShardedDataParallel model(torch::nn::AnyModule(net), opt);
  torch::manual_seed(1 + (*comm)->rank());  // each rank its own data
  const torch::Tensor w = torch::linspace(-0.5, 0.5, 16).unsqueeze(1);
  for (int step = 1; step <= 100; ++step) {
    const torch::Tensor x = torch::randn({32, 16});
    torch::Tensor loss = torch::mse_loss(model->forward(x), torch::tanh(x.matmul(w)));
    opt->zero_grad();
    loss.backward();  // each gradient reduced to the rank that owns its parameter
    opt->step();      // each rank steps its partition, then the parameters are exchanged
    if ((*comm)->rank() == 0 && (step == 1 || step % 25 == 0)) {
      std::printf("step %d loss %.4f\n", step, loss.item<float>());
    }
  }
}
