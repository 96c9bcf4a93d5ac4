#include "adascale/adascale.h"

#include <torch/torch.h>

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/torch_error.h"
#include "comm/torch/tensor_buffer.h"

namespace fairscale::adascale {
namespace {

constexpr double kMinVar = 1e-6;  // FairScale's floor: keeps gain finite and var > 0

double DefaultSmoothing(int world, int64_t accum) {
  return std::max(1.0 - static_cast<double>(world) * static_cast<double>(accum) / 1000.0, 0.0);
}

}  // namespace

AdaScale::AdaScale(torch::optim::Optimizer& inner, std::shared_ptr<comm::Communicator> comm,
                   AdaScaleOptions options)
    : inner_(inner),
      comm_(std::move(comm)),
      sharded_(options.sharded_gradients()),
      replicas_(options.gradient_replicas()),
      debias_(options.debias_ewma()) {
  if (comm_ == nullptr) {
    base::ThrowIfError(absl::InvalidArgumentError("communicator is null"), "adascale::AdaScale");
  }
  accum_ = options.num_gradients_to_accumulate();
  if (accum_ < 1) {
    base::ThrowIfError(absl::InvalidArgumentError(
                           absl::StrCat("num_gradients_to_accumulate must be >= 1, got ", accum_)),
                       label("AdaScale"));
  }
  if (comm_->size() * accum_ < 2) {
    base::ThrowIfError(
        absl::InvalidArgumentError("a single worker without gradient accumulation has no "
                                   "gradient variance: use world size * "
                                   "num_gradients_to_accumulate >= 2"),
        label("AdaScale"));
  }
  if (replicas_ < 1 || comm_->size() % replicas_ != 0 || (replicas_ > 1 && !sharded_)) {
    base::ThrowIfError(
        absl::InvalidArgumentError(absl::StrCat(
            "gradient_replicas must be >= 1, divide the world size ", comm_->size(),
            " and come with sharded_gradients(true); got ", replicas_,
            sharded_ ? "" : " without sharded_gradients")),
        label("AdaScale"));
  }
  scale_ = options.scale().value_or(static_cast<double>(comm_->size() * accum_));
  if (!(scale_ >= 1.0)) {
    base::ThrowIfError(absl::InvalidArgumentError(absl::StrCat("scale must be >= 1, got ", scale_)),
                       label("AdaScale"));
  }
  smoothing_ = options.smoothing().value_or(DefaultSmoothing(comm_->size(), accum_));
  if (!(smoothing_ >= 0.0 && smoothing_ < 1.0)) {
    base::ThrowIfError(
        absl::InvalidArgumentError(absl::StrCat("smoothing must be in [0, 1), got ", smoothing_)),
        label("AdaScale"));
  }
  ensure_groups();
}

std::string AdaScale::label(const std::string& op) const {
  return absl::StrCat("adascale::AdaScale::", op, " rank ", comm_->rank(), "/", comm_->size());
}

c10::Device AdaScale::device() const {
  for (const auto& group : inner_.param_groups()) {
    for (const at::Tensor& p : group.params()) return p.device();
  }
  return c10::Device(c10::kCPU);
}

void AdaScale::ensure_groups() {
  const size_t n = inner_.param_groups().size();
  if (sqr_avg_.size() >= n) return;
  sqr_avg_.resize(n, 1.0);  // FairScale's initial estimates: gain 1
  var_avg_.resize(n, 0.0);
  sqr_biased_.resize(n, 0.0);
  var_biased_.resize(n, 0.0);
  unbias_.resize(n, 0.0);
  sqr_total_.resize(n, 0.0);
  var_total_.resize(n, 0.0);
}

void AdaScale::require_idle(const std::string& op) const {
  if (calls_ != 0) {
    base::ThrowIfError(
        absl::FailedPreconditionError(absl::StrCat(
            "in the middle of a gradient accumulation (", calls_, " of ", accum_,
            " backward passes accumulated); call it before the first or after step()")),
        label(op));
  }
}

void AdaScale::check_source(bool squares, const std::string& op) {
  if (calls_ == 0) {
    squares_ = squares;
    return;
  }
  if (squares_ == squares) return;
  base::ThrowIfError(
      absl::FailedPreconditionError(absl::StrCat(
          op, " after ", calls_, " backward pass(es) of this step fed by ",
          squares_ ? "accumulate_local_grad_sqr (an adapter such as AdaScaleFsdp / AdaScaleSdp)"
                   : "accumulate_local_gradients()",
          ": one step takes its local gradients from one source; with an adapter attached do "
          "not call accumulate_local_gradients()")),
      label(op));
}

void AdaScale::accumulate_local_gradients() {
  const auto& groups = inner_.param_groups();
  check_source(false, "accumulate_local_gradients");
  ensure_groups();
  torch::NoGradGuard no_grad;
  if (calls_ == 0) {
    local_sqr_ = torch::zeros({static_cast<int64_t>(groups.size())},
                              torch::TensorOptions().dtype(torch::kFloat64).device(device()));
    previous_.assign(groups.size(), {});
  }
  if (calls_ >= accum_) {
    base::ThrowIfError(absl::FailedPreconditionError(absl::StrCat(
                           "already ", calls_, " backward passes accumulated, ",
                           "num_gradients_to_accumulate is ", accum_, ": call step()")),
                       label("accumulate_local_gradients"));
  }
  const bool keep = calls_ + 1 < accum_;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    if (previous_[g].size() != params.size()) previous_[g].resize(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& grad = params[i].grad();
      if (!grad.defined()) continue;
      at::Tensor now = grad.to(torch::kFloat64);
      at::Tensor delta = previous_[g][i].defined() ? now - previous_[g][i] : now;
      local_sqr_[static_cast<int64_t>(g)] += delta.pow(2).sum();
      previous_[g][i] = keep ? now : at::Tensor();
    }
  }
  ++calls_;
  if (!keep) previous_.clear();
}

void AdaScale::accumulate_local_grad_sqr(const std::vector<double>& per_group) {
  ensure_groups();
  const size_t n = inner_.param_groups().size();
  if (per_group.size() != n) {
    base::ThrowIfError(absl::InvalidArgumentError(absl::StrCat(
                           "got ", per_group.size(), " squared norms for ", n, " param groups")),
                       label("accumulate_local_grad_sqr"));
  }
  check_source(true, "accumulate_local_grad_sqr");
  if (calls_ >= accum_) {
    base::ThrowIfError(absl::FailedPreconditionError(absl::StrCat(
                           "already ", calls_, " backward passes accumulated, ",
                           "num_gradients_to_accumulate is ", accum_, ": call step()")),
                       label("accumulate_local_grad_sqr"));
  }
  if (calls_ == 0) {
    local_sqr_ = torch::zeros({static_cast<int64_t>(n)},
                              torch::TensorOptions().dtype(torch::kFloat64).device(device()));
  }
  local_sqr_ += torch::tensor(per_group, torch::kFloat64).to(local_sqr_.device());
  ++calls_;
}

bool AdaScale::is_accumulation_step() const { return calls_ + 1 < accum_; }

void AdaScale::average_gradients() {
  if (sharded_) {
    base::ThrowIfError(
        absl::FailedPreconditionError("sharded_gradients: the gradients are reduced by their owner "
                                      "(FSDP / ShardedDataParallel), not here"),
        label("average_gradients"));
  }
  if (comm_->size() == 1) return;
  std::vector<comm::Work> works;
  for (const auto& group : inner_.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      at::Tensor grad = p.grad();
      if (!grad.defined()) continue;
      if (!grad.is_contiguous()) {
        p.mutable_grad() = grad.contiguous();
        grad = p.grad();
      }
      comm::Buffer b = base::ValueOrThrow(comm::ToBuffer(grad), label("average_gradients"));
      works.push_back(comm_->AllReduce(b, b, comm::ReduceOp::kAvg));
    }
  }
  absl::Status status;
  for (comm::Work& w : works) status.Update(w.Wait());
  base::ThrowIfError(status, label("average_gradients"));
}

at::Tensor AdaScale::step(torch::optim::Optimizer::LossClosure closure) {
  if (calls_ != accum_) {
    base::ThrowIfError(
        absl::FailedPreconditionError(absl::StrCat(
            calls_, " of ", accum_,
            " accumulate_local_gradients() calls made since the last step: call it after "
            "every backward pass, before the gradients are averaged")),
        label("step"));
  }
  ensure_groups();
  const auto& groups = inner_.param_groups();
  const int64_t ng = static_cast<int64_t>(groups.size());
  if (local_sqr_.size(0) != ng) {
    base::ThrowIfError(absl::FailedPreconditionError(
                           "param groups were added in the middle of a gradient accumulation"),
                       label("step"));
  }

  // total = |averaged grad|^2 per group (this rank's part when sharded).
  at::Tensor total;
  {
    torch::NoGradGuard no_grad;
    total = torch::zeros({ng}, local_sqr_.options());
    for (int64_t g = 0; g < ng; ++g) {
      for (const at::Tensor& p : groups[g].params()) {
        if (p.grad().defined()) total[g] += p.grad().to(torch::kFloat64).pow(2).sum();
      }
    }
  }
  at::Tensor stats = sharded_ ? torch::cat({local_sqr_, total}) : local_sqr_.clone();
  if (comm_->size() > 1) {
    comm::Buffer b = base::ValueOrThrow(comm::ToBuffer(stats), label("step"));
    base::ThrowIfError(comm_->AllReduce(b, b, comm::ReduceOp::kSum).Wait(), label("step"));
  }
  stats = stats.cpu();
  if (!sharded_) total = total.cpu();
  const double* s = stats.data_ptr<double>();
  const double* t = sharded_ ? s + ng : total.data_ptr<double>();

  const double n = static_cast<double>(comm_->size() * accum_);
  const double c2 = static_cast<double>(accum_) * static_cast<double>(accum_);
  const double f = smoothing_;
  ++ewma_count_;
  // Appendix B.3: the plain mean while count < 1 / (1 - f), then the EWMA.
  const bool running_mean = static_cast<double>(ewma_count_) < 1.0 / (1.0 - f);
  for (int64_t g = 0; g < ng; ++g) {
    const double local = s[g];
    const double tot = sharded_ ? t[g] / static_cast<double>(replicas_) / c2 : t[g] / c2;
    double var = local * (scale_ / n) / (n - 1.0) - tot * scale_ / (n - 1.0);
    double sqr = tot - var / scale_;
    var = std::max(var, kMinVar);
    sqr = std::max(sqr, 0.0);
    if (debias_) {
      sqr_biased_[g] = f * sqr_biased_[g] + (1.0 - f) * sqr;
      var_biased_[g] = f * var_biased_[g] + (1.0 - f) * var;
      unbias_[g] = f * unbias_[g] + (1.0 - f);
      sqr_avg_[g] = sqr_biased_[g] / unbias_[g];
      var_avg_[g] = var_biased_[g] / unbias_[g];
    } else if (running_mean) {
      sqr_total_[g] += sqr;
      var_total_[g] += var;
      sqr_avg_[g] = sqr_total_[g] / static_cast<double>(ewma_count_);
      var_avg_[g] = var_total_[g] / static_cast<double>(ewma_count_);
    } else {
      sqr_avg_[g] = f * sqr_avg_[g] + (1.0 - f) * sqr;
      var_avg_[g] = f * var_avg_[g] + (1.0 - f) * var;
    }
  }
  calls_ = 0;
  local_sqr_ = at::Tensor();
  previous_.clear();

  std::vector<double> lrs;
  lrs.reserve(groups.size());
  for (int64_t g = 0; g < ng; ++g) {
    auto& options = inner_.param_groups()[g].options();
    lrs.push_back(options.get_lr());
    options.set_lr(lrs.back() * gain(static_cast<size_t>(g)));
  }
  at::Tensor loss;
  try {
    loss = inner_.step(std::move(closure));
  } catch (...) {
    for (int64_t g = 0; g < ng; ++g) inner_.param_groups()[g].options().set_lr(lrs[g]);
    throw;
  }
  for (int64_t g = 0; g < ng; ++g) inner_.param_groups()[g].options().set_lr(lrs[g]);
  progress_ += gain();
  return loss;
}

void AdaScale::zero_grad() {
  require_idle("zero_grad");
  inner_.zero_grad();
}

double AdaScale::gain(size_t group) const {
  if (group >= var_avg_.size()) {
    base::ThrowIfError(
        absl::InvalidArgumentError(absl::StrCat("param group ", group, " of ", var_avg_.size())),
        label("gain"));
  }
  const double var = var_avg_[group];
  const double sqr = sqr_avg_[group];
  return (var + sqr) / (var / scale_ + sqr);
}

double AdaScale::gain() const {
  double var = 0.0;
  double sqr = 0.0;
  for (size_t g = 0; g < var_avg_.size(); ++g) {
    var += var_avg_[g];
    sqr += sqr_avg_[g];
  }
  return (var + sqr) / (var / scale_ + sqr);
}

void AdaScale::set_scale(double scale, bool update_estimate) {
  require_idle("set_scale");
  if (!(scale >= 1.0)) {
    base::ThrowIfError(absl::InvalidArgumentError(absl::StrCat("scale must be >= 1, got ", scale)),
                       label("set_scale"));
  }
  if (update_estimate) {
    const double r = scale_ / scale;
    for (size_t g = 0; g < var_avg_.size(); ++g) {
      var_biased_[g] *= r;
      var_total_[g] *= r;
      var_avg_[g] *= r;
    }
  }
  scale_ = scale;
}

void AdaScale::set_num_gradients_to_accumulate(int64_t n, bool update_smoothing) {
  require_idle("set_num_gradients_to_accumulate");
  if (n < 1 || comm_->size() * n < 2) {
    base::ThrowIfError(
        absl::InvalidArgumentError(
            absl::StrCat("num_gradients_to_accumulate must be >= 1 and world size * it >= 2, got ",
                         n, " at world size ", comm_->size())),
        label("set_num_gradients_to_accumulate"));
  }
  accum_ = n;
  if (update_smoothing) smoothing_ = DefaultSmoothing(comm_->size(), accum_);
}

namespace {
at::Tensor Vec(const std::vector<double>& v) { return torch::tensor(v, torch::kFloat64).clone(); }
std::vector<double> FromVec(const at::Tensor& t) {
  at::Tensor c = t.to(torch::kFloat64).contiguous().cpu();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}
}  // namespace

void AdaScale::save(torch::serialize::OutputArchive& archive) const {
  require_idle("save");
  archive.write("adascale/grad_sqr_avg", Vec(sqr_avg_));
  archive.write("adascale/grad_var_avg", Vec(var_avg_));
  archive.write("adascale/grad_sqr_avg_biased", Vec(sqr_biased_));
  archive.write("adascale/grad_var_avg_biased", Vec(var_biased_));
  archive.write("adascale/unbias", Vec(unbias_));
  archive.write("adascale/grad_sqr_avg_total", Vec(sqr_total_));
  archive.write("adascale/grad_var_avg_total", Vec(var_total_));
  archive.write("adascale/scalars", Vec({progress_, scale_, smoothing_, static_cast<double>(accum_),
                                         debias_ ? 1.0 : 0.0, static_cast<double>(ewma_count_)}));
}

void AdaScale::load(torch::serialize::InputArchive& archive) {
  require_idle("load");
  at::Tensor sqr, var, sqr_b, var_b, unbias, sqr_t, var_t, scalars;
  try {
    archive.read("adascale/grad_sqr_avg", sqr);
    archive.read("adascale/grad_var_avg", var);
    archive.read("adascale/grad_sqr_avg_biased", sqr_b);
    archive.read("adascale/grad_var_avg_biased", var_b);
    archive.read("adascale/unbias", unbias);
    archive.read("adascale/grad_sqr_avg_total", sqr_t);
    archive.read("adascale/grad_var_avg_total", var_t);
    archive.read("adascale/scalars", scalars);
  } catch (const c10::Error& e) {
    base::ThrowIfError(
        absl::DataLossError(absl::StrCat("not an AdaScale archive: ", e.what_without_backtrace())),
        label("load"));
  }
  const int64_t n = sqr.numel();
  if (var.numel() != n || sqr_b.numel() != n || var_b.numel() != n || unbias.numel() != n ||
      sqr_t.numel() != n || var_t.numel() != n || scalars.numel() != 6) {
    base::ThrowIfError(absl::DataLossError("inconsistent AdaScale archive sizes"), label("load"));
  }
  const int64_t groups = static_cast<int64_t>(inner_.param_groups().size());
  if (n != groups) {
    base::ThrowIfError(
        absl::InvalidArgumentError(absl::StrCat("the archive has statistics for ", n,
                                                " param groups, the optimizer has ", groups)),
        label("load"));
  }
  const std::vector<double> sc = FromVec(scalars);
  const int64_t accum = static_cast<int64_t>(sc[3]);
  if (!(sc[1] >= 1.0) || !(sc[2] >= 0.0 && sc[2] < 1.0) || accum < 1 || comm_->size() * accum < 2) {
    base::ThrowIfError(
        absl::InvalidArgumentError(absl::StrCat("archive holds scale ", sc[1], ", smoothing ",
                                                sc[2], ", num_gradients_to_accumulate ", accum,
                                                ": invalid at world size ", comm_->size())),
        label("load"));
  }
  sqr_avg_ = FromVec(sqr);
  var_avg_ = FromVec(var);
  sqr_biased_ = FromVec(sqr_b);
  var_biased_ = FromVec(var_b);
  unbias_ = FromVec(unbias);
  sqr_total_ = FromVec(sqr_t);
  var_total_ = FromVec(var_t);
  progress_ = sc[0];
  scale_ = sc[1];
  smoothing_ = sc[2];
  accum_ = accum;
  debias_ = sc[4] != 0.0;
  ewma_count_ = static_cast<int64_t>(sc[5]);
  ensure_groups();
}

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const AdaScale& ada) {
  ada.save(archive);
  return archive;
}

torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, AdaScale& ada) {
  ada.load(archive);
  return archive;
}

}  // namespace fairscale::adascale
