#include "offload/offloaded_optimizer.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <future>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/torch_error.h"
#include "offload/disk_tier.h"
#include "offload/internal/adam_math.h"
#include "offload/internal/io_worker.h"

namespace fairscale::offload {

using internal::AdamHyper;

namespace {

constexpr char kSteps[] = "steps";
constexpr char kHyper[] = "hyper";  // f64 [groups, 5]: lr, beta1, beta2, eps, weight_decay

absl::StatusOr<AdamHyper> GroupHyper(const torch::optim::OptimizerParamGroup& group,
                                     bool decoupled, size_t index) {
  AdamHyper h;
  h.decoupled = decoupled;
  const torch::optim::OptimizerOptions& o = const_cast<torch::optim::OptimizerParamGroup&>(group).options();
  // AdamOptions and AdamWOptions carry the same hyper-parameters (AdamW's weight decay is
  // decoupled: h.decoupled).
  auto copy = [&h](const auto& a) {
    h.lr = a.lr();
    h.beta1 = std::get<0>(a.betas());
    h.beta2 = std::get<1>(a.betas());
    h.eps = a.eps();
    h.weight_decay = a.weight_decay();
    h.amsgrad = a.amsgrad();
  };
  if (!decoupled) {
    const auto* a = dynamic_cast<const torch::optim::AdamOptions*>(&o);
    if (a == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("param group ", index, " has options that are not AdamOptions"));
    }
    copy(*a);
  } else {
    const auto* a = dynamic_cast<const torch::optim::AdamWOptions*>(&o);
    if (a == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("param group ", index, " has options that are not AdamWOptions (AdamW)"));
    }
    copy(*a);
  }
  if (h.amsgrad) {
    return absl::InvalidArgumentError(
        absl::StrCat("param group ", index, ": amsgrad is not supported"));
  }
  return h;
}

void SetGroupHyper(torch::optim::OptimizerParamGroup& group, bool decoupled, const double* v) {
  if (!decoupled) {
    auto& a = static_cast<torch::optim::AdamOptions&>(group.options());
    a.lr(v[0]).betas({v[1], v[2]}).eps(v[3]).weight_decay(v[4]);
  } else {
    auto& a = static_cast<torch::optim::AdamWOptions&>(group.options());
    a.lr(v[0]).betas({v[1], v[2]}).eps(v[3]).weight_decay(v[4]);
  }
}

absl::Status SyncDir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return absl::OkStatus();  // best effort
  ::fsync(fd);
  ::close(fd);
  return absl::OkStatus();
}

}  // namespace

OffloadedAdam::OffloadedAdam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                             std::unique_ptr<torch::optim::OptimizerOptions> defaults,
                             bool decoupled, OffloadOptions options)
    : Optimizer(std::move(param_groups), std::move(defaults)),
      decoupled_(decoupled),
      options_(std::move(options)) {}

OffloadedAdam::~OffloadedAdam() = default;

const std::string& OffloadedAdam::path() const { return tier_->name(); }

OffloadedAdam::OffloadedAdam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                             torch::optim::AdamOptions defaults, OffloadOptions options)
    : OffloadedAdam(std::move(param_groups), std::make_unique<torch::optim::AdamOptions>(defaults),
                    false, std::move(options)) {
  base::ThrowIfError(Init(), "OffloadedAdam");
}

OffloadedAdam::OffloadedAdam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                             torch::optim::AdamWOptions defaults, OffloadOptions options)
    : OffloadedAdam(std::move(param_groups), std::make_unique<torch::optim::AdamWOptions>(defaults),
                    true, std::move(options)) {
  base::ThrowIfError(Init(), "OffloadedAdam");
}

absl::Status OffloadedAdam::Init() {
  const OffloadOptions& o = options_;
  if (o.dir().empty()) return absl::InvalidArgumentError("OffloadOptions.dir is empty");
  std::error_code ec;
  std::filesystem::create_directories(o.dir(), ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create the offload directory ", o.dir(), ": ", ec.message()));
  }
  std::vector<TensorSpec> specs;
  std::set<const void*> seen;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    absl::StatusOr<AdamHyper> h = GroupHyper(param_groups_[g], decoupled_, g);
    if (!h.ok()) return h.status();
    group_begin_.push_back(params_.size());
    for (const at::Tensor& p : param_groups_[g].params()) {
      const size_t i = params_.size();
      if (!p.defined() || !p.device().is_cpu() || !p.is_contiguous()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "parameter ", i, " (group ", g, ") must be a defined, contiguous CPU tensor"));
      }
      const c10::ScalarType t = p.scalar_type();
      if (t != c10::kFloat && t != c10::kBFloat16 && t != c10::kHalf) {
        return absl::InvalidArgumentError(absl::StrCat("parameter ", i, " has dtype ",
                                                       c10::toString(t),
                                                       "; supported: Float, BFloat16, Half"));
      }
      if (!seen.insert(p.unsafeGetTensorImpl()).second) {
        return absl::InvalidArgumentError(absl::StrCat("parameter ", i, " appears twice"));
      }
      Param q;
      q.tensor = p;
      q.group = g;
      std::vector<int64_t> shape(p.sizes().begin(), p.sizes().end());
      q.exp_avg = specs.size();
      specs.push_back({absl::StrCat("p", i, ".exp_avg"), c10::kFloat, shape});
      q.exp_avg_sq = specs.size();
      specs.push_back({absl::StrCat("p", i, ".exp_avg_sq"), c10::kFloat, shape});
      if (t != c10::kFloat) {
        q.master = static_cast<int64_t>(specs.size());
        specs.push_back({absl::StrCat("p", i, ".master"), c10::kFloat, shape});
      }
      params_.push_back(std::move(q));
    }
  }
  group_begin_.push_back(params_.size());
  steps_.assign(params_.size(), 0);
  specs.push_back({kSteps, c10::kLong, {static_cast<int64_t>(params_.size())}});
  specs.push_back({kHyper, c10::kDouble, {static_cast<int64_t>(param_groups_.size()), 5}});
  const int64_t chunk_elems = std::max<int64_t>(1, o.chunk_bytes() / 4);
  absl::StatusOr<std::unique_ptr<DiskTier>> tier =
      DiskTier::Create(absl::StrCat(o.dir(), "/", o.name(), ".fso"), std::move(specs),
                       chunk_elems, o.sync());
  if (!tier.ok()) return tier.status();
  tier_ = *std::move(tier);
  // The f32 masters start as the parameters, converted chunk by chunk (bounded memory).
  at::NoGradGuard no_grad;
  for (const Param& q : params_) {
    if (q.master < 0) continue;
    const at::Tensor flat = q.tensor.detach().view(-1);
    for (int64_t c = 0; c < tier_->num_chunks(q.master); ++c) {
      at::Tensor chunk =
          flat.narrow(0, tier_->chunk_begin(c), tier_->chunk_count(q.master, c)).to(c10::kFloat);
      absl::Status s = tier_->WriteChunk(q.master, c, chunk.data_ptr());
      if (!s.ok()) return s;
    }
  }
  absl::Status s = StepGroups({});  // records steps + hyper-parameters, commits
  if (!s.ok()) return s;
  io_ = std::make_unique<internal::IoWorker>();
  return absl::OkStatus();
}

absl::Status OffloadedAdam::CheckParam(size_t index) const {
  const Param& q = params_[index];
  const at::Tensor& p = q.tensor;
  const TensorSpec& spec = tier_->specs()[q.exp_avg];
  if (!p.defined() || !p.device().is_cpu() || !p.is_contiguous() ||
      p.sizes() != c10::IntArrayRef(spec.shape) ||
      (q.master < 0) != (p.scalar_type() == c10::kFloat)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parameter ", index, " changed since the optimizer was created: now ",
        p.defined()
            ? absl::StrCat(c10::toString(p.scalar_type()), "[", absl::StrJoin(p.sizes(), ", "), "]",
                           p.is_contiguous() ? "" : " non-contiguous")
            : "undefined",
        ", the state is for ", DescribeSpec(spec)));
  }
  const at::Tensor& g = p.grad();
  if (g.sizes() != p.sizes() || !g.device().is_cpu()) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter ", index, " has a gradient of another shape or device"));
  }
  return absl::OkStatus();
}

torch::Tensor OffloadedAdam::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure) {
    at::AutoGradMode grad(true);
    loss = closure();
  }
  std::vector<size_t> groups(param_groups_.size());
  for (size_t g = 0; g < groups.size(); ++g) groups[g] = g;
  base::ThrowIfError(StepGroups(groups), "OffloadedAdam::step");
  return loss;
}

void OffloadedAdam::step_group(size_t group) {
  if (group >= param_groups_.size()) {
    base::ThrowIfError(absl::InvalidArgumentError(absl::StrCat("no param group ", group, " (have ",
                                                               param_groups_.size(), ")")),
                       "OffloadedAdam::step_group");
  }
  base::ThrowIfError(StepGroups({group}), "OffloadedAdam::step_group");
}

absl::Status OffloadedAdam::StepGroups(const std::vector<size_t>& groups) {
  if (io_ != nullptr) {  // (Init calls this before the I/O thread exists, to commit)
    absl::Status s = tier_->CheckOwnership();
    if (!s.ok()) return s;
  }
  std::vector<AdamHyper> hyper;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    absl::StatusOr<AdamHyper> h = GroupHyper(param_groups_[g], decoupled_, g);
    if (!h.ok()) return h.status();
    hyper.push_back(*h);
  }
  struct Unit {
    size_t param;
    int64_t chunk;
  };
  std::vector<Unit> units;
  int64_t max_count = 1;
  bool any_master = false;
  for (size_t g : groups) {
    for (size_t i = group_begin_[g]; i < group_begin_[g + 1]; ++i) {
      if (!params_[i].tensor.grad().defined()) continue;
      absl::Status s = CheckParam(i);
      if (!s.ok()) return s;
      for (int64_t c = 0; c < tier_->num_chunks(params_[i].exp_avg); ++c) {
        units.push_back({i, c});
        any_master = any_master || params_[i].master >= 0;
        max_count = std::max(max_count, tier_->chunk_count(params_[i].exp_avg, c));
      }
    }
  }
  for (size_t g : groups) {
    for (size_t i = group_begin_[g]; i < group_begin_[g + 1]; ++i) {
      if (params_[i].tensor.grad().defined()) ++steps_[i];
    }
  }

  // Three staging slots: chunk k is updated in slot k % 3 while the I/O thread fills slot
  // (k + 1) % 3 and drains slot (k - 1) % 3 (FIFO order makes the reuse safe).
  struct Slot {
    at::Tensor m, v, master;
  };
  const int slots_n = units.empty() ? 0 : 3;
  std::vector<Slot> slots;
  for (int k = 0; k < slots_n; ++k) {
    slots.push_back({at::empty({max_count}, at::kFloat), at::empty({max_count}, at::kFloat),
                     any_master ? at::empty({max_count}, at::kFloat) : at::Tensor()});
  }
  auto read = [&](size_t k) -> absl::Status {
    const Unit& u = units[k];
    const Param& q = params_[u.param];
    Slot& s = slots[k % 3];
    absl::Status st = tier_->ReadChunk(q.exp_avg, u.chunk, s.m.data_ptr());
    if (st.ok()) st = tier_->ReadChunk(q.exp_avg_sq, u.chunk, s.v.data_ptr());
    if (st.ok() && q.master >= 0) st = tier_->ReadChunk(q.master, u.chunk, s.master.data_ptr());
    return st;
  };
  auto write = [&](size_t k) -> absl::Status {
    const Unit& u = units[k];
    const Param& q = params_[u.param];
    Slot& s = slots[k % 3];
    absl::Status st = tier_->WriteChunk(q.exp_avg, u.chunk, s.m.data_ptr());
    if (st.ok()) st = tier_->WriteChunk(q.exp_avg_sq, u.chunk, s.v.data_ptr());
    if (st.ok() && q.master >= 0) st = tier_->WriteChunk(q.master, u.chunk, s.master.data_ptr());
    return st;
  };
  auto compute = [&](size_t k) {
    const Unit& u = units[k];
    const Param& q = params_[u.param];
    Slot& s = slots[k % 3];
    const int64_t begin = tier_->chunk_begin(u.chunk);
    const int64_t count = tier_->chunk_count(q.exp_avg, u.chunk);
    at::NoGradGuard no_grad;
    at::Tensor p = q.tensor.detach().view(-1).narrow(0, begin, count);
    at::Tensor g = q.tensor.grad().detach().reshape(-1).narrow(0, begin, count);
    at::Tensor w = q.master >= 0 ? s.master.narrow(0, 0, count) : p;
    if (g.scalar_type() != c10::kFloat) g = g.to(c10::kFloat);
    internal::AdamUpdate(w, g, s.m.narrow(0, 0, count), s.v.narrow(0, 0, count),
                         steps_[u.param], hyper[q.group]);
    if (q.master >= 0) p.copy_(w);
  };

  // Every submitted task is waited for before the slots it uses go away, also on error.
  std::vector<std::future<absl::Status>> pending;
  struct Drain {
    std::vector<std::future<absl::Status>>* f;
    ~Drain() {
      for (auto& x : *f) {
        if (x.valid()) x.wait();
      }
    }
  } drain{&pending};
  absl::Status status;
  if (options_.prefetch() && io_ != nullptr) {
    std::future<absl::Status> next;
    if (!units.empty()) next = io_->Submit([&read] { return read(0); });
    for (size_t k = 0; k < units.size(); ++k) {
      status = next.get();
      if (!status.ok()) break;
      if (k + 1 < units.size()) next = io_->Submit([&read, k] { return read(k + 1); });
      compute(k);
      pending.push_back(io_->Submit([&write, k] { return write(k); }));
    }
    if (next.valid()) next.wait();
    for (auto& f : pending) {
      absl::Status s = f.get();
      if (status.ok()) status = s;
    }
  } else {
    for (size_t k = 0; k < units.size() && status.ok(); ++k) {
      status = read(k);
      if (!status.ok()) break;
      compute(k);
      status = write(k);
    }
  }
  if (!status.ok()) return status;

  // Step counts and group hyper-parameters go with the state, then the tier commits.
  status = WriteStepsAndHyper(*tier_);
  if (!status.ok()) return status;
  return tier_->Commit();
}

absl::Status OffloadedAdam::WriteStepsAndHyper(Tier& tier) const {
  const size_t steps_i = tier.specs().size() - 2, hyper_i = tier.specs().size() - 1;
  absl::Status s = tier.WriteTensor(steps_i, steps_.data());
  if (!s.ok()) return s;
  std::vector<double> hv;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    absl::StatusOr<AdamHyper> h = GroupHyper(param_groups_[g], decoupled_, g);
    if (!h.ok()) return h.status();
    hv.insert(hv.end(), {h->lr, h->beta1, h->beta2, h->eps, h->weight_decay});
  }
  return tier.WriteTensor(hyper_i, hv.data());
}

void OffloadedAdam::save(const std::string& path) const {
  base::ThrowIfError(SaveTier(path), "OffloadedAdam::save");
}

void OffloadedAdam::load(const std::string& path) {
  base::ThrowIfError(LoadTier(path), "OffloadedAdam::load");
}

absl::Status OffloadedAdam::SaveTier(const std::string& path) const {
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  absl::StatusOr<std::unique_ptr<DiskTier>> out =
      DiskTier::Create(tmp, tier_->specs(), tier_->chunk_elems(), /*sync=*/true);
  if (!out.ok()) return out.status();
  absl::Status s;
  for (size_t i = 0; i + 2 < tier_->specs().size() && s.ok(); ++i) {
    s = CopyTensor(*tier_, **out, i);
  }
  if (s.ok()) s = WriteStepsAndHyper(**out);  // the current ones (lr may have changed)
  if (s.ok()) s = (*out)->Commit();
  if (s.ok()) s = (*out)->Close();
  if (s.ok() && std::rename(tmp.c_str(), path.c_str()) != 0) {
    s = absl::DataLossError(
        absl::StrCat("cannot rename ", tmp, " to ", path, ": ", std::strerror(errno)));
  }
  if (!s.ok()) {
    std::remove(tmp.c_str());
    return s;
  }
  return SyncDir(std::filesystem::path(path).parent_path().string());
}

absl::Status OffloadedAdam::LoadTier(const std::string& path) {
  absl::StatusOr<std::unique_ptr<DiskTier>> in =
      DiskTier::Open(path, tier_->specs(), {.expected_session = 0, .verify_all = true});
  if (!in.ok()) return in.status();
  for (size_t i = 0; i < tier_->specs().size(); ++i) {
    absl::Status s = CopyTensor(**in, *tier_, i);  // the file may use another chunk size
    if (!s.ok()) return s;
  }
  const size_t steps_i = tier_->specs().size() - 2, hyper_i = tier_->specs().size() - 1;
  absl::Status s = tier_->ReadTensor(steps_i, steps_.data());
  if (!s.ok()) return s;
  std::vector<double> hv(5 * param_groups_.size());
  s = tier_->ReadTensor(hyper_i, hv.data());
  if (!s.ok()) return s;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    SetGroupHyper(param_groups_[g], decoupled_, &hv[5 * g]);
  }
  return tier_->Commit();
}

}  // namespace fairscale::offload
