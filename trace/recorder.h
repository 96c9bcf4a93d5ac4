// Recorder: collects one rank's timeline (compute phases, collectives, counters) for a Chrome
// trace (//trace). The training job creates one per process when `--trace` is given, wraps its
// communicator in a TracingCommunicator (tracing_communicator.h) and marks phases with Scope:
//
//   auto recorder = std::make_shared<trace::Recorder>(rank);
//   recorder->SetThreadName("main");
//   { trace::Scope s(*recorder, "forward", "compute");  ... }
//   FS_RETURN_IF_ERROR(recorder->WriteChromeTrace(absl::StrCat(path, ".rank", rank)));
//
// Every event carries pid = the recorder's rank (the viewer draws one track group per rank,
// named "rank N") and tid = a small per-thread id (thread_name metadata: "main", "comm", ...).
// Timestamps are CLOCK_MONOTONIC nanoseconds (written as microseconds), plus a per-recorder
// offset (set_clock_offset_ns, see AlignClocks in tracing_communicator.h): processes on one host
// share that clock, so their traces line up without any offset.
//
// Thread-safe. Cheap when disabled: every recording method starts with one relaxed atomic load
// and returns; callers that build Args should test enabled() first (Scope does).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace fairscale::trace {

// One argument shown in the viewer's details pane ("bytes": 4096, "op": "sum").
struct Arg {
  using Value = std::variant<int64_t, double, std::string>;

  template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
  Arg(std::string k, T v) : key(std::move(k)), value(static_cast<int64_t>(v)) {}
  Arg(std::string k, double v) : key(std::move(k)), value(v) {}
  Arg(std::string k, absl::string_view v) : key(std::move(k)), value(std::string(v)) {}
  Arg(std::string k, const char* v) : key(std::move(k)), value(std::string(v)) {}
  Arg(std::string k, std::string v) : key(std::move(k)), value(std::move(v)) {}

  std::string key;
  Value value;
};

// Chrome Trace Event Format phases this library writes.
enum class Phase : char {
  kComplete = 'X',  // a span: ts + dur
  kInstant = 'i',   // a point on one thread
  kCounter = 'C',   // a value over time (args[0] is the value)
  kMetadata = 'M',  // process_name / thread_name / process_sort_index
};

struct Event {
  Phase phase = Phase::kComplete;
  std::string name;
  std::string category;  // "compute", "comm", ... (kCategory* below)
  int64_t ts_ns = 0;     // start, CLOCK_MONOTONIC + clock offset
  int64_t dur_ns = 0;    // kComplete only, >= 0
  int pid = 0;           // the rank
  int tid = 0;
  std::vector<Arg> args;

  // The integer argument `key`, or `fallback` if absent or not an integer.
  int64_t IntArg(absl::string_view key, int64_t fallback = 0) const;
  // The string argument `key`, or "" if absent or not a string.
  std::string StringArg(absl::string_view key) const;
};

// Categories the profile (profile.h) understands.
inline constexpr char kCategoryCompute[] = "compute";  // forward, backward, optimizer, ...
inline constexpr char kCategoryComm[] = "comm";        // one collective, issue -> completion
inline constexpr char kCategoryWait[] = "wait";        // a thread blocked in Work::Wait

class Recorder {
 public:
  // Records as rank `rank` (the pid of every event).
  explicit Recorder(int rank, bool enabled = true);
  Recorder(const Recorder&) = delete;
  Recorder& operator=(const Recorder&) = delete;

  int rank() const { return rank_; }
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  // Turning recording off keeps what was recorded; events in flight (a Scope open, a collective
  // issued) may still land.
  void set_enabled(bool enabled) { enabled_.store(enabled, std::memory_order_relaxed); }

  // CLOCK_MONOTONIC in nanoseconds, plus this recorder's clock offset: the timestamps of every
  // event. Use it for the start/end passed to Complete().
  int64_t Now() const;
  // Raw CLOCK_MONOTONIC in nanoseconds (same on every process of one host).
  static int64_t MonotonicNs();
  // Added to every timestamp taken by Now() from now on (set it before recording).
  void set_clock_offset_ns(int64_t offset) { clock_offset_ns_.store(offset); }
  int64_t clock_offset_ns() const { return clock_offset_ns_.load(); }

  // A small process-wide id for the calling thread (1, 2, ... in order of first use).
  static int CurrentThreadId();
  // Names the calling thread (or `tid`) in the viewer; the last name given wins. Works also when
  // disabled (names are cheap and make later events readable).
  void SetThreadName(absl::string_view name);
  void SetThreadName(int tid, absl::string_view name);

  // A span [start_ns, end_ns] (Now() values) on the calling thread, or on `tid` when >= 0.
  // end < start is recorded as a zero-length span.
  void Complete(absl::string_view name, absl::string_view category, int64_t start_ns,
                int64_t end_ns, std::vector<Arg> args = {}, int tid = -1);
  // A point in time on the calling thread.
  void Instant(absl::string_view name, absl::string_view category, std::vector<Arg> args = {});
  // A counter sample (e.g. "memory_mb", 512.0), drawn as its own track in the rank's group.
  void Counter(absl::string_view name, double value);

  // Lanes for spans that may overlap without nesting (asynchronous collectives): a span on a
  // lane never overlaps another span on that lane as long as the lane is held from the span's
  // start to its end. AcquireLane returns the tid of the lowest free lane (named "comm",
  // "comm 2", ...) and marks it busy; ReleaseLane frees it. Shared by every communicator that
  // records into this recorder. Always works (also when disabled).
  int AcquireLane();
  void ReleaseLane(int tid);

  // A copy of everything recorded: metadata first (process_name "rank N", process_sort_index,
  // thread names), then the other events sorted by (ts, tid).
  std::vector<Event> Events() const;
  // Drops the recorded events (keeps thread names).
  void Clear();

  // WriteChromeTrace(path, Events()).
  absl::Status WriteChromeTrace(const std::string& path) const;

 private:
  bool Enabled() const { return enabled_.load(std::memory_order_relaxed); }
  void Add(Event event);

  const int rank_;
  std::atomic<bool> enabled_;
  std::atomic<int64_t> clock_offset_ns_{0};

  mutable absl::Mutex mu_;
  std::vector<Event> events_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<int, std::string> thread_names_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> lanes_busy_ ABSL_GUARDED_BY(mu_);
};

// Records [construction, destruction] as a complete event on the calling thread:
//   { trace::Scope s(recorder, "backward", "compute"); ... }
// A null or disabled recorder makes it a no-op (one relaxed load, no allocation).
class Scope {
 public:
  Scope(Recorder& recorder, absl::string_view name,
        absl::string_view category = kCategoryCompute, std::vector<Arg> args = {})
      : Scope(&recorder, name, category, std::move(args)) {}
  Scope(Recorder* recorder, absl::string_view name,
        absl::string_view category = kCategoryCompute, std::vector<Arg> args = {});
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  Recorder* recorder_ = nullptr;  // null when not recording
  std::string name_;
  std::string category_;
  std::vector<Arg> args_;
  int64_t start_ns_ = 0;
};

// Base of the lane tids (AcquireLane): far from the small ids of real threads.
inline constexpr int kFirstLaneTid = 1000;

}  // namespace fairscale::trace
