// ShardedDataParallel: FairScale's ZeRO-2 data parallelism for LibTorch, //oss. Wraps a module
// trained with an oss::OSS optimizer: during backward every gradient is reduced (sum, then divided
// by the number of ranks) to the rank that owns its parameter in the OSS partition only, not
// all-reduced, so that after backward each rank holds the reduced gradients of its partition and
// no gradient at all for parameters it does not own (the memory ZeRO-2 saves).
//
//   auto opt = std::make_shared<fairscale::oss::OSS>(model->parameters(), factory, comm);
//   fairscale::oss::ShardedDataParallel ddp(torch::nn::AnyModule(model), opt);
//   auto loss = loss_fn(ddp->forward(x), y); loss.backward(); opt->step(); opt->zero_grad();
//
// How it hooks into LibTorch (which has no module hooks): a post hook on each trainable
// parameter's AccumulateGrad node marks its gradient ready. Gradients are packed into buckets per
// owner (reduce_bucket_numel elements, in reverse parameter order, the usual backward order); a
// bucket's Reduce is issued as soon as it and every bucket before it are ready, so communication
// overlaps the rest of backward and every rank issues the same reduces in the same order whatever
// order its hooks fire in. A non-owner drops a gradient it owns nothing of as soon as its bucket
// is packed, and a bucket buffer once its reduce is done. A callback queued on the autograd engine
// waits for the rest at the end of backward (a parameter unused in this backward counts as a zero
// gradient), then writes the owner's gradients and frees the others. With kFlat a parameter may be
// split between ranks: each owner gets its range, and the rest of that gradient is zero.
//
// Every rank must call forward and backward the same number of times. One synchronised backward
// per optimizer step; backwards inside a no_sync() guard only accumulate locally (gradient
// accumulation) and the next synchronised backward reduces the sum. If requires_grad flags change,
// forward notices and re-hooks (refresh_trainable); all ranks must change them alike.
//
// Deterministic mode (ShardedDataParallelOptions::deterministic, issue 22): the same global batch
// gives bitwise the same losses, gradients and parameters at every world size that divides the
// micro-batch count. A step's global batch is cut into micro_batches (M) micro-batches of a
// fixed size; rank r of W computes [r*M/W, (r+1)*M/W) in order, one forward and backward per
// micro-batch on that micro-batch's own loss (not divided by anything). Each backward's
// gradients are taken before autograd accumulates them (.grad is left alone) and added into a
// per-bucket deterministic::Accumulator; after this rank's M/W-th backward each bucket's
// partial sums go to its owner (deterministic::Gather), which evaluates the canonical tree
// (Total) and divides by M into .grad, replacing what .grad held (a gradient left from before
// the step is not added to it). The other ranks end as in the default mode. OSS::step and
// OSS::clip_grad_norm raise unless this rank ran exactly M/W backward passes since the last
// step. See oss/README.md for the loop and its cost.
//
// Local gradients (local_grad_hook.h): register_local_grad_hook observes, at the end of every
// backward (also under no_sync() and in deterministic mode), each trainable parameter's squared
// norm of this rank's own gradient of that backward, taken before any reduction; statistics such
// as AdaScale's gradient variance (//adascale:oss) need it because a synchronised backward leaves
// each rank only the reduced gradients it owns.
//
// Errors raise c10::Error; a failed reduce carries the communicator's absl::Status
// ("oss::ShardedDataParallel::reduce rank 1/4: DEADLINE_EXCEEDED: ...", //base:torch_error).
#pragma once

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "deterministic/tree.h"
#include "oss/local_grad_hook.h"
#include "oss/oss.h"

namespace torch::autograd {
struct Node;
struct FunctionPreHook;
}  // namespace torch::autograd

namespace fairscale::oss {

struct ShardedDataParallelOptions {
  // Broadcast the module's buffers from rank 0 before every forward.
  TORCH_ARG(bool, broadcast_buffers) = true;
  // Broadcast parameters and buffers from rank 0 at construction.
  TORCH_ARG(bool, sync_models_at_startup) = true;
  // Elements per reduce bucket; 0 reduces each parameter (or kFlat range) on its own.
  TORCH_ARG(int64_t, reduce_bucket_numel) = int64_t{1} << 23;
  // Deterministic mode (see above). Requires micro_batches >= 1 divisible by the world size (the
  // constructor raises naming the world sizes that divide it), an OSS built with
  // OssOptions().deterministic(true), at::set_num_threads(1), and the same setting on every rank
  // (checked at construction with one 16-byte all-gather, in both modes; a mismatch raises on
  // every rank). no_sync() and reduce() raise in this mode: it accumulates and reduces by itself.
  TORCH_ARG(bool, deterministic) = false;
  // Micro-batches per optimizer step, all ranks together (deterministic mode only; ignored
  // otherwise).
  TORCH_ARG(int64_t, micro_batches) = 0;
};

class ShardedDataParallelImpl : public torch::nn::Module {
 public:
  ShardedDataParallelImpl(torch::nn::AnyModule module, std::shared_ptr<OSS> optimizer,
                          ShardedDataParallelOptions options = {});
  ~ShardedDataParallelImpl() override;

  // Calls the wrapped module's forward (argument types must match its signature exactly).
  template <typename ReturnType = at::Tensor, typename... Args>
  ReturnType forward(Args&&... args) {
    pre_forward();
    return module_.forward<ReturnType>(std::forward<Args>(args)...);
  }

  // While alive, backward passes do not reduce (gradients accumulate locally).
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(ShardedDataParallelImpl* owner) : owner_(owner) {
      previous_ = owner_->sync_;
      owner_->sync_ = false;
    }
    ~NoSyncGuard() { owner_->sync_ = previous_; }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    ShardedDataParallelImpl* owner_;
    bool previous_ = true;
  };
  // Raises in deterministic mode (which accumulates micro-batches by itself).
  NoSyncGuard no_sync();

  // Reduces the current gradients now (e.g. after backwards that all ran under no_sync). Raises
  // in deterministic mode.
  void reduce();
  // Broadcasts the buffers from rank 0.
  void sync_buffers();
  // Re-hooks the parameters that require grad now (forward does it when the flags changed).
  void refresh_trainable();

  // Observes each rank's own gradients before any reduction (see local_grad_hook.h): at the end
  // of every backward pass, one f64 squared norm per trainable parameter. One hook per module
  // (a second registration raises; remove_local_grad_hook() first); not during backward. While
  // registered it costs one f64 sum of squares per parameter gradient per backward and one
  // .item() per parameter at its end.
  void register_local_grad_hook(LocalGradHook hook);
  void remove_local_grad_hook();
  bool has_local_grad_hook() const { return static_cast<bool>(local_grad_hook_); }

  torch::nn::Module& module() { return *module_.ptr(); }
  OSS& optimizer() { return *optimizer_; }
  const ShardedDataParallelOptions& options() const { return options_; }
  int64_t bucket_count() const { return static_cast<int64_t>(buckets_.size()); }

  // Called by the AccumulateGrad post hook of trainable parameter `index` with the gradient
  // the node received in this backward.
  void on_grad_ready(size_t index, const at::Tensor& incoming);
  // Deterministic mode: called by the AccumulateGrad pre hook of trainable parameter `index`
  // with this backward's gradient (which autograd then does not accumulate).
  void on_grad_captured(size_t index, const at::Tensor& grad);

  // Deterministic mode: the micro-batches of the step and this rank's share of them.
  const deterministic::MicroBatchLayout& layout() const { return layout_; }
  // Deterministic mode: backward passes run since this rank's last reduction.
  int64_t micro_batches_done() const { return done_; }

 private:
  struct Bucket {
    int owner = 0;
    std::vector<size_t> shards;  // indices into optimizer_->shards()
    int64_t numel = 0;
    size_t ready = 0;
    bool issued = false;
    at::Tensor buffer;
    comm::Work work;
    deterministic::Accumulator partials;  // deterministic mode: this step's micro-batches
  };
  struct Hooked {
    at::Tensor param;
    std::shared_ptr<torch::autograd::Node> accumulator;
    uintptr_t key = 0;
    std::vector<size_t> buckets;  // one entry per shard of the parameter
    bool ready = false;
    torch::autograd::FunctionPreHook* pre_hook = nullptr;  // deterministic mode, owned by the node
    at::Tensor captured;  // deterministic mode: this backward's gradient
    at::Tensor local_sqr;  // with a local gradient hook: this backward's |gradient|^2, f64 0-dim
  };

  void pre_forward();
  void unhook();
  void issue_ready();
  void issue(Bucket& bucket);
  void finalize();
  // The engine's final callback of a backward whose hooks fired: reduces when it synchronises,
  // then reports to the local gradient hook.
  void end_backward();
  // Hands this backward's local squares to the local gradient hook and clears them.
  void report_local_grads();
  // Copies the owners' reduced buckets (buffer) into .grad and frees or zeroes the rest.
  void install_reduced();
  // Deterministic mode: files this backward's gradients as the next micro-batch; after the
  // M/W-th, reduces.
  void finish_micro_batch();
  void reduce_deterministic();
  void check_step(const std::string& op);
  std::string label(const std::string& op) const;

  torch::nn::AnyModule module_;
  std::shared_ptr<OSS> optimizer_;
  std::shared_ptr<comm::Communicator> comm_;
  ShardedDataParallelOptions options_;
  std::vector<Bucket> buckets_;
  std::vector<Hooked> hooked_;
  std::map<const void*, size_t> hooked_index_;  // parameter -> index in hooked_
  std::set<const void*> owned_;  // parameters with at least one range on this rank
  std::vector<bool> trainable_;  // requires_grad of every shard's parameter at the last refresh
  size_t next_bucket_ = 0;
  bool sync_ = true;
  bool backward_active_ = false;
  bool backward_syncs_ = false;  // the running backward reduces (sync_ when it began)
  LocalGradHook local_grad_hook_;
  // The parameters the hook reports, in OSS::shards() order, with their index in hooked_
  // (SIZE_MAX for one without elements, which is never hooked).
  std::vector<std::pair<at::Tensor, size_t>> reported_;
  deterministic::MicroBatchLayout layout_;
  int64_t done_ = 0;        // deterministic mode: backward passes since the last reduction
  int64_t reductions_ = 0;  // deterministic mode: reductions since the last OSS::step
  // Hooks and the engine callback hold weak references, so a destroyed wrapper is never called.
  std::shared_ptr<ShardedDataParallelImpl*> alive_;
};
TORCH_MODULE(ShardedDataParallel);

}  // namespace fairscale::oss
