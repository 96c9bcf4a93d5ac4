#include "offload/offload_model.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/torch_error.h"
#include "checkpoint/checkpoint.h"
#include "offload/disk_tier.h"
#include "offload/internal/io_worker.h"

namespace fairscale::offload {

struct OffloadModelImpl::Param {
  std::string name;
  at::Tensor tensor;
  c10::intrusive_ptr<c10::StorageImpl> storage;  // shared by the parameter and its views
  std::vector<int64_t> sizes, strides;
  size_t nbytes = 0;
  size_t value = 0, grad = 0;  // tier tensor indices
  bool grad_valid = false;     // the tier gradient holds a sum since zero_grad()
};

// One forward's saved state: per slice and micro-batch, the detached input and the output (with
// the slice's graph, or a checkpoint node).
struct OffloadModelImpl::Pass : torch::CustomClassHolder {
  OffloadModelImpl* model = nullptr;
  std::vector<std::vector<at::Tensor>> inputs, outputs;
  std::vector<int64_t> split;  // micro-batch sizes along dim 0
  bool input_requires_grad = false;
};

namespace {

class OffloadFunction : public torch::autograd::Function<OffloadFunction> {
 public:
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, c10::intrusive_ptr<OffloadModelImpl::Pass> pass,
      const at::Tensor& x, const at::Tensor& dummy) {
    at::Tensor y = pass->model->ForwardPass(*pass, x);
    ctx->saved_data["pass"] = c10::IValue::make_capsule(pass);
    return {y};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto pass = c10::static_intrusive_pointer_cast<OffloadModelImpl::Pass>(
        ctx->saved_data["pass"].toCapsule());
    ctx->saved_data.erase("pass");
    at::Tensor gx = pass->model->BackwardPass(*pass, grads[0]);
    return {at::Tensor(), gx, at::Tensor()};
  }
};

}  // namespace

OffloadModelImpl::OffloadModelImpl(torch::nn::Sequential model, OffloadModelOptions options,
                                   torch::optim::AdamOptions adam)
    : options_(std::move(options)) {
  Init(std::move(model), adam);
}

OffloadModelImpl::OffloadModelImpl(torch::nn::Sequential model, OffloadModelOptions options,
                                   torch::optim::AdamWOptions adamw)
    : options_(std::move(options)) {
  Init(std::move(model), adamw);
}

OffloadModelImpl::~OffloadModelImpl() {
  io_.reset();  // drains read-ahead before the buffers and the tier go
}

template <typename AdamOpts>
void OffloadModelImpl::Init(torch::nn::Sequential model, AdamOpts adam) {
  TORCH_CHECK(!options_.dir().empty(), "OffloadModel: OffloadModelOptions.dir is empty");
  TORCH_CHECK(options_.num_microbatches() >= 1, "OffloadModel: num_microbatches must be >= 1");
  seq_ = register_module("module", std::move(model));
  const int64_t n = static_cast<int64_t>(seq_->size());
  std::vector<int64_t> balance = options_.balance();
  if (balance.empty()) {
    const int64_t k = options_.num_slices();
    TORCH_CHECK(k >= 1 && k <= n, "OffloadModel: num_slices ", k, " must be in [1, ", n,
                "] (the Sequential has ", n, " modules)");
    for (int64_t i = 0; i < k; ++i) balance.push_back(n / k + (i < n % k ? 1 : 0));
  }
  int64_t sum = 0;
  for (int64_t b : balance) {
    TORCH_CHECK(b >= 1, "OffloadModel: every slice of balance needs at least one module");
    sum += b;
  }
  TORCH_CHECK(sum == n, "OffloadModel: balance sums to ", sum, ", the Sequential has ", n,
              " modules");
  std::vector<TensorSpec> specs;
  std::set<const void*> seen;
  int64_t begin = 0;
  for (size_t s = 0; s < balance.size(); ++s) {
    Slice slice;
    slice.begin = begin;
    slice.end = begin + balance[s];
    begin = slice.end;
    for (int64_t m = slice.begin; m < slice.end; ++m) {
      for (const auto& item : seq_->ptr(static_cast<size_t>(m))->named_parameters()) {
        const at::Tensor& p = item.value();
        const std::string name = absl::StrCat(m, ".", item.key());
        TORCH_CHECK(seen.insert(p.unsafeGetTensorImpl()).second, "OffloadModel: parameter ",
                    name, " appears twice (tied weights are not supported)");
        const size_t nbytes = static_cast<size_t>(p.numel()) * p.element_size();
        TORCH_CHECK(p.device().is_cpu() && p.is_contiguous() && p.storage_offset() == 0 &&
                        p.storage().nbytes() == nbytes,
                    "OffloadModel: parameter ", name,
                    " must be a contiguous CPU tensor that owns its storage");
        Param q;
        q.name = name;
        q.tensor = p;
        q.storage = c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(
            p.storage().unsafeGetStorageImpl());
        q.sizes.assign(p.sizes().begin(), p.sizes().end());
        q.strides.assign(p.strides().begin(), p.strides().end());
        q.nbytes = nbytes;
        q.value = specs.size();
        specs.push_back({name, p.scalar_type(), q.sizes});
        q.grad = specs.size();
        specs.push_back({name + ".grad", p.scalar_type(), q.sizes});
        slice.params.push_back(params_.size());
        params_.push_back(std::move(q));
      }
    }
    slices_.push_back(std::move(slice));
  }
  std::error_code ec;
  std::filesystem::create_directories(options_.dir(), ec);
  TORCH_CHECK(!ec, "OffloadModel: cannot create the offload directory ", options_.dir(), ": ",
              ec.message());
  tier_ = base::ValueOrThrow(
      DiskTier::Create(absl::StrCat(options_.dir(), "/", options_.name(), ".fso"), std::move(specs),
                       std::max<int64_t>(1, options_.chunk_bytes() / 4), false),
      "OffloadModel::create");
  for (const Param& q : params_) {
    base::ThrowIfError(tier_->WriteTensor(q.value, q.tensor.data_ptr()), "OffloadModel::create");
  }
  base::ThrowIfError(tier_->Commit(), "OffloadModel::create");

  // One param group per slice, so step() can update a slice while it is resident.
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (const Slice& slice : slices_) {
    std::vector<at::Tensor> ps;
    for (size_t i : slice.params) ps.push_back(params_[i].tensor);
    groups.emplace_back(ps);
  }
  adam_ = std::make_unique<OffloadedAdam>(std::move(groups), adam,
                                          OffloadOptions(options_.dir())
                                              .name(options_.name() + "_optimizer")
                                              .chunk_bytes(options_.chunk_bytes())
                                              .prefetch(options_.prefetch()));
  io_ = std::make_unique<internal::IoWorker>();
  for (Slice& slice : slices_) slice.resident = true;
  for (int64_t s = 0; s < num_slices(); ++s) Evict(s);
}

int64_t OffloadModelImpl::slice_begin(int64_t i) const {
  return i == num_slices() ? slices_.back().end : slices_.at(static_cast<size_t>(i)).begin;
}

void OffloadModelImpl::Evict(int64_t s) {
  Slice& slice = slices_[static_cast<size_t>(s)];
  if (!slice.resident) return;
  for (size_t i : slice.params) {
    Param& q = params_[i];
    // The parameter becomes an empty tensor (using it by mistake fails on shapes); its storage,
    // which views saved by autograd share, releases its memory.
    q.tensor.set_data(at::empty({0}, q.tensor.options()));
    q.storage->set_data_ptr_noswap(c10::DataPtr(nullptr, c10::Device(c10::kCPU)));
    q.storage->set_nbytes(0);
  }
  slice.resident = false;
}

absl::Status OffloadModelImpl::Ensure(int64_t s, int direction, bool evict_others) {
  Slice& slice = slices_[static_cast<size_t>(s)];
  for (int64_t o = 0; o < num_slices() && evict_others; ++o) {
    if (o != s) Evict(o);
  }
  if (!slice.resident) {
    std::vector<c10::DataPtr> data;
    if (slice.prefetch.valid()) {
      absl::Status st = slice.prefetch.get();
      if (!st.ok()) return st;
      data = std::move(slice.prefetched);
    } else {
      for (size_t i : slice.params) {
        data.push_back(c10::GetAllocator(c10::kCPU)->allocate(params_[i].nbytes));
        absl::Status st = tier_->ReadTensor(params_[i].value, data.back().get());
        if (!st.ok()) return st;
      }
    }
    for (size_t k = 0; k < slice.params.size(); ++k) {
      Param& q = params_[slice.params[k]];
      q.storage->set_data_ptr_noswap(std::move(data[k]));
      q.storage->set_nbytes(q.nbytes);
      at::Tensor view = at::empty({0}, q.tensor.options());
      view.set_(c10::Storage(q.storage), 0, q.sizes, q.strides);
      q.tensor.set_data(view);
    }
    slice.resident = true;
  }
  const int64_t next = s + direction;
  if (options_.prefetch() && direction != 0 && next >= 0 && next < num_slices()) {
    Slice& n = slices_[static_cast<size_t>(next)];
    if (!n.resident && !n.prefetch.valid()) {
      n.prefetched.clear();
      n.prefetch = io_->Submit([this, &n]() -> absl::Status {
        for (size_t i : n.params) {
          n.prefetched.push_back(c10::GetAllocator(c10::kCPU)->allocate(params_[i].nbytes));
          absl::Status st = tier_->ReadTensor(params_[i].value, n.prefetched.back().get());
          if (!st.ok()) return st;
        }
        return absl::OkStatus();
      });
    }
  }
  return absl::OkStatus();
}

absl::Status OffloadModelImpl::FlushGrads(int64_t s) {
  at::NoGradGuard no_grad;
  for (size_t i : slices_[static_cast<size_t>(s)].params) {
    Param& q = params_[i];
    at::Tensor g = q.tensor.grad();
    if (!g.defined()) continue;
    g = g.contiguous();
    if (q.grad_valid) {  // accumulate: tier += g, chunk by chunk
      at::Tensor flat = g.view(-1);
      at::Tensor buf = at::empty({std::min(tier_->chunk_elems(), flat.numel())}, g.options());
      for (int64_t c = 0; c < tier_->num_chunks(q.grad); ++c) {
        const int64_t count = tier_->chunk_count(q.grad, c);
        at::Tensor b = buf.narrow(0, 0, count);
        absl::Status st = tier_->ReadChunk(q.grad, c, b.data_ptr());
        if (!st.ok()) return st;
        b.add_(flat.narrow(0, tier_->chunk_begin(c), count));
        st = tier_->WriteChunk(q.grad, c, b.data_ptr());
        if (!st.ok()) return st;
      }
    } else {
      absl::Status st = tier_->WriteTensor(q.grad, g.data_ptr());
      if (!st.ok()) return st;
    }
    q.grad_valid = true;
    q.tensor.mutable_grad().reset();
  }
  return tier_->Commit();
}

at::Tensor OffloadModelImpl::RunSlice(int64_t s, const at::Tensor& x) {
  const Slice& slice = slices_[static_cast<size_t>(s)];
  at::Tensor y = x;
  for (int64_t m = slice.begin; m < slice.end; ++m) {
    y = seq_->begin()[m].forward<at::Tensor>(y);
  }
  return y;
}

at::Tensor OffloadModelImpl::forward(const at::Tensor& x) {
  if (!c10::GradMode::is_enabled()) {  // inference: slice by slice, nothing kept
    at::Tensor y = x;
    for (int64_t s = 0; s < num_slices(); ++s) {
      base::ThrowIfError(Ensure(s, 1), "OffloadModel::forward");
      y = RunSlice(s, y);
    }
    return y;
  }
  auto pass = c10::make_intrusive<Pass>();
  pass->model = this;
  // The zero-size tensor that requires grad makes the node differentiable even when x is not
  // (integer tokens); the parameters inside are not inputs of the outer graph.
  return OffloadFunction::apply(pass, x, at::empty({0}).requires_grad_(true))[0];
}

at::Tensor OffloadModelImpl::ForwardPass(Pass& pass, const at::Tensor& x) {
  pass.input_requires_grad = x.requires_grad();
  std::vector<at::Tensor> acts = x.chunk(options_.num_microbatches(), 0);
  const size_t mbs = acts.size();
  for (const at::Tensor& a : acts) pass.split.push_back(a.size(0));
  pass.inputs.assign(slices_.size(), std::vector<at::Tensor>(mbs));
  pass.outputs.assign(slices_.size(), std::vector<at::Tensor>(mbs));
  at::AutoGradMode grad(true);
  for (int64_t s = 0; s < num_slices(); ++s) {
    base::ThrowIfError(Ensure(s, 1), "OffloadModel::forward");
    for (size_t b = 0; b < mbs; ++b) {
      at::Tensor in = acts[b].detach();
      if (at::isFloatingType(in.scalar_type()) && (s > 0 || pass.input_requires_grad)) {
        in.requires_grad_(true);
      }
      at::Tensor out;
      if (options_.checkpoint_activation()) {
        out = checkpoint::checkpoint([this, s](const at::Tensor& t) { return RunSlice(s, t); }, in);
      } else {
        out = RunSlice(s, in);
      }
      pass.inputs[s][b] = in;
      pass.outputs[s][b] = out;
      acts[b] = out.detach();
    }
  }
  return at::cat(acts, 0);
}

at::Tensor OffloadModelImpl::BackwardPass(Pass& pass, const at::Tensor& grad) {
  TORCH_CHECK(!pass.outputs.empty(), "OffloadModel: backward through the same forward twice");
  const size_t mbs = pass.outputs[0].size();
  std::vector<at::Tensor> grads = grad.split_with_sizes(pass.split, 0);
  for (int64_t s = num_slices() - 1; s >= 0; --s) {
    base::ThrowIfError(Ensure(s, -1), "OffloadModel::backward");
    for (size_t b = 0; b < mbs; ++b) {
      at::Tensor& out = pass.outputs[s][b];
      at::Tensor& in = pass.inputs[s][b];
      if (out.requires_grad() && grads[b].defined()) {
        torch::autograd::backward({out}, {grads[b]});
      }
      grads[b] = in.requires_grad() ? in.grad() : at::Tensor();
      out = at::Tensor();  // frees the slice's activations
      in = at::Tensor();
    }
    base::ThrowIfError(FlushGrads(s), "OffloadModel::backward");
  }
  pass.outputs.clear();
  pass.inputs.clear();
  if (!pass.input_requires_grad) return at::Tensor();
  for (const at::Tensor& g : grads) {
    if (!g.defined()) return at::Tensor();
  }
  return at::cat(grads, 0);
}

void OffloadModelImpl::zero_grad(bool /*set_to_none*/) {
  for (Param& q : params_) {
    q.grad_valid = false;
    if (q.tensor.grad().defined()) q.tensor.mutable_grad().reset();
  }
}

void OffloadModelImpl::step() {
  for (int64_t s = 0; s < num_slices(); ++s) {
    base::ThrowIfError(Ensure(s, 1), "OffloadModel::step");
    const Slice& slice = slices_[static_cast<size_t>(s)];
    for (size_t i : slice.params) {
      Param& q = params_[i];
      if (!q.grad_valid) continue;
      at::Tensor g = at::empty(q.sizes, q.tensor.options());
      base::ThrowIfError(tier_->ReadTensor(q.grad, g.data_ptr()), "OffloadModel::step");
      q.tensor.mutable_grad() = g;
    }
    adam_->step_group(static_cast<size_t>(s));
    for (size_t i : slice.params) {
      Param& q = params_[i];
      base::ThrowIfError(tier_->WriteTensor(q.value, q.tensor.data_ptr()), "OffloadModel::step");
      if (q.tensor.grad().defined()) q.tensor.mutable_grad().reset();
    }
    base::ThrowIfError(tier_->Commit(), "OffloadModel::step");
  }
}

namespace {

// torch::nn::Module::save's layout, writing copies: an archive keeps the tensors it is given
// until it is written out, and the parameters are released right after.
void SaveCopies(const torch::nn::Module& m, torch::serialize::OutputArchive& archive) {
  for (const auto& p : m.named_parameters(/*recurse=*/false)) {
    archive.write(p.key(), p.value().detach().clone());
  }
  for (const auto& b : m.named_buffers(/*recurse=*/false)) {
    archive.write(b.key(), b.value().detach().clone(), /*is_buffer=*/true);
  }
  for (const auto& child : m.named_children()) {
    if (!child.value()->is_serializable()) continue;
    torch::serialize::OutputArchive child_archive(archive.compilation_unit());
    SaveCopies(*child.value(), child_archive);
    archive.write(child.key(), child_archive);
  }
}

}  // namespace

void OffloadModelImpl::save(torch::serialize::OutputArchive& archive) const {
  auto* self = const_cast<OffloadModelImpl*>(this);
  for (int64_t s = 0; s < num_slices(); ++s) {
    base::ThrowIfError(self->Ensure(s, 0, false), "OffloadModel::save");
  }
  SaveCopies(*seq_, archive);
  for (int64_t s = 0; s < num_slices(); ++s) self->Evict(s);
}

void OffloadModelImpl::load(torch::serialize::InputArchive& archive) {
  for (int64_t s = 0; s < num_slices(); ++s) {
    base::ThrowIfError(Ensure(s, 0, false), "OffloadModel::load");
  }
  seq_->load(archive);
  at::NoGradGuard no_grad;
  // The archive's tensors may have replaced the parameters' storage: the values go to the tier
  // and back into the storage the parameter (and autograd's views) own.
  for (Param& q : params_) {
    at::Tensor v = q.tensor.detach().contiguous();
    TORCH_CHECK(v.sizes() == c10::IntArrayRef(q.sizes) &&
                    v.scalar_type() == q.tensor.scalar_type(),
                "OffloadModel::load: parameter ", q.name, " has another shape or dtype in the "
                "archive");
    base::ThrowIfError(tier_->WriteTensor(q.value, v.data_ptr()), "OffloadModel::load");
    c10::DataPtr data = c10::GetAllocator(c10::kCPU)->allocate(q.nbytes);
    std::memcpy(data.get(), v.data_ptr(), q.nbytes);
    q.storage->set_data_ptr_noswap(std::move(data));
    q.storage->set_nbytes(q.nbytes);
    at::Tensor view = at::empty({0}, q.tensor.options());
    view.set_(c10::Storage(q.storage), 0, q.sizes, q.strides);
    q.tensor.set_data(view);
  }
  base::ThrowIfError(tier_->Commit(), "OffloadModel::load");
  zero_grad();
  for (int64_t s = 0; s < num_slices(); ++s) Evict(s);
}

std::vector<std::pair<std::string, at::Tensor>> OffloadModelImpl::parameters_snapshot() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const Param& q : params_) {
    at::Tensor t = at::empty(q.sizes, q.tensor.options().requires_grad(false));
    base::ThrowIfError(tier_->ReadTensor(q.value, t.data_ptr()),
                       "OffloadModel::parameters_snapshot");
    out.emplace_back(q.name, t);
  }
  return out;
}

}  // namespace fairscale::offload
