#include "slowmo/slowmo.h"

#include <c10/util/Exception.h>

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/torch_error.h"
#include "comm/torch/tensor_buffer.h"
#include "comm/work.h"

namespace fairscale::slowmo {
namespace {

absl::Status ValidateOptions(const SlowMoOptions& o) {
  if (o.frequency() < 1) {
    return absl::InvalidArgumentError(absl::StrCat("frequency must be >= 1, got ", o.frequency()));
  }
  if (!(o.base_lr() > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("base_lr must be > 0, got ", o.base_lr()));
  }
  if (!(o.slowmo_lr() > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("slowmo_lr must be > 0, got ", o.slowmo_lr()));
  }
  if (!(o.slowmo_momentum() >= 0 && o.slowmo_momentum() < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("slowmo_momentum must be in [0, 1), got ", o.slowmo_momentum()));
  }
  return absl::OkStatus();
}

at::ScalarType OuterDtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

at::Tensor Flatten(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> views;
  views.reserve(params.size());
  for (const at::Tensor& p : params) views.push_back(p.detach().reshape({-1}));
  return at::cat(views);
}

// Copies `flat` (any floating dtype) back into the parameters.
void Unflatten(const at::Tensor& flat, const std::vector<at::Tensor>& params) {
  int64_t offset = 0;
  for (const at::Tensor& p : params) {
    const int64_t n = p.numel();
    p.detach().copy_(flat.narrow(0, offset, n).view(p.sizes()));
    offset += n;
  }
}

}  // namespace

SlowMo::SlowMo(std::vector<at::Tensor> params, std::shared_ptr<comm::Communicator> comm,
               SlowMoOptions options)
    : comm_(std::move(comm)), options_(options) {
  if (comm_ == nullptr) {
    base::ThrowIfError(absl::InvalidArgumentError("communicator is null"), "slowmo::SlowMo");
  }
  const std::string context = Context("SlowMo");
  base::ThrowIfError(ValidateOptions(options_), context);
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    if (!p.defined() || !at::isFloatingType(p.scalar_type())) {
      base::ThrowIfError(
          absl::InvalidArgumentError(absl::StrCat(
              "parameter ", i, " must be a defined floating-point tensor")),
          context);
    }
    base::ThrowIfError(comm::ToDataType(p.scalar_type()).status(), context);
    Bucket* bucket = nullptr;
    for (Bucket& b : buckets_) {
      if (b.params.front().scalar_type() == p.scalar_type()) bucket = &b;
    }
    if (bucket == nullptr) bucket = &buckets_.emplace_back();
    bucket->params.push_back(p);
  }
  for (Bucket& b : buckets_) {
    b.flat = Flatten(b.params);  // allocates the communication buffer once
    if (!options_.is_local_sgd()) {
      b.prev = b.flat.to(OuterDtype(b.flat.scalar_type()), /*non_blocking=*/false, /*copy=*/true);
      b.momentum = at::zeros_like(b.prev);
    }
  }
}

std::string SlowMo::Context(const char* method) const {
  return absl::StrCat("slowmo::SlowMo::", method, " rank ", comm_->rank(), "/", comm_->size());
}

bool SlowMo::step_completed() {
  const bool averaged = maybe_average(steps_);
  ++steps_;
  return averaged;
}

bool SlowMo::maybe_average(int64_t step) {
  if ((step + 1) % options_.frequency() != 0) return false;
  average();
  return true;
}

void SlowMo::average() {
  const std::string context = Context("average");
  at::NoGradGuard no_grad;
  // Overlap: each bucket's all-reduce is issued as soon as its buffer is filled, so the copy-in of
  // bucket k+1 runs while bucket k is on the wire, and bucket k's outer step runs while the later
  // buckets are still in flight. The parameters are not used again before this returns.
  std::vector<comm::Work> works;
  works.reserve(buckets_.size());
  for (Bucket& b : buckets_) {
    int64_t offset = 0;
    for (const at::Tensor& p : b.params) {
      const int64_t n = p.numel();
      b.flat.narrow(0, offset, n).copy_(p.detach().reshape({-1}));
      offset += n;
    }
    comm::Buffer buf = base::ValueOrThrow(comm::ToBuffer(b.flat), context);
    works.push_back(comm_->AllReduce(buf, buf, comm::ReduceOp::kSum));
  }
  const double inv_world = 1.0 / comm_->size();
  const double lr = options_.base_lr();
  for (size_t i = 0; i < buckets_.size(); ++i) {
    Bucket& b = buckets_[i];
    absl::Status status = works[i].Wait();
    if (!status.ok()) {
      // Drain the rest so that no operation still writes a buffer after we throw.
      for (size_t j = i + 1; j < works.size(); ++j) works[j].Wait().IgnoreError();
      base::ThrowIfError(status, context);
    }
    b.flat.mul_(inv_world);  // f32 (or the parameters' dtype) sum, then one scale by 1/N
    if (options_.is_local_sgd()) {
      Unflatten(b.flat, b.params);
      continue;
    }
    at::Tensor avg = b.flat.to(b.prev.scalar_type());
    // u = beta * u + (x_prev - x_avg) / lr;  x_prev -= alpha * lr * u
    b.momentum.mul_(options_.slowmo_momentum()).add_(b.prev - avg, 1.0 / lr);
    b.prev.add_(b.momentum, -options_.slowmo_lr() * lr);
    Unflatten(b.prev, b.params);
  }
}

void SlowMo::set_base_lr(double lr) {
  SlowMoOptions next = options_;
  next.base_lr(lr);
  base::ThrowIfError(ValidateOptions(next), Context("set_base_lr"));
  options_ = next;
}

SlowMoState SlowMo::state_dict() const {
  SlowMoState state;
  state.steps = steps_;
  for (const Bucket& b : buckets_) {
    if (b.prev.defined()) {
      state.prev_params.push_back(b.prev.clone());
      state.momentum.push_back(b.momentum.clone());
    }
  }
  return state;
}

void SlowMo::load_state_dict(const SlowMoState& state) {
  const std::string context = Context("load_state_dict");
  const size_t want = options_.is_local_sgd() ? 0 : buckets_.size();
  if (state.prev_params.size() != want || state.momentum.size() != want || state.steps < 0) {
    base::ThrowIfError(
        absl::InvalidArgumentError(absl::StrCat(
            "state has ", state.prev_params.size(), " outer-parameter and ", state.momentum.size(),
            " momentum buckets and steps ", state.steps, "; expected ", want, " buckets")),
        context);
  }
  for (size_t i = 0; i < want; ++i) {
    const Bucket& b = buckets_[i];
    if (!state.prev_params[i].defined() || !state.momentum[i].defined() ||
        !state.prev_params[i].sizes().equals(b.prev.sizes()) ||
        !state.momentum[i].sizes().equals(b.momentum.sizes())) {
      base::ThrowIfError(absl::InvalidArgumentError(absl::StrCat(
                             "bucket ", i, " has the wrong shape; expected [", b.prev.numel(), "]")),
                         context);
    }
  }
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < want; ++i) {
    buckets_[i].prev.copy_(state.prev_params[i]);
    buckets_[i].momentum.copy_(state.momentum[i]);
  }
  steps_ = state.steps;
}

}  // namespace fairscale::slowmo
