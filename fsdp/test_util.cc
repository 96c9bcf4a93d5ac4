#include "fsdp/test_util.h"

#include <ATen/ops/zeros.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/tensor_close.h"

namespace fairscale::fsdp::testing {

Net NestedNet(std::shared_ptr<comm::Communicator> nested_comm, FsdpOptions nested_options,
              NetConfig config) {
  if (nested_comm) {
    config.wrap_block = [nested_comm, nested_options](Block block) {
      FullyShardedDataParallel unit(block, nested_comm, nested_options);
      return fairscale::testing::WrappedBlock{unit.ptr(),
                                              [unit](torch::Tensor x) mutable { return unit(x); }};
    };
  }
  return Net(std::move(config));
}

std::vector<ReferenceStep> RunReference(OptimizerKind kind, int steps) {
  Net net;
  auto opt = MakeOptimizer(kind, DistinctParameters(*net));
  std::vector<ReferenceStep> out;
  for (int step = 0; step < steps; ++step) {
    opt->zero_grad();
    Batch b = GlobalBatch(step);
    ReferenceStep r;
    at::Tensor output = net(b.x);
    Mse(output, b.y).backward();
    r.output = output.detach();
    for (const auto& item : net->named_parameters()) {
      r.grads[item.key()] = item.value().grad().clone();
    }
    opt->step();
    for (const auto& item : net->named_parameters()) {
      r.params[item.key()] = item.value().detach().clone();
    }
    out.push_back(std::move(r));
  }
  return out;
}

at::Tensor ShardOf(const FlatParamInfo& info, const std::map<std::string, at::Tensor>& named) {
  at::Tensor flat = at::zeros({info.padded_numel});
  for (const FlatParamInfo::Entry& e : info.params) {
    auto it = named.find(e.name);
    TORCH_CHECK(it != named.end(), "no reference tensor named '", e.name, "'");
    flat.narrow(0, e.offset, e.numel).copy_(it->second.reshape({-1}));
  }
  return flat.narrow(0, info.shard_offset, info.shard_numel);
}

absl::Status CheckShards(FullyShardedDataParallel& model,
                         const std::map<std::string, at::Tensor>& expected, bool grads,
                         const std::string& what, double rtol) {
  for (FullyShardedDataParallelImpl* unit : model->fsdp_units()) {
    const auto params = unit->named_parameters(/*recurse=*/false);
    for (const FlatParamInfo& info : unit->flat_param_info()) {
      if (grads && !info.requires_grad) continue;
      const at::Tensor& shard = params[info.name];
      at::Tensor actual = grads ? shard.grad() : shard.detach();
      if (grads && !actual.defined()) actual = at::zeros_like(shard);
      absl::Status s =
          ExpectClose(absl::StrCat(what, " of unit '", unit->prefix(), "' ", info.name), actual,
                      ShardOf(info, expected), rtol);
      if (!s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

absl::Status TrainMatchesReference(FullyShardedDataParallel& model, torch::optim::Optimizer& opt,
                                   const std::vector<ReferenceStep>& ref, int rank, int world,
                                   double rtol) {
  for (size_t step = 0; step < ref.size(); ++step) {
    const std::string at_step = absl::StrCat("step ", step, " rank ", rank, "/", world);
    opt.zero_grad();
    const Batch b = GlobalBatch(static_cast<int>(step));
    const at::Tensor y = RankRows(b.y, rank, world);
    at::Tensor loss = Mse(model(RankRows(b.x, rank, world)), y);
    absl::Status s =
        ExpectClose(at_step + " loss", loss, Mse(RankRows(ref[step].output, rank, world), y), rtol);
    if (!s.ok()) return s;
    loss.backward();
    s = CheckShards(model, ref[step].grads, /*grads=*/true, at_step + " grad", rtol);
    if (!s.ok()) return s;
    opt.step();
    s = CheckShards(model, ref[step].params, /*grads=*/false, at_step + " param", rtol);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ExpectClose(const std::string& what, const at::Tensor& actual,
                         const at::Tensor& expected, double rtol) {
  return base::ExpectTensorClose(what, actual, expected, rtol);
}

}  // namespace fairscale::fsdp::testing
