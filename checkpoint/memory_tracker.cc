#include "checkpoint/memory_tracker.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <sstream>

namespace fairscale::checkpoint {

struct MemoryTracker::State {
  explicit State(base::TrackingCpuAllocator* a) : allocator(a) {}
  base::TrackingCpuAllocator* allocator;
  std::vector<ModuleMemory> records;
  int open = -1;  // the record whose backward is running
  int64_t open_live = 0;
  int64_t outer_peak = 0;

  void Close() {
    if (open < 0) return;
    records[open].bwd_peak_bytes = allocator->peak_bytes() - open_live;
    allocator->raise_peak(outer_peak);
    open = -1;
  }
  void Open(int i) {
    Close();
    open = i;
    open_live = allocator->live_bytes();
    outer_peak = allocator->peak_bytes();
    allocator->reset_peak();
  }
};

MemoryTracker::MemoryTracker(base::TrackingCpuAllocator* allocator)
    : allocator_(allocator), state_(std::make_shared<State>(allocator)) {
  TORCH_CHECK(allocator_ != nullptr, "MemoryTracker: no allocator (TrackingCpuAllocator::Install())");
}

at::Tensor MemoryTracker::forward(const std::string& name, const torch::nn::Module& module,
                                  const at::Tensor& input,
                                  const std::function<at::Tensor(const at::Tensor&)>& fn) {
  state_->Close();
  ModuleMemory r;
  r.name = name;
  for (const auto& p : module.parameters()) r.param_bytes += p.numel() * p.element_size();
  const int64_t outer_peak = allocator_->peak_bytes();
  const int64_t before = allocator_->live_bytes();
  allocator_->reset_peak();
  at::Tensor out = fn(input);
  r.fwd_peak_bytes = allocator_->peak_bytes() - before;
  r.activation_bytes = allocator_->live_bytes() - before;
  r.output_bytes = out.defined() ? out.numel() * out.element_size() : 0;
  allocator_->raise_peak(outer_peak);
  const int index = static_cast<int>(state_->records.size());
  state_->records.push_back(r);
  std::weak_ptr<State> weak = state_;
  if (out.requires_grad()) {
    out.register_hook([weak, index](const at::Tensor&) {
      if (auto s = weak.lock()) s->Open(index);
    });
  }
  if (input.defined() && input.requires_grad()) {
    // A copy of the handle: hooks on `input` are its own, the caller's tensor is not changed
    // beyond having one more hook.
    at::Tensor in = input;
    in.register_hook([weak, index](const at::Tensor&) {
      if (auto s = weak.lock(); s && s->open == index) s->Close();
    });
  }
  return out;
}

std::vector<ModuleMemory> MemoryTracker::records() const {
  state_->Close();
  return state_->records;
}

void MemoryTracker::clear() {
  state_->Close();
  state_->records.clear();
}

namespace {
std::string MiB(int64_t bytes) {
  if (bytes < 0) return "n/a";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f", static_cast<double>(bytes) / (1 << 20));
  return buf;
}
}  // namespace

std::string MemoryTracker::table() const {
  std::ostringstream os;
  os << "| module | params MiB | activation MiB | output MiB | fwd peak MiB | bwd peak MiB |\n"
     << "|---|---:|---:|---:|---:|---:|\n";
  int64_t total = 0;
  for (const ModuleMemory& r : records()) {
    os << "| " << r.name << " | " << MiB(r.param_bytes) << " | " << MiB(r.activation_bytes)
       << " | " << MiB(r.output_bytes) << " | " << MiB(r.fwd_peak_bytes) << " | "
       << MiB(r.bwd_peak_bytes) << " |\n";
    total += r.activation_bytes;
  }
  os << "| total | | " << MiB(total) << " | | | |\n";
  return os.str();
}

CheckpointPlan MemoryTracker::suggest_checkpoints(int64_t budget_bytes) const {
  const std::vector<ModuleMemory> recs = records();
  CheckpointPlan plan;
  std::vector<int64_t> saving(recs.size());
  for (size_t i = 0; i < recs.size(); ++i) {
    plan.plain_bytes += recs[i].activation_bytes;
    saving[i] = std::max<int64_t>(0, recs[i].activation_bytes - recs[i].output_bytes);
  }
  std::vector<size_t> order(recs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return saving[a] > saving[b]; });
  std::vector<bool> chosen(recs.size(), false);
  auto estimate = [&]() {
    int64_t kept = 0, recompute = 0;
    for (size_t i = 0; i < recs.size(); ++i) {
      if (chosen[i]) {
        kept += recs[i].activation_bytes - saving[i];
        recompute = std::max(recompute, saving[i]);
      } else {
        kept += recs[i].activation_bytes;
      }
    }
    return kept + recompute;
  };
  plan.estimated_bytes = estimate();
  for (size_t i : order) {
    if (plan.estimated_bytes <= budget_bytes || saving[i] == 0) break;
    chosen[i] = true;
    plan.estimated_bytes = estimate();
  }
  plan.fits = plan.estimated_bytes <= budget_bytes;
  for (size_t i = 0; i < recs.size(); ++i) {
    if (chosen[i]) plan.checkpointed.push_back(recs[i].name);
  }
  return plan;
}

std::string MemoryTracker::suggestion_table(int64_t budget_bytes) const {
  const std::vector<ModuleMemory> recs = records();
  const CheckpointPlan plan = suggest_checkpoints(budget_bytes);
  std::ostringstream os;
  os << "budget " << MiB(budget_bytes) << " MiB: without checkpointing " << MiB(plan.plain_bytes)
     << " MiB, with the plan ~" << MiB(plan.estimated_bytes) << " MiB"
     << (plan.fits ? "" : " (does not fit even with every module checkpointed)") << "\n"
     << "| module | activation MiB | saving MiB | checkpoint |\n|---|---:|---:|---|\n";
  for (const ModuleMemory& r : recs) {
    const bool ck = std::find(plan.checkpointed.begin(), plan.checkpointed.end(), r.name) !=
                    plan.checkpointed.end();
    os << "| " << r.name << " | " << MiB(r.activation_bytes) << " | "
       << MiB(std::max<int64_t>(0, r.activation_bytes - r.output_bytes)) << " | "
       << (ck ? "yes" : "no") << " |\n";
  }
  return os.str();
}

}  // namespace fairscale::checkpoint
