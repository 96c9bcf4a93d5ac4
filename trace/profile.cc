#include "trace/profile.h"

#include <algorithm>
#include <limits>
#include <map>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "trace/chrome_trace.h"

namespace fairscale::trace {
namespace {

using Interval = std::pair<int64_t, int64_t>;  // [begin, end)

// Sorted, disjoint, non-empty intervals covering the same time as `spans`.
std::vector<Interval> Union(std::vector<Interval> spans) {
  std::sort(spans.begin(), spans.end());
  std::vector<Interval> out;
  for (const Interval& s : spans) {
    if (s.second <= s.first) continue;
    if (!out.empty() && s.first <= out.back().second) {
      out.back().second = std::max(out.back().second, s.second);
    } else {
      out.push_back(s);
    }
  }
  return out;
}

int64_t Measure(const std::vector<Interval>& u) {
  int64_t total = 0;
  for (const Interval& s : u) total += s.second - s.first;
  return total;
}

// |a ∩ b| for two outputs of Union().
int64_t IntersectionMeasure(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  int64_t total = 0;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const int64_t lo = std::max(a[i].first, b[j].first);
    const int64_t hi = std::min(a[i].second, b[j].second);
    if (hi > lo) total += hi - lo;
    if (a[i].second < b[j].second) {
      ++i;
    } else {
      ++j;
    }
  }
  return total;
}

// |a \ b| as intervals, for two outputs of Union().
std::vector<Interval> Subtract(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  std::vector<Interval> out;
  size_t j = 0;
  for (Interval cur : a) {
    while (j < b.size() && b[j].second <= cur.first) ++j;
    size_t k = j;
    while (k < b.size() && b[k].first < cur.second) {
      if (b[k].first > cur.first) out.push_back({cur.first, b[k].first});
      cur.first = std::max(cur.first, b[k].second);
      if (cur.first >= cur.second) break;
      ++k;
    }
    if (cur.first < cur.second) out.push_back(cur);
  }
  return out;
}

struct RankData {
  int64_t begin = std::numeric_limits<int64_t>::max();
  int64_t end = std::numeric_limits<int64_t>::min();
  std::vector<Interval> compute;
  std::vector<Interval> comm;
  std::vector<Interval> wait;
  std::map<std::string, CollectiveStat> ops;
  int64_t bytes = 0;
  int64_t collectives = 0;
};

double Percent(int64_t part, int64_t whole) {
  return whole > 0 ? 100.0 * static_cast<double>(part) / static_cast<double>(whole) : 0.0;
}

double Ms(int64_t ns) { return static_cast<double>(ns) / 1e6; }
double MiB(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

void SortOps(std::vector<CollectiveStat>& ops) {
  std::sort(ops.begin(), ops.end(), [](const CollectiveStat& a, const CollectiveStat& b) {
    return std::make_tuple(-a.total_ns, -a.bytes, a.name) <
           std::make_tuple(-b.total_ns, -b.bytes, b.name);
  });
}

}  // namespace

std::vector<ProfileSummary> Summarize(const std::vector<Event>& events) {
  std::map<int, RankData> ranks;
  for (const Event& e : events) {
    if (e.phase != Phase::kComplete) continue;
    RankData& r = ranks[e.pid];
    const Interval span{e.ts_ns, e.ts_ns + std::max<int64_t>(0, e.dur_ns)};
    r.begin = std::min(r.begin, span.first);
    r.end = std::max(r.end, span.second);
    if (e.category == kCategoryCompute) r.compute.push_back(span);
    if (e.category == kCategoryWait) r.wait.push_back(span);
    if (e.category == kCategoryComm) {
      r.comm.push_back(span);
      const int64_t bytes = e.IntArg("bytes");
      CollectiveStat& op = r.ops[e.name];
      op.name = e.name;
      ++op.count;
      op.total_ns += span.second - span.first;
      op.bytes += bytes;
      r.bytes += bytes;
      ++r.collectives;
    }
  }
  std::vector<ProfileSummary> out;
  for (auto& [pid, r] : ranks) {
    ProfileSummary s;
    s.rank = pid;
    s.wall_ns = r.end - r.begin;
    const std::vector<Interval> wait = Union(std::move(r.wait));
    const std::vector<Interval> compute = Subtract(Union(std::move(r.compute)), wait);
    const std::vector<Interval> comm = Union(std::move(r.comm));
    s.wait_ns = Measure(wait);
    s.compute_ns = Measure(compute);
    s.comm_ns = Measure(comm);
    s.comm_overlapped_ns = IntersectionMeasure(comm, compute);
    s.comm_exposed_ns = s.comm_ns - s.comm_overlapped_ns;
    s.idle_ns = s.wall_ns - s.compute_ns - s.comm_exposed_ns;
    s.bytes = r.bytes;
    s.collectives = r.collectives;
    for (auto& [name, op] : r.ops) s.by_op.push_back(op);
    SortOps(s.by_op);
    out.push_back(std::move(s));
  }
  return out;
}

absl::StatusOr<std::vector<ProfileSummary>> SummarizeTraceFile(const std::string& path) {
  absl::StatusOr<std::vector<Event>> events = ReadChromeTrace(path);
  if (!events.ok()) return events.status();
  return Summarize(*events);
}

std::string FormatProfileTable(const std::vector<ProfileSummary>& summaries, int top) {
  std::string out = absl::StrFormat("%4s %10s %9s %7s %9s %7s %11s %10s\n", "rank", "wall ms",
                                    "compute %", "comm %", "overlap %", "idle %", "collectives",
                                    "MiB");
  std::map<std::string, CollectiveStat> totals;
  for (const ProfileSummary& s : summaries) {
    absl::StrAppendFormat(&out, "%4d %10.3f %9.1f %7.1f %9.1f %7.1f %11d %10.3f\n", s.rank,
                          Ms(s.wall_ns), Percent(s.compute_ns, s.wall_ns),
                          Percent(s.comm_exposed_ns, s.wall_ns),
                          Percent(s.comm_overlapped_ns, s.wall_ns), Percent(s.idle_ns, s.wall_ns),
                          s.collectives, MiB(s.bytes));
    for (const CollectiveStat& op : s.by_op) {
      CollectiveStat& t = totals[op.name];
      t.name = op.name;
      t.count += op.count;
      t.total_ns += op.total_ns;
      t.bytes += op.bytes;
    }
  }
  if (totals.empty() || top <= 0) return out;
  std::vector<CollectiveStat> ops;
  for (auto& [name, op] : totals) ops.push_back(op);
  SortOps(ops);
  absl::StrAppendFormat(&out, "\ntop collectives (all ranks, issue -> completion)\n");
  absl::StrAppendFormat(&out, "%-16s %7s %10s %10s\n", "op", "count", "total ms", "MiB");
  for (size_t i = 0; i < ops.size() && i < static_cast<size_t>(top); ++i) {
    absl::StrAppendFormat(&out, "%-16s %7d %10.3f %10.3f\n", ops[i].name, ops[i].count,
                          Ms(ops[i].total_ns), MiB(ops[i].bytes));
  }
  return out;
}

}  // namespace fairscale::trace
