#include "trace/recorder.h"

#include <time.h>

#include <algorithm>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "trace/chrome_trace.h"

namespace fairscale::trace {

int64_t Event::IntArg(absl::string_view key, int64_t fallback) const {
  for (const Arg& a : args) {
    if (a.key == key) {
      if (const int64_t* v = std::get_if<int64_t>(&a.value)) return *v;
      return fallback;
    }
  }
  return fallback;
}

std::string Event::StringArg(absl::string_view key) const {
  for (const Arg& a : args) {
    if (a.key == key) {
      if (const std::string* v = std::get_if<std::string>(&a.value)) return *v;
      return "";
    }
  }
  return "";
}

Recorder::Recorder(int rank, bool enabled) : rank_(rank), enabled_(enabled) {}

int64_t Recorder::MonotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

int64_t Recorder::Now() const { return MonotonicNs() + clock_offset_ns_.load(); }

int Recorder::CurrentThreadId() {
  static std::atomic<int> next{1};
  thread_local const int id = next.fetch_add(1);
  return id;
}

void Recorder::SetThreadName(absl::string_view name) { SetThreadName(CurrentThreadId(), name); }

void Recorder::SetThreadName(int tid, absl::string_view name) {
  absl::MutexLock lock(&mu_);
  thread_names_[tid] = std::string(name);
}

void Recorder::Add(Event event) {
  event.pid = rank_;
  absl::MutexLock lock(&mu_);
  events_.push_back(std::move(event));
}

void Recorder::Complete(absl::string_view name, absl::string_view category, int64_t start_ns,
                        int64_t end_ns, std::vector<Arg> args, int tid) {
  if (!Enabled()) return;
  Event e;
  e.phase = Phase::kComplete;
  e.name = std::string(name);
  e.category = std::string(category);
  e.ts_ns = start_ns;
  e.dur_ns = std::max<int64_t>(0, end_ns - start_ns);
  e.tid = tid >= 0 ? tid : CurrentThreadId();
  e.args = std::move(args);
  Add(std::move(e));
}

void Recorder::Instant(absl::string_view name, absl::string_view category,
                       std::vector<Arg> args) {
  if (!Enabled()) return;
  Event e;
  e.phase = Phase::kInstant;
  e.name = std::string(name);
  e.category = std::string(category);
  e.ts_ns = Now();
  e.tid = CurrentThreadId();
  e.args = std::move(args);
  Add(std::move(e));
}

void Recorder::Counter(absl::string_view name, double value) {
  if (!Enabled()) return;
  Event e;
  e.phase = Phase::kCounter;
  e.name = std::string(name);
  e.category = "counter";
  e.ts_ns = Now();
  e.tid = CurrentThreadId();
  e.args.emplace_back(std::string(name), value);
  Add(std::move(e));
}

int Recorder::AcquireLane() {
  absl::MutexLock lock(&mu_);
  size_t lane = 0;
  while (lane < lanes_busy_.size() && lanes_busy_[lane]) ++lane;
  if (lane == lanes_busy_.size()) lanes_busy_.push_back(false);
  lanes_busy_[lane] = true;
  const int tid = kFirstLaneTid + static_cast<int>(lane);
  if (!thread_names_.contains(tid)) {
    thread_names_[tid] = lane == 0 ? "comm" : absl::StrCat("comm ", lane + 1);
  }
  return tid;
}

void Recorder::ReleaseLane(int tid) {
  absl::MutexLock lock(&mu_);
  const int lane = tid - kFirstLaneTid;
  if (lane >= 0 && lane < static_cast<int>(lanes_busy_.size())) lanes_busy_[lane] = false;
}

std::vector<Event> Recorder::Events() const {
  std::vector<Event> out;
  std::vector<Event> body;
  std::vector<std::pair<int, std::string>> names;
  {
    absl::MutexLock lock(&mu_);
    body = events_;
    names.assign(thread_names_.begin(), thread_names_.end());
  }
  std::sort(names.begin(), names.end());
  auto metadata = [this](const char* name, int tid, Arg arg) {
    Event e;
    e.phase = Phase::kMetadata;
    e.name = name;
    e.category = "__metadata";
    e.pid = rank_;
    e.tid = tid;
    e.args.push_back(std::move(arg));
    return e;
  };
  out.push_back(metadata("process_name", 0, Arg("name", absl::StrCat("rank ", rank_))));
  out.push_back(metadata("process_sort_index", 0, Arg("sort_index", rank_)));
  for (const auto& [tid, name] : names) {
    out.push_back(metadata("thread_name", tid, Arg("name", name)));
    // Real threads above the comm lanes; lanes in order.
    out.push_back(metadata("thread_sort_index", tid, Arg("sort_index", tid)));
  }
  std::stable_sort(body.begin(), body.end(), [](const Event& a, const Event& b) {
    return std::tie(a.ts_ns, a.tid) < std::tie(b.ts_ns, b.tid);
  });
  for (Event& e : body) out.push_back(std::move(e));
  return out;
}

void Recorder::Clear() {
  absl::MutexLock lock(&mu_);
  events_.clear();
}

absl::Status Recorder::WriteChromeTrace(const std::string& path) const {
  return trace::WriteChromeTrace(path, Events());
}

Scope::Scope(Recorder* recorder, absl::string_view name, absl::string_view category,
             std::vector<Arg> args) {
  if (recorder == nullptr || !recorder->enabled()) return;
  recorder_ = recorder;
  name_ = std::string(name);
  category_ = std::string(category);
  args_ = std::move(args);
  start_ns_ = recorder->Now();
}

Scope::~Scope() {
  if (recorder_ == nullptr) return;
  recorder_->Complete(name_, category_, start_ns_, recorder_->Now(), std::move(args_));
}

}  // namespace fairscale::trace
