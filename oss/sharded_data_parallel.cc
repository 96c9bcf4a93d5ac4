#include "oss/sharded_data_parallel.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <map>
#include <set>
#include <string>

#include "base/torch_error.h"
#include "comm/torch/tensor_buffer.h"
#include "deterministic/collectives.h"
#include "deterministic/mode.h"

namespace fairscale::oss {
namespace {

// Runs after a parameter's AccumulateGrad node: its gradient is complete for this backward.
// `inputs` is the gradient the node received in this backward (the engine keeps it for post
// hooks, so AccumulateGrad cannot have stolen it).
class GradReadyHook : public torch::autograd::FunctionPostHook {
 public:
  GradReadyHook(std::weak_ptr<ShardedDataParallelImpl*> owner, size_t index)
      : owner_(std::move(owner)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& inputs) override {
    if (auto owner = owner_.lock()) {
      (*owner)->on_grad_ready(index_, inputs.empty() ? at::Tensor() : inputs[0]);
    }
    return outputs;
  }

 private:
  std::weak_ptr<ShardedDataParallelImpl*> owner_;
  size_t index_;
};

// Deterministic mode: runs before a parameter's AccumulateGrad node, hands it this backward's
// gradient and passes on an undefined one, so that AccumulateGrad leaves .grad alone (it returns
// early on an undefined gradient) and the post hooks still run.
class CaptureGradHook : public torch::autograd::FunctionPreHook {
 public:
  CaptureGradHook(std::weak_ptr<ShardedDataParallelImpl*> owner, size_t index)
      : owner_(std::move(owner)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    auto owner = owner_.lock();
    if (!owner || grads.size() != 1) return grads;
    (*owner)->on_grad_captured(index_, grads[0]);
    return {at::Tensor()};
  }

 private:
  std::weak_ptr<ShardedDataParallelImpl*> owner_;
  size_t index_;
};

}  // namespace

ShardedDataParallelImpl::ShardedDataParallelImpl(torch::nn::AnyModule module,
                                                 std::shared_ptr<OSS> optimizer,
                                                 ShardedDataParallelOptions options)
    : module_(std::move(module)),
      optimizer_(std::move(optimizer)),
      options_(std::move(options)),
      alive_(std::make_shared<ShardedDataParallelImpl*>(this)) {
  TORCH_CHECK(!module_.is_empty(), "oss::ShardedDataParallel: empty module");
  TORCH_CHECK(optimizer_ != nullptr, "oss::ShardedDataParallel: null optimizer");
  TORCH_CHECK(options_.reduce_bucket_numel() >= 0,
              "oss::ShardedDataParallel: reduce_bucket_numel must be >= 0");
  comm_ = optimizer_->communicator();
  const bool det = options_.deterministic();
  if (det) deterministic::CheckThreads(label("construct"));
  // Collective, in both modes, before any other: a job mixing modes fails here on every rank.
  deterministic::CheckSameMode(*comm_, det, det ? options_.micro_batches() : 0,
                               label("construct"));
  if (det) {
    TORCH_CHECK(optimizer_->options().deterministic(), label("construct"),
                ": deterministic mode needs an OSS built with OssOptions().deterministic(true)");
    layout_ = deterministic::MicroBatchLayout::Make(options_.micro_batches(), comm_->size(),
                                                    comm_->rank());
  } else {
    TORCH_CHECK(!optimizer_->options().deterministic(), label("construct"),
                ": the OSS optimizer runs deterministic mode: build ShardedDataParallel with "
                "ShardedDataParallelOptions().deterministic(true).micro_batches(M) too");
  }
  register_module("module", module_.ptr());
  // Every trainable parameter of the module must be one the optimizer partitions: its owner
  // decides where the gradient goes.
  std::set<const void*> known;
  for (const ParamShard& s : optimizer_->shards()) known.insert(s.param.unsafeGetTensorImpl());
  for (const auto& item : module_.ptr()->named_parameters()) {
    TORCH_CHECK(!item.value().requires_grad() || known.count(item.value().unsafeGetTensorImpl()),
                label("construct"), ": parameter '", item.key(),
                "' requires grad but is not in the OSS optimizer");
  }
  if (options_.sync_models_at_startup() && comm_->size() > 1) {
    c10::NoGradGuard no_grad;
    std::vector<std::pair<comm::Work, at::Tensor>> works;
    for (const at::Tensor& p : module_.ptr()->parameters()) {
      at::Tensor t = p.detach().contiguous();
      works.emplace_back(
          comm_->Broadcast(base::ValueOrThrow(comm::ToBuffer(t), label("construct")), 0), t);
    }
    for (auto& [work, t] : works) base::ThrowIfError(work.Wait(), label("construct"));
    size_t i = 0;
    for (const at::Tensor& p : module_.ptr()->parameters()) {
      if (!works[i].second.is_same(p)) p.detach().copy_(works[i].second);
      ++i;
    }
    sync_buffers();
  }
  refresh_trainable();
  if (det) {
    std::weak_ptr<ShardedDataParallelImpl*> alive = alive_;
    optimizer_->set_step_check([alive](const std::string& op) {
      if (auto owner = alive.lock()) (*owner)->check_step(op);
    });
  }
}

ShardedDataParallelImpl::~ShardedDataParallelImpl() {
  unhook();
  if (options_.deterministic()) optimizer_->set_step_check(nullptr);
}

ShardedDataParallelImpl::NoSyncGuard ShardedDataParallelImpl::no_sync() {
  TORCH_CHECK(!options_.deterministic(), label("no_sync"),
              ": deterministic mode accumulates the step's micro-batches by itself (one backward "
              "per micro-batch, each on its own loss); do not use no_sync");
  return NoSyncGuard(this);
}

std::string ShardedDataParallelImpl::label(const std::string& op) const {
  return "oss::ShardedDataParallel::" + op + " rank " + std::to_string(comm_->rank()) + "/" +
         std::to_string(comm_->size());
}

void ShardedDataParallelImpl::unhook() {
  for (Hooked& h : hooked_) {
    if (!h.accumulator) continue;
    if (h.pre_hook != nullptr) {
      auto& hooks = h.accumulator->pre_hooks();
      for (auto it = hooks.begin(); it != hooks.end(); ++it) {
        if (it->get() == h.pre_hook) {
          hooks.erase(it);
          break;
        }
      }
    } else {
      h.accumulator->del_post_hook(h.key);
    }
  }
  hooked_.clear();
}

void ShardedDataParallelImpl::refresh_trainable() {
  TORCH_CHECK(!backward_active_, label("refresh_trainable"), ": called during backward");
  TORCH_CHECK(done_ == 0, label("refresh_trainable"), ": requires_grad changed after ", done_,
              " of this rank's ", layout_.per_rank(), " backward passes of a deterministic step; "
              "change it between steps");
  unhook();
  hooked_index_.clear();
  buckets_.clear();
  next_bucket_ = 0;
  const std::vector<ParamShard>& shards = optimizer_->shards();
  owned_.clear();
  for (const ParamShard& s : shards) {
    if (s.rank == comm_->rank()) owned_.insert(s.param.unsafeGetTensorImpl());
  }
  trainable_.clear();
  for (const ParamShard& s : shards) trainable_.push_back(s.param.requires_grad());
  // Buckets per owner, filled in reverse parameter order (roughly the order of backward).
  std::map<int, size_t> open;  // owner -> index in buckets_
  std::vector<std::pair<size_t, size_t>> shard_bucket;  // (shard, bucket)
  const int64_t limit = options_.reduce_bucket_numel();
  for (size_t k = shards.size(); k-- > 0;) {
    const ParamShard& s = shards[k];
    if (!s.param.requires_grad() || s.numel == 0) continue;
    auto it = open.find(s.rank);
    if (it != open.end()) {
      const Bucket& b = buckets_[it->second];
      if (shards[b.shards[0]].param.scalar_type() != s.param.scalar_type() ||
          b.numel + s.numel > limit) {
        open.erase(it);
        it = open.end();
      }
    }
    if (it == open.end()) {
      buckets_.emplace_back();
      buckets_.back().owner = s.rank;
      it = open.emplace(s.rank, buckets_.size() - 1).first;
    }
    Bucket& b = buckets_[it->second];
    b.shards.push_back(k);
    b.numel += s.numel;
    shard_bucket.emplace_back(k, it->second);
  }
  for (const auto& [shard, bucket] : shard_bucket) {
    const at::Tensor& p = shards[shard].param;
    auto [it, inserted] = hooked_index_.emplace(p.unsafeGetTensorImpl(), hooked_.size());
    if (inserted) {
      hooked_.emplace_back();
      hooked_.back().param = p;
    }
    hooked_[it->second].buckets.push_back(bucket);
  }
  reported_.clear();
  std::set<const void*> listed;
  for (const ParamShard& s : shards) {
    if (!s.param.requires_grad() || !listed.insert(s.param.unsafeGetTensorImpl()).second) continue;
    auto it = hooked_index_.find(s.param.unsafeGetTensorImpl());
    reported_.emplace_back(s.param, it == hooked_index_.end() ? SIZE_MAX : it->second);
  }
  for (size_t i = 0; i < hooked_.size(); ++i) {
    Hooked& h = hooked_[i];
    h.accumulator = torch::autograd::impl::grad_accumulator(h.param);
    TORCH_CHECK(h.accumulator != nullptr, label("refresh_trainable"),
                ": no gradient accumulator (is the parameter a leaf?)");
    if (options_.deterministic()) {
      auto hook = std::make_unique<CaptureGradHook>(alive_, i);
      h.pre_hook = hook.get();
      h.accumulator->add_pre_hook(std::move(hook));
    } else {
      h.key = h.accumulator->add_post_hook(std::make_unique<GradReadyHook>(alive_, i));
    }
  }
}

void ShardedDataParallelImpl::pre_forward() {
  const std::vector<ParamShard>& shards = optimizer_->shards();
  bool changed = shards.size() != trainable_.size();
  for (size_t k = 0; !changed && k < shards.size(); ++k) {
    changed = shards[k].param.requires_grad() != trainable_[k];
  }
  if (changed) refresh_trainable();
  if (options_.broadcast_buffers()) sync_buffers();
}

void ShardedDataParallelImpl::sync_buffers() {
  if (comm_->size() == 1) return;
  c10::NoGradGuard no_grad;
  std::vector<std::pair<comm::Work, at::Tensor>> works;
  std::vector<at::Tensor> buffers = module_.ptr()->buffers();
  for (const at::Tensor& b : buffers) {
    at::Tensor t = b.contiguous();
    works.emplace_back(
        comm_->Broadcast(base::ValueOrThrow(comm::ToBuffer(t), label("sync_buffers")), 0), t);
  }
  for (auto& [work, t] : works) base::ThrowIfError(work.Wait(), label("sync_buffers"));
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (!works[i].second.is_same(buffers[i])) buffers[i].copy_(works[i].second);
  }
}

void ShardedDataParallelImpl::register_local_grad_hook(LocalGradHook hook) {
  TORCH_CHECK(!backward_active_, label("register_local_grad_hook"), ": called during backward");
  TORCH_CHECK(hook, label("register_local_grad_hook"), ": the hook is empty");
  TORCH_CHECK(!local_grad_hook_, label("register_local_grad_hook"),
              ": a local gradient hook is registered already (one per module); "
              "remove_local_grad_hook() first");
  local_grad_hook_ = std::move(hook);
}

void ShardedDataParallelImpl::remove_local_grad_hook() {
  TORCH_CHECK(!backward_active_, label("remove_local_grad_hook"), ": called during backward");
  local_grad_hook_ = nullptr;
  for (Hooked& h : hooked_) h.local_sqr = at::Tensor();
}

void ShardedDataParallelImpl::report_local_grads() {
  if (!local_grad_hook_) return;
  std::vector<LocalGradSqr> report;
  report.reserve(reported_.size());
  for (const auto& [param, index] : reported_) {
    double sqr = 0.0;
    if (index != SIZE_MAX) {
      at::Tensor& t = hooked_[index].local_sqr;
      if (t.defined()) sqr = t.item<double>();
      t = at::Tensor();
    }
    report.push_back({param, sqr});
  }
  local_grad_hook_(report);
}

void ShardedDataParallelImpl::end_backward() {
  if (backward_syncs_) {
    try {
      finalize();
    } catch (...) {
      for (Hooked& h : hooked_) h.local_sqr = at::Tensor();  // not carried into the next backward
      throw;
    }
  } else {
    backward_active_ = false;
  }
  report_local_grads();
}

void ShardedDataParallelImpl::on_grad_ready(size_t index, const at::Tensor& incoming) {
  if (!sync_ && !local_grad_hook_) return;
  Hooked& h = hooked_.at(index);
  if (!backward_active_) {
    backward_active_ = true;
    backward_syncs_ = sync_;
    std::weak_ptr<ShardedDataParallelImpl*> alive = alive_;
    torch::autograd::Engine::get_default_engine().queue_callback([alive] {
      if (auto owner = alive.lock()) (*owner)->end_backward();
    });
  }
  if (local_grad_hook_ && incoming.defined()) {
    // Before anything reads .grad for a reduction; a second run in one backward (reentrant
    // backward) adds its square, as fsdp's hook does.
    c10::NoGradGuard no_grad;
    at::Tensor sqr = incoming.to(at::kDouble).pow(2).sum();
    h.local_sqr = h.local_sqr.defined() ? h.local_sqr.add(sqr) : sqr;
  }
  if (!backward_syncs_) return;
  if (h.ready) return;  // a second AccumulateGrad run in the same backward: already counted
  h.ready = true;
  for (size_t b : h.buckets) ++buckets_[b].ready;
  issue_ready();
}

void ShardedDataParallelImpl::issue_ready() {
  if (comm_->size() == 1) return;  // the mean over one rank: finalize() only fills in zeros
  while (next_bucket_ < buckets_.size() &&
         buckets_[next_bucket_].ready == buckets_[next_bucket_].shards.size()) {
    issue(buckets_[next_bucket_++]);
  }
}

void ShardedDataParallelImpl::issue(Bucket& bucket) {
  c10::NoGradGuard no_grad;
  const std::vector<ParamShard>& shards = optimizer_->shards();
  const at::Tensor& first = shards[bucket.shards[0]].param;
  bucket.buffer = at::empty({bucket.numel}, first.options());
  int64_t off = 0;
  for (size_t k : bucket.shards) {
    const ParamShard& s = shards[k];
    at::Tensor dst = bucket.buffer.narrow(0, off, s.numel);
    const at::Tensor& g = s.param.grad();
    if (g.defined()) {
      dst.copy_(g.reshape({-1}).narrow(0, s.offset, s.numel));
    } else {
      dst.zero_();  // unused in this backward
    }
    off += s.numel;
  }
  const std::string context = label("reduce");
  comm::Buffer buf = base::ValueOrThrow(comm::ToBuffer(bucket.buffer), context);
  bucket.work = comm_->Reduce(buf, bucket.owner == comm_->rank() ? buf : comm::Buffer{},
                              comm::ReduceOp::kSum, bucket.owner);
  bucket.issued = true;
  if (bucket.owner == comm_->rank()) return;
  // The bucket holds a copy: a gradient this rank owns nothing of can go now (its AccumulateGrad
  // has run for this backward), and buffers of reduces already done too, so that a non-owner
  // does not hold every gradient until the end of backward.
  for (size_t k : bucket.shards) {
    const ParamShard& s = shards[k];
    if (owned_.count(s.param.unsafeGetTensorImpl())) continue;
    // kFlat: the parameter's other ranges may sit in buckets not packed yet.
    bool all_packed = true;
    for (size_t b : hooked_[hooked_index_.at(s.param.unsafeGetTensorImpl())].buckets) {
      all_packed &= buckets_[b].issued;
    }
    if (all_packed) s.param.mutable_grad() = at::Tensor();
  }
  for (size_t b = 0; b < next_bucket_; ++b) {
    Bucket& done = buckets_[b];
    if (done.owner != comm_->rank() && done.buffer.defined() && done.work.IsDone()) {
      done.buffer = at::Tensor();
    }
  }
}

void ShardedDataParallelImpl::reduce() {
  TORCH_CHECK(!options_.deterministic(), label("reduce"),
              ": deterministic mode reduces by itself after this rank's ", layout_.per_rank(),
              "th backward of the step");
  TORCH_CHECK(!backward_active_, label("reduce"), ": called during backward");
  finalize();
}

void ShardedDataParallelImpl::finalize() {
  backward_active_ = false;
  for (Hooked& h : hooked_) h.ready = false;
  if (comm_->size() == 1) {
    // Nothing to reduce and the mean over one rank is the gradient itself: no bucket copies.
    // As at any world size, a parameter unused in this backward gets a zero gradient.
    c10::NoGradGuard no_grad;
    for (const ParamShard& s : optimizer_->shards()) {
      if (!s.param.requires_grad()) continue;
      at::Tensor& g = s.param.mutable_grad();
      if (!g.defined()) g = at::zeros_like(s.param);
    }
    for (Bucket& b : buckets_) b.ready = 0;
    next_bucket_ = 0;
    return;
  }
  // Parameters unused in this backward never fired their hook: zero gradients, issued now in the
  // same order on every rank.
  while (next_bucket_ < buckets_.size()) issue(buckets_[next_bucket_++]);
  next_bucket_ = 0;
  const std::string context = label("reduce");
  for (Bucket& b : buckets_) {
    base::ThrowIfError(b.work.Wait(), context);
    b.ready = 0;
    b.issued = false;
  }
  c10::NoGradGuard no_grad;
  const double world = comm_->size();
  for (Bucket& b : buckets_) {
    if (b.owner == comm_->rank()) b.buffer.div_(world);
  }
  install_reduced();
}

void ShardedDataParallelImpl::install_reduced() {
  c10::NoGradGuard no_grad;
  const std::vector<ParamShard>& shards = optimizer_->shards();
  const int me = comm_->rank();
  for (Bucket& b : buckets_) {
    if (b.owner != me) continue;
    int64_t off = 0;
    for (size_t k : b.shards) {
      const ParamShard& s = shards[k];
      at::Tensor& g = s.param.mutable_grad();
      if (!g.defined()) {
        g = at::zeros_like(s.param);
      } else if (!g.is_contiguous()) {
        g = g.contiguous();
      }
      g.view({-1}).narrow(0, s.offset, s.numel).copy_(b.buffer.narrow(0, off, s.numel));
      off += s.numel;
    }
  }
  for (Bucket& b : buckets_) {
    if (b.owner == me) {
      b.buffer = at::Tensor();
      continue;
    }
    for (size_t k : b.shards) {
      const ParamShard& s = shards[k];
      if (!owned_.count(s.param.unsafeGetTensorImpl())) {
        s.param.mutable_grad() = at::Tensor();  // not ours: free it
      } else {
        s.param.mutable_grad().view({-1}).narrow(0, s.offset, s.numel).zero_();
      }
    }
    b.buffer = at::Tensor();
  }
}

void ShardedDataParallelImpl::on_grad_captured(size_t index, const at::Tensor& grad) {
  Hooked& h = hooked_.at(index);
  if (!backward_active_) {
    backward_active_ = true;
    std::weak_ptr<ShardedDataParallelImpl*> alive = alive_;
    torch::autograd::Engine::get_default_engine().queue_callback([alive] {
      if (auto owner = alive.lock()) (*owner)->finish_micro_batch();
    });
  }
  if (!grad.defined()) return;
  // A second AccumulateGrad run in one backward (reentrant backward): one micro-batch's gradient
  // is the sum of both, in this rank's own order.
  h.captured = h.captured.defined() ? h.captured + grad : grad;
}

void ShardedDataParallelImpl::finish_micro_batch() {
  backward_active_ = false;
  c10::NoGradGuard no_grad;
  const std::vector<ParamShard>& shards = optimizer_->shards();
  const int64_t index = layout_.first() + done_;
  for (Bucket& b : buckets_) {
    const at::Tensor& first = shards[b.shards[0]].param;
    at::Tensor buffer = at::empty({b.numel}, first.options());
    int64_t off = 0;
    for (size_t k : b.shards) {
      const ParamShard& s = shards[k];
      at::Tensor dst = buffer.narrow(0, off, s.numel);
      const at::Tensor& g = hooked_[hooked_index_.at(s.param.unsafeGetTensorImpl())].captured;
      if (g.defined()) {
        dst.copy_(g.reshape({-1}).narrow(0, s.offset, s.numel));
      } else {
        dst.zero_();  // unused in this micro-batch: a zero gradient, as in the default mode
      }
      off += s.numel;
    }
    b.partials.Add(index, std::move(buffer));
  }
  for (Hooked& h : hooked_) {
    if (local_grad_hook_ && h.captured.defined()) {
      h.local_sqr = h.captured.to(at::kDouble).pow(2).sum();
    }
    h.captured = at::Tensor();
  }
  if (++done_ == layout_.per_rank()) {
    done_ = 0;
    reduce_deterministic();
    ++reductions_;
  }
  report_local_grads();
}

void ShardedDataParallelImpl::reduce_deterministic() {
  const std::string context = label("reduce");
  const std::vector<std::vector<deterministic::Node>> nodes = layout_.nodes_by_rank();
  const int64_t m = layout_.micro_batches;
  // Every rank gathers the buckets in the same order; only the owner keeps a sum.
  for (Bucket& b : buckets_) {
    std::vector<deterministic::Partial> parts =
        deterministic::Gather(*comm_, b.owner, b.partials.Take(), nodes, context);
    if (b.owner != comm_->rank()) continue;
    b.buffer = deterministic::Total(std::move(parts), m);
    b.buffer.div_(m);
  }
  install_reduced();
}

void ShardedDataParallelImpl::check_step(const std::string& op) {
  const int64_t k = layout_.per_rank();
  TORCH_CHECK(done_ == 0, label(op), ": deterministic mode: ", op, " after ", done_, " of this "
              "rank's ", k, " backward passes of the step (", layout_.micro_batches,
              " micro-batches over ", comm_->size(), " ranks: one backward per micro-batch)");
  TORCH_CHECK(reductions_ == 1, label(op), ": deterministic mode: ", op, " after ",
              reductions_ * k, " backward passes since the last step; each step runs exactly ",
              k, " on this rank (", layout_.micro_batches, " micro-batches over ", comm_->size(),
              " ranks, one backward per micro-batch)");
  if (op == "step") reductions_ = 0;
}

}  // namespace fairscale::oss
