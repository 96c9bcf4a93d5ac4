// FsdpOptions::ignored_modules against single-process references computed in the same test: a model
// with a dense part and a rank-local "expert" (expert parallelism: every rank holds a different
// expert, of a different shape, with a different buffer). The dense parameters train as plain data
// parallel over the mean of the ranks' losses; each rank's expert keeps its own values (also with
// sync_module_states), gets the plain autograd gradient of its rank's loss (not averaged, not
// divided) and is stepped by the caller's own optimizer; the expert is in none of the wrapper's
// parameters(), state dicts or buffers. Flat and per-parameter layouts, full_shard / no_shard /
// hybrid, world sizes 1-4, auto-wrap with the expert inside a wrapped child unit, and the
// construction errors.
#include <ATen/ops/tanh.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/sharded_checkpoint.h"
#include "fsdp/state_dict.h"
#include "fsdp/test_util.h"
#include "fsdp/wrap.h"
#include "gtest/gtest.h"
#include "testing/c10_error.h"
#include "testing/tmp.h"

namespace fairscale::fsdp {
namespace {

using comm::testing::ExpectAllOk;
using comm::testing::RunInprocRanks;
using fairscale::testing::CatchErrors;
using fairscale::testing::ExpectError;
using testing::ExpectClose;

constexpr int kIn = 4;
constexpr int kHidden = 6;
constexpr int kOut = 2;
constexpr int kRowsPerRank = 3;
constexpr int kSteps = 3;
// Relative tolerance against the reference (f32). Measured: at most 1.1e-9 (HYBRID_SHARD at world
// 4, the dense parameters); bitwise equal elsewhere.
constexpr double kRtol = 1e-7;

// Fixed values (inproc thread ranks share torch's global RNG, so none is drawn from it).
void Fill(torch::nn::Module& m, double salt) {
  torch::NoGradGuard no_grad;
  int k = 0;
  for (auto& item : m.named_parameters()) {
    at::Tensor& p = item.value();
    const at::Tensor v = at::arange(p.numel(), at::kDouble).mul(0.91).add(1.3 * ++k + salt).sin();
    p.copy_(v.mul(0.4).view(p.sizes()));
  }
}

// The rank-local expert: its hidden width, its values and its buffer depend on the rank.
class ExpertImpl : public torch::nn::Module {
 public:
  explicit ExpertImpl(int rank)
      : fc1(register_module("fc1", torch::nn::Linear(kHidden, 3 + rank))),
        fc2(register_module("fc2", torch::nn::Linear(3 + rank, kHidden))),
        scale(register_buffer("scale", at::full({1}, 1.0 + 0.25 * rank))) {
    Fill(*this, 10.0 * (rank + 1));
  }
  at::Tensor forward(at::Tensor x) { return fc2(at::tanh(fc1(x))) * scale; }
  torch::nn::Linear fc1, fc2;
  at::Tensor scale;
};
TORCH_MODULE(Expert);

// A block holding the expert: the candidate for fsdp::wrap (module_type_auto_wrap_policy).
class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(Expert e)
      : fc(register_module("fc", torch::nn::Linear(kHidden, kHidden))),
        expert(register_module("expert", std::move(e))) {
    Fill(*fc, 1.0);
  }
  at::Tensor forward(at::Tensor x) { return x + expert(at::tanh(fc(x))); }
  torch::nn::Linear fc;
  Expert expert;
};
TORCH_MODULE(Block);

// dense -> block (fc + expert) -> head. The block goes through fsdp::wrap (plain outside an
// EnableWrap scope). The expert is made first and passed in, so that the caller holds it before the
// model (and its wrapped units) are built.
class MoeNetImpl : public torch::nn::Module {
 public:
  explicit MoeNetImpl(Expert e)
      : dense(register_module("dense", torch::nn::Linear(kIn, kHidden))),
        head(register_module("head", torch::nn::Linear(kHidden, kOut))) {
    Fill(*dense, 2.0);
    Fill(*head, 3.0);
    block = fsdp::wrap(Block(std::move(e)));
    register_module("block", block.ptr());
  }
  at::Tensor forward(at::Tensor x) { return head(block(at::tanh(dense(x)))); }
  torch::nn::Linear dense, head;
  Wrapped block;
};
TORCH_MODULE(MoeNet);

// The dense parameters by their unwrapped names (a wrapped block lists its flat parameters).
std::map<std::string, at::Tensor> DenseParams(MoeNetImpl& net) {
  const auto& block = net.block.is_wrapped() ? net.block.unit()->module() : net.block.ptr();
  std::map<std::string, at::Tensor> out;
  for (const auto& [prefix, m] : std::vector<std::pair<std::string, torch::nn::Module*>>{
           {"dense.", net.dense.get()},
           {"head.", net.head.get()},
           {"block.fc.", block->as<BlockImpl>()->fc.get()}}) {
    for (const auto& item : m->named_parameters()) out[prefix + item.key()] = item.value();
  }
  return out;
}

at::Tensor Rows(int step, int rank, int cols, double salt) {
  return at::arange(kRowsPerRank * cols, at::kFloat)
      .mul(0.37)
      .add(salt + 1.1 * step + 2.3 * rank)
      .sin()
      .view({kRowsPerRank, cols});
}
at::Tensor Input(int step, int rank) { return Rows(step, rank, kIn, 0.0); }
at::Tensor Target(int step, int rank) { return Rows(step, rank, kOut, 5.0); }
at::Tensor Loss(const at::Tensor& out, int step, int rank) {
  return (out - Target(step, rank)).pow(2).mean();
}

bool IsExpertName(const std::string& name) { return name.find("expert") != std::string::npos; }

// The single-process reference: one copy of the model per rank (same dense values, that rank's
// expert); the dense parameters are stepped by one Adam with the mean of the copies' gradients
// (what FSDP's reduction gives), each expert by its own Adam with its copy's own gradient.
struct Reference {
  // [step][name] dense parameters after the step.
  std::vector<std::map<std::string, at::Tensor>> dense;
  // [step][rank][name] expert gradients (before the step) and parameters (after it).
  std::vector<std::vector<std::map<std::string, at::Tensor>>> expert_grads, expert_params;
};

Reference RunReference(int world) {
  std::vector<MoeNet> nets;
  for (int r = 0; r < world; ++r) nets.emplace_back(Expert(r));
  std::vector<at::Tensor> dense0;
  for (auto& item : nets[0]->named_parameters()) {
    if (!IsExpertName(item.key())) dense0.push_back(item.value());
  }
  torch::optim::Adam dense_opt(dense0, torch::optim::AdamOptions(1e-2));
  std::vector<std::unique_ptr<torch::optim::Adam>> expert_opts;
  for (int r = 0; r < world; ++r) {
    expert_opts.push_back(std::make_unique<torch::optim::Adam>(
        nets[r]->block.ptr()->as<BlockImpl>()->expert->parameters(),
        torch::optim::AdamOptions(1e-2)));
  }
  Reference ref;
  for (int step = 0; step < kSteps; ++step) {
    for (auto& n : nets) n->zero_grad();
    for (int r = 0; r < world; ++r) Loss(nets[r](Input(step, r)), step, r).backward();
    std::vector<std::map<std::string, at::Tensor>> grads(world);
    for (int r = 0; r < world; ++r) {
      for (auto& item : nets[r]->named_parameters()) {
        if (IsExpertName(item.key())) grads[r][item.key()] = item.value().grad().clone();
      }
    }
    {  // the dense gradient: the mean over the ranks' copies, into copy 0
      torch::NoGradGuard no_grad;
      for (auto& item : nets[0]->named_parameters()) {
        if (IsExpertName(item.key())) continue;
        at::Tensor sum = item.value().grad().clone();
        for (int r = 1; r < world; ++r) sum += nets[r]->named_parameters()[item.key()].grad();
        item.value().mutable_grad() = sum / world;
      }
    }
    dense_opt.step();
    for (auto& o : expert_opts) o->step();
    std::map<std::string, at::Tensor> dense;
    {
      torch::NoGradGuard no_grad;
      for (auto& item : nets[0]->named_parameters()) {
        if (IsExpertName(item.key())) continue;
        dense[item.key()] = item.value().detach().clone();
        for (int r = 1; r < world; ++r) nets[r]->named_parameters()[item.key()].copy_(item.value());
      }
    }
    std::vector<std::map<std::string, at::Tensor>> params(world);
    for (int r = 0; r < world; ++r) {
      for (auto& item : nets[r]->named_parameters()) {
        if (IsExpertName(item.key())) params[r][item.key()] = item.value().detach().clone();
      }
    }
    ref.dense.push_back(std::move(dense));
    ref.expert_grads.push_back(std::move(grads));
    ref.expert_params.push_back(std::move(params));
  }
  return ref;
}

struct Case {
  FsdpOptions options;
  bool auto_wrap = false;
};

absl::Status RunRank(const Case& c, const Reference& ref, const std::string& dir, int rank,
                     int world, std::shared_ptr<comm::Communicator> comm) {
  const std::string where = absl::StrCat("rank ", rank, "/", world);
  Expert expert(rank);
  FsdpOptions options = c.options;
  options.ignored_modules({expert.ptr()});
  MoeNet net{nullptr};
  if (c.auto_wrap) {
    EnableWrap scope(comm, options, module_type_auto_wrap_policy<BlockImpl>());
    net = MoeNet(expert);
  } else {
    net = MoeNet(expert);
  }
  if (c.auto_wrap != net->block.is_wrapped()) return absl::InternalError("wrap() policy");
  FullyShardedDataParallel model(net, comm, options);

  // (c) the expert keeps this rank's values and buffer (no broadcast, no check across ranks).
  const Expert fresh(rank);
  for (auto& item : expert->named_parameters()) {
    FS_RETURN_IF_ERROR(ExpectClose(where + " initial " + item.key(), item.value(),
                                   fresh->named_parameters()[item.key()], 0.0));
  }
  FS_RETURN_IF_ERROR(ExpectClose(where + " scale", expert->scale, fresh->scale, 0.0));

  // (e) the wrapper's parameters() leave the expert out; ignored_parameters() lists it.
  std::set<const c10::TensorImpl*> expert_params;
  for (const at::Tensor& p : expert->parameters()) expert_params.insert(p.unsafeGetTensorImpl());
  for (const at::Tensor& p : model->parameters()) {
    if (expert_params.count(p.unsafeGetTensorImpl())) {
      return absl::InternalError(where + ": an expert parameter is in model->parameters()");
    }
  }
  for (const auto& item : model->named_buffers()) {
    if (IsExpertName(item.key())) return absl::InternalError(where + ": " + item.key());
  }
  const std::vector<at::Tensor> ignored = model->ignored_parameters();
  std::set<const c10::TensorImpl*> listed;
  for (const at::Tensor& p : ignored) listed.insert(p.unsafeGetTensorImpl());
  if (listed != expert_params || ignored.size() != expert_params.size()) {
    return absl::InternalError(where + ": ignored_parameters() is not the expert's parameters");
  }

  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam expert_opt(ignored, torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < kSteps; ++step) {
    const std::string at_step = absl::StrCat(where, " step ", step);
    opt.zero_grad();
    expert_opt.zero_grad();
    Loss(model(Input(step, rank)), step, rank).backward();
    // (b) the expert's gradient is plain autograd's for this rank's loss.
    for (auto& item : expert->named_parameters()) {
      const std::string name = "block.expert." + item.key();
      FS_RETURN_IF_ERROR(ExpectClose(at_step + " grad " + name, item.value().grad(),
                                     ref.expert_grads[step][rank].at(name), kRtol));
    }
    opt.step();
    expert_opt.step();
    // (a) dense parity with the reference; the expert as stepped by the reference's own Adam.
    {
      auto full = model->summon_full_params(/*writeback=*/false);
      for (const auto& [name, value] : DenseParams(*net)) {
        FS_RETURN_IF_ERROR(
            ExpectClose(at_step + " param " + name, value, ref.dense[step].at(name), kRtol));
      }
    }
    for (auto& item : expert->named_parameters()) {
      const std::string name = "block.expert." + item.key();
      FS_RETURN_IF_ERROR(ExpectClose(at_step + " param " + name, item.value(),
                                     ref.expert_params[step][rank].at(name), kRtol));
    }
  }

  // (d) the state dicts leave the expert out, and load back without it.
  const StateDict sd = full_state_dict(model);
  for (const auto& item : sd) {
    if (IsExpertName(item.key())) return absl::InternalError(where + ": state dict " + item.key());
  }
  if (sd.size() != 6) return absl::InternalError(absl::StrCat(where, ": ", sd.size(), " keys"));
  const LocalStateDict local = model->local_state_dict();
  for (const auto& b : local.buffers) {
    if (IsExpertName(b.first)) return absl::InternalError(where + ": local buffer " + b.first);
  }
  for (const auto& s : local.shards) {
    for (const auto& e : s.info.params) {
      if (IsExpertName(e.name)) return absl::InternalError(where + ": local shard " + e.name);
    }
  }
  const at::Tensor before = expert->fc1->weight.detach().clone();
  load_full_state_dict(model, sd);
  model->load_local_state_dict(local);
  FS_RETURN_IF_ERROR(ExpectClose(where + " expert after load", expert->fc1->weight, before, 0.0));
  const FullOptimState osd = full_optim_state_dict(model, opt);
  for (const auto& item : osd.state) {
    if (IsExpertName(item.first)) return absl::InternalError(where + ": optim " + item.first);
  }
  save_sharded_checkpoint(model, &opt, dir);
  load_sharded_checkpoint(model, &opt, dir);
  FS_RETURN_IF_ERROR(ExpectClose(where + " expert after load", expert->fc1->weight, before, 0.0));
  if (rank == 0) {
    FS_ASSIGN_OR_RETURN(ConsolidatedCheckpoint cc, consolidate_sharded_checkpoint(dir));
    if (cc.state_dict.size() != 6) return absl::InternalError(where + ": sharded checkpoint keys");
    for (const auto& item : cc.optimizer.state) {
      if (IsExpertName(item.first))
        return absl::InternalError(where + ": checkpoint " + item.first);
    }
  }
  return absl::OkStatus();
}

void RunCase(const Case& c, int world) {
  SCOPED_TRACE(absl::StrCat("world ", world));
  const Reference ref = RunReference(world);
  const std::string dir = fairscale::testing::UniqueTmpPath("ignored_modules");
  ExpectAllOk(
      RunInprocRanks(world,
                     [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) {
                       return CatchErrors([&] { return RunRank(c, ref, dir, rank, w, comm); });
                     }),
      "ignored_modules");
}

FsdpOptions Options(ShardingStrategy strategy, bool flat) {
  return FsdpOptions().sharding_strategy(strategy).flatten_parameters(flat).sync_module_states(
      true);
}

TEST(IgnoredModulesTest, FullShardFlat) {
  for (int world : {1, 2, 3}) RunCase({Options(ShardingStrategy::kFullShard, true)}, world);
}

TEST(IgnoredModulesTest, FullShardPerParameter) {
  for (int world : {1, 2, 3}) RunCase({Options(ShardingStrategy::kFullShard, false)}, world);
}

// Without sync_module_states the construction check compares the dense parameters only: the experts
// differ in shape and value across ranks.
TEST(IgnoredModulesTest, ShardGradOpWithoutSyncModuleStates) {
  RunCase({Options(ShardingStrategy::kShardGradOp, true).sync_module_states(false)}, 3);
}

TEST(IgnoredModulesTest, NoShard) {
  for (int world : {2, 3}) {
    RunCase({Options(ShardingStrategy::kNoShard, true)}, world);
    RunCase({Options(ShardingStrategy::kNoShard, false)}, world);
  }
}

TEST(IgnoredModulesTest, HybridShard) {
  RunCase({Options(ShardingStrategy::kHybridShard, true).hybrid_shard_group_size(2)}, 4);
  RunCase({Options(ShardingStrategy::kHybridShard, false).hybrid_shard_group_size(2)}, 4);
}

// The expert sits inside a block that EnableWrap's policy wraps in its own unit: wrap() hands that
// unit the ignored expert, and the root accepts it there.
TEST(IgnoredModulesTest, AutoWrapIgnoredInsideWrappedChild) {
  for (int world : {2, 3}) {
    RunCase({Options(ShardingStrategy::kFullShard, true), /*auto_wrap=*/true}, world);
    RunCase({Options(ShardingStrategy::kFullShard, false), /*auto_wrap=*/true}, world);
  }
}

TEST(IgnoredModulesTest, RejectsBadInput) {
  ExpectAllOk(
      RunInprocRanks(
          1,
          [](int, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
            auto make = [&](FsdpOptions o, MoeNet net) {
              FullyShardedDataParallel model(net, comm, o);
            };
            // Not a submodule of the wrapped module.
            FS_RETURN_IF_ERROR(ExpectError(
                [&] { make(FsdpOptions().ignored_modules({Expert(0).ptr()}), MoeNet(Expert(0))); },
                {"ignored_modules[0]", "Expert", "is not a submodule of the wrapped module"}));
            FS_RETURN_IF_ERROR(ExpectError(
                [&] {
                  MoeNet net(Expert(0));
                  make(FsdpOptions().ignored_modules({net->dense.ptr(), Expert(0).ptr()}), net);
                },
                {"ignored_modules[1]", "is not a submodule"}));
            // The root module itself.
            FS_RETURN_IF_ERROR(ExpectError(
                [&] {
                  MoeNet net(Expert(0));
                  make(FsdpOptions().ignored_modules({net.ptr()}), net);
                },
                {"ignored_modules[0]", "MoeNet", "is the wrapped module itself"}));
            FS_RETURN_IF_ERROR(ExpectError(
                [&] { make(FsdpOptions().ignored_modules({nullptr}), MoeNet(Expert(0))); },
                {"ignored_modules[0] is null"}));
            // Inside a nested unit that does not ignore it (its scope was not told).
            FS_RETURN_IF_ERROR(ExpectError(
                [&] {
                  Expert expert(0);
                  MoeNet net{nullptr};
                  {
                    EnableWrap scope(comm, FsdpOptions(),
                                     module_type_auto_wrap_policy<BlockImpl>());
                    net = MoeNet(expert);
                  }
                  make(FsdpOptions().ignored_modules({expert.ptr()}), net);
                },
                {"ignored_modules[0]", "block.expert", "does not ignore it"}));
            // The module a nested unit wraps.
            FS_RETURN_IF_ERROR(ExpectError(
                [&] {
                  MoeNet net{nullptr};
                  {
                    EnableWrap scope(comm, FsdpOptions(),
                                     module_type_auto_wrap_policy<BlockImpl>());
                    net = MoeNet(Expert(0));
                  }
                  make(FsdpOptions().ignored_modules({net->block.unit()->module()}), net);
                },
                {"ignored_modules[0]", "'block'", "nested FullyShardedDataParallel unit"}));
            // wrap() never wraps an ignored module: the block stays plain.
            Block block(Expert(0));
            Wrapped w;
            {
              EnableWrap scope(comm, FsdpOptions().ignored_modules({block.ptr()}));
              w = wrap(block);
            }
            if (w.is_wrapped()) return absl::InternalError("wrap() wrapped an ignored module");
            return absl::OkStatus();
          }),
      "errors");
}

}  // namespace
}  // namespace fairscale::fsdp
