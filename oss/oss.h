// OSS: FairScale's optimizer state sharding (ZeRO-1) for LibTorch, //oss. Wraps any
// torch::optim optimizer: each rank owns a partition of the parameters, builds the wrapped
// optimizer over that partition only (so it holds 1/N of the optimizer state), steps it, and then
// the ranks exchange the updated parameters. Used directly after a data-parallel gradient
// all-reduce, or with oss::ShardedDataParallel (sharded_data_parallel.h), which reduces each
// gradient to its owner only (ZeRO-2).
//
//   auto opt = fairscale::oss::OSS::make<torch::optim::Adam>(
//       model->parameters(), torch::optim::AdamOptions(1e-3), comm);
//   torch::optim::StepLR sched(*opt, 10, 0.5);   // OSS is a torch::optim::Optimizer
//   loss.backward(); /* all-reduce grads, or ShardedDataParallel */ opt->step(); sched.step();
//
// Partition modes (OssOptions::partition):
// * kGreedy: whole tensors, each to the least-loaded rank, largest first (FairScale assigns in
//   parameter order; sorting first tightens the imbalance to at most the largest tensor). After
//   step every owner broadcasts its parameters, several per broadcast (buckets, at most two in
//   flight, so staging memory stays a few buckets).
// * kFlat: each param group's parameters, flattened and concatenated, are split into N equal
//   contiguous ranges (the last ones shorter by the padding, at most N-1 elements per group); a
//   tensor may straddle ranks. The rank steps views of its ranges, which is exact for elementwise
//   optimizers (SGD, Adam, AdamW, Adagrad, RMSprop: all of LibTorch's except LBFGS). After step
//   one all-gather (bucketed) per group.
// Every rank must construct OSS with the same parameters in the same order, and call step,
// clip_grad_norm, add_param_group, consolidate_state_dict and load together (they are
// collectives).
//
// broadcast_dtype (f16/bf16) halves the exchange: the owner keeps its f32 values exactly (its
// optimizer state and its copy are the master); every other rank receives them rounded to the
// broadcast dtype and back. Replicas then differ from the master by one rounding (relative
// 2^-11 for f16, 2^-8 for bf16) and the rounding does not accumulate, since every step re-sends
// the master values.
//
// Learning rates and other per-group options: OSS's own param_groups() (those the user and LR
// schedulers see) are copied into the wrapped optimizer's groups at every step.
//
// State dicts use torch::optim's own layout: consolidate_state_dict(r) gathers the shards on rank
// r, where save(archive) (so torch::save(oss, path)) writes exactly what the unsharded optimizer
// would write, and consolidated() is that unsharded optimizer. load(archive) (torch::load) reads
// such an archive on any number of ranks, each keeping its own part: a checkpoint saved at 4 ranks
// loads at 2 or 3, and into a plain torch::optim optimizer.
//
// Errors raise c10::Error. A communicator failure carries its absl::Status through
// //base:torch_error, naming the operation and the rank:
//   "oss::OSS::step rank 1/4: UNAVAILABLE: all_gather #12 rank 1/4 [tcp]: peer 3 closed ..."
#pragma once

#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace fairscale::oss {

enum class PartitionMode { kGreedy, kFlat };

struct OssOptions {
  TORCH_ARG(PartitionMode, partition) = PartitionMode::kGreedy;
  // Elements per broadcast / all-gather bucket (per rank for all-gathers).
  TORCH_ARG(int64_t, bucket_numel) = int64_t{1} << 22;
  // f16 or bf16 to compress the parameter exchange; nullopt sends the parameters' own dtype.
  TORCH_ARG(std::optional<c10::ScalarType>, broadcast_dtype) = std::nullopt;
  // Deterministic mode (//deterministic, issue 22): clip_grad_norm computes the 2-norm with an
  // exact, order-independent sum of squares (deterministic::ExactSquareSum), so that it has the
  // same bits at every world size; norm_type inf (a max, already exact) is allowed too, any
  // other norm_type raises. step is unchanged (elementwise on each owner, then the owner's exact
  // values are copied to every rank). Requires broadcast_dtype unset (a rounded copy on the
  // replicas would differ from the single-rank values) and kGreedy (kFlat cuts tensors at
  // world-dependent offsets, which moves elements between LibTorch's vectorized loop body and
  // its scalar tail, whose arithmetic may round differently). Every rank must use the same
  // value: the constructor checks it (one 16-byte all-gather, in both modes) and raises on
  // every rank otherwise. Use it with ShardedDataParallelOptions::deterministic.
  TORCH_ARG(bool, deterministic) = false;
};

// Builds the wrapped optimizer over the given groups (each carries its options).
using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(
    std::vector<torch::optim::OptimizerParamGroup>)>;

// The part [offset, offset + numel) of the flattened `param` that rank `rank` owns (kGreedy: the
// whole tensor). `group` is the param group's index.
struct ParamShard {
  at::Tensor param;
  size_t group = 0;
  int64_t offset = 0;
  int64_t numel = 0;
  int rank = 0;
  int64_t flat_offset = 0;  // kFlat: where the shard starts in the group's flattened parameters
};

class OSS : public torch::optim::Optimizer {
 public:
  OSS(std::vector<torch::optim::OptimizerParamGroup> param_groups, OptimizerFactory factory,
      std::shared_ptr<comm::Communicator> comm, OssOptions options = {});
  OSS(std::vector<at::Tensor> params, OptimizerFactory factory,
      std::shared_ptr<comm::Communicator> comm, OssOptions options = {});

  // OSS::make<torch::optim::Adam>(params_or_groups, AdamOptions(1e-3), comm).
  template <typename Opt, typename Params, typename Options>
  static std::unique_ptr<OSS> make(Params params, Options defaults,
                                   std::shared_ptr<comm::Communicator> comm,
                                   OssOptions options = {}) {
    return std::make_unique<OSS>(
        std::move(params),
        [defaults](std::vector<torch::optim::OptimizerParamGroup> groups) {
          return std::unique_ptr<torch::optim::Optimizer>(
              std::make_unique<Opt>(std::move(groups), defaults));
        },
        std::move(comm), std::move(options));
  }

  // Steps this rank's partition (with the options of param_groups()), then exchanges the updated
  // parameters. A closure is evaluated once, before, on every rank; its loss is returned.
  at::Tensor step(LossClosure closure = nullptr) override;

  // Sets every gradient to zero (LibTorch 1.13's Optimizer::zero_grad semantics).
  void zero_grad();

  // Scales all gradients so that their global `norm_type`-norm (inf allowed) is at most
  // max_norm; returns the norm before clipping. Each rank takes the norm of the gradients of its
  // partition only (with ShardedDataParallel the others are not reduced), one all-reduce
  // combines them: exact, and the same value on every rank. In deterministic mode norm_type
  // must be 2 (exact sum of squares, the same bits at every world size) or inf.
  double clip_grad_norm(double max_norm, double norm_type = 2.0);

  // A check run at the start of step() and clip_grad_norm() with the operation's name ("step",
  // "clip_grad_norm"); it raises to refuse the operation. ShardedDataParallel installs one in
  // deterministic mode (this rank must have run exactly its backward passes of the step).
  // nullptr removes it.
  void set_step_check(std::function<void(const std::string& op)> check) {
    step_check_ = std::move(check);
  }

  // Adds a group (options default to the wrapped optimizer's defaults) and partitions it. Hides
  // the non-virtual Optimizer::add_param_group: call it on OSS, not through a base reference.
  void add_param_group(const torch::optim::OptimizerParamGroup& group);

  // Collective: gathers every rank's optimizer state on `recipient_rank`, which then holds the
  // unsharded optimizer (consolidated(), save()). Other ranks keep nothing.
  void consolidate_state_dict(int recipient_rank = 0);
  // The unsharded optimizer (state keyed by these parameters) after consolidate_state_dict, on the
  // recipient; raises elsewhere.
  torch::optim::Optimizer& consolidated();

  // On the recipient after consolidate_state_dict: the unsharded optimizer's archive.
  void save(torch::serialize::OutputArchive& archive) const override;
  // Collective-free: every rank reads the full archive and keeps its partition's part; the group
  // options become param_groups()' options.
  void load(torch::serialize::InputArchive& archive) override;

  // The partition: every shard of every rank, in group and parameter order.
  const std::vector<ParamShard>& shards() const { return shards_; }
  // The wrapped optimizer of this rank (its params are this rank's tensors or views).
  torch::optim::Optimizer& local_optimizer() { return *local_; }
  // Bytes of the tensors in this rank's optimizer state.
  int64_t local_state_bytes() const;

  const std::shared_ptr<comm::Communicator>& communicator() const { return comm_; }
  const OssOptions& options() const { return options_; }

 private:
  // Appends the shards of param group `g` (already in param_groups_) to shards_.
  void partition_group(size_t g);
  // `rank`'s part of group `g` for a wrapped optimizer, options from param_groups_; appends the
  // shard index of each tensor to `shard_index`. kFlat: views of the parameters (with
  // `for_self`, also recorded in views_).
  torch::optim::OptimizerParamGroup local_group(int rank, size_t g, bool for_self,
                                                std::vector<size_t>* shard_index);
  std::vector<torch::optim::OptimizerParamGroup> local_groups(int rank, bool for_self,
                                                              std::vector<size_t>* shard_index);
  void attach_view_grads();
  void sync_options();
  void exchange_parameters();
  // The default mode's global norm: this rank's part, one all-reduce (sum of |g|^p, or max).
  double norm_of_partition(double norm_type);
  std::string label(const std::string& op) const;
  // Where the small control tensors (norms, sizes, serialized state) travel: the parameters'
  // device, so that GPU-only communicators carry them.
  c10::Device device() const;

  OptimizerFactory factory_;
  std::shared_ptr<comm::Communicator> comm_;
  OssOptions options_;
  std::vector<ParamShard> shards_;
  std::vector<int64_t> load_;  // elements per rank (kGreedy balancing)
  // kFlat: this rank's view for each of its shards (index into shards_).
  std::vector<std::pair<size_t, at::Tensor>> views_;
  std::unique_ptr<torch::optim::Optimizer> local_;
  std::unique_ptr<torch::optim::Optimizer> consolidated_;
  std::function<void(const std::string&)> step_check_;
};

}  // namespace fairscale::oss
