#include "pipe/skip.h"

#include <c10/util/Exception.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/torch_error.h"
#include "pipe/internal/skip_layout.h"

namespace fairscale::pipe {
namespace {

// The innermost SkipTrackerScope's tracker on this thread (nullptr: the default one).
thread_local SkipTracker* g_current = nullptr;

std::string QuotedList(const std::set<std::string>& names) {
  return absl::StrJoin(names, ", ", [](std::string* out, const std::string& n) {
    absl::StrAppend(out, "'", n, "'");
  });
}

}  // namespace

Skippable::Skippable(SkippableOptions options) {
  for (const std::string& n : options.stash()) {
    TORCH_CHECK(!n.empty(), "pipe::Skippable: a stash name is empty");
    stashable_.insert(n);
  }
  for (const std::string& n : options.pop()) {
    TORCH_CHECK(!n.empty(), "pipe::Skippable: a pop name is empty");
    poppable_.insert(n);
  }
}

Skippable& Skippable::isolate(const Namespace& ns) {
  for (const std::string& n : stashable_) namespaces_[n] = ns;
  for (const std::string& n : poppable_) namespaces_[n] = ns;
  return *this;
}

Skippable& Skippable::isolate(const Namespace& ns, const std::vector<std::string>& only) {
  for (const std::string& n : only) {
    TORCH_CHECK(stashable_.count(n) || poppable_.count(n), "pipe::Skippable::isolate: '", n,
                "' is declared neither stashable nor poppable");
  }
  for (const std::string& n : only) namespaces_[n] = ns;
  return *this;
}

Namespace Skippable::namespace_of(const std::string& name) const {
  auto it = namespaces_.find(name);
  return it == namespaces_.end() ? Namespace() : it->second;
}

std::vector<SkipId> Skippable::stashable() const {
  std::vector<SkipId> out;
  for (const std::string& n : stashable_) out.push_back({namespace_of(n), n});
  return out;
}

std::vector<SkipId> Skippable::poppable() const {
  std::vector<SkipId> out;
  for (const std::string& n : poppable_) out.push_back({namespace_of(n), n});
  return out;
}

void Skippable::stash(const std::string& name, at::Tensor tensor) {
  SkipTracker& tracker = current_skip_tracker();
  TORCH_CHECK(stashable_.count(name), tracker.Where(this), "'", name,
              "' has not been declared as stashable");
  TORCH_CHECK(tensor.defined(), tracker.Where(this), "stash of an undefined tensor as '", name,
              "'");
  tracker.save({namespace_of(name), name}, std::move(tensor));
  if (tracker.call_ && tracker.call_->layer == this) tracker.call_->stashed.insert(name);
}

at::Tensor Skippable::pop(const std::string& name) {
  SkipTracker& tracker = current_skip_tracker();
  TORCH_CHECK(poppable_.count(name), tracker.Where(this), "'", name,
              "' has not been declared as poppable");
  const SkipId id{namespace_of(name), name};
  TORCH_CHECK(tracker.contains(id), tracker.Where(this), "'", name, "' has not been stashed");
  at::Tensor t = tracker.load(id);
  if (tracker.call_ && tracker.call_->layer == this) tracker.call_->popped.insert(name);
  return t;
}

void SkipTracker::save(const SkipId& id, at::Tensor tensor) { tensors_[id] = std::move(tensor); }

at::Tensor SkipTracker::load(const SkipId& id) {
  auto it = tensors_.find(id);
  TORCH_CHECK(it != tensors_.end(), "'", id.name, "' has not been stashed");
  at::Tensor t = std::move(it->second);
  tensors_.erase(it);
  return t;
}

std::vector<SkipId> SkipTracker::ids() const {
  std::vector<SkipId> out;
  for (const auto& item : tensors_) out.push_back(item.first);
  return out;
}

void SkipTracker::BeginLayer(const Skippable& layer, const std::string& name) {
  call_ = LayerCall{&layer, name, {}, {}};
}

void SkipTracker::EndLayer() {
  if (!call_) return;
  LayerCall call = std::move(*call_);
  call_.reset();
  std::set<std::string> not_stashed;
  for (const std::string& n : call.layer->stashable_names()) {
    if (!call.stashed.count(n)) not_stashed.insert(n);
  }
  TORCH_CHECK(not_stashed.empty(), "layer '", call.name, "': ", QuotedList(not_stashed),
              " must be stashed but have not");
  std::set<std::string> not_popped;
  for (const std::string& n : call.layer->poppable_names()) {
    if (!call.popped.count(n)) not_popped.insert(n);
  }
  TORCH_CHECK(not_popped.empty(), "layer '", call.name, "': ", QuotedList(not_popped),
              " must be popped but have not");
}

std::string SkipTracker::Where(const Skippable* layer) const {
  if (call_ && call_->layer == layer) return absl::StrCat("layer '", call_->name, "': ");
  return "";
}

SkipTracker& current_skip_tracker() {
  if (g_current != nullptr) return *g_current;
  thread_local SkipTracker default_tracker;
  return default_tracker;
}

SkipTrackerScope::SkipTrackerScope() : own_(std::in_place), previous_(g_current) {
  tracker_ = &*own_;
  g_current = tracker_;
}

SkipTrackerScope::SkipTrackerScope(SkipTracker* tracker) : tracker_(tracker), previous_(g_current) {
  TORCH_CHECK(tracker != nullptr, "pipe::SkipTrackerScope: null tracker");
  g_current = tracker_;
}

SkipTrackerScope::~SkipTrackerScope() { g_current = previous_; }

void verify_skippables(const torch::nn::Sequential& model) {
  TORCH_CHECK(!model.is_empty(), "pipe::verify_skippables: null model");
  base::ThrowIfError(internal::VerifyDeclarations(internal::DeclarationsOf(model, 0)),
                     "pipe::verify_skippables");
}

}  // namespace fairscale::pipe
