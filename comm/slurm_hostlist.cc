#include "comm/slurm_hostlist.h"

#include <cstdint>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace fairscale::comm {
namespace {

constexpr size_t kMaxDigits = 18;  // fits in int64 with room for hi - lo + 1

struct Range {
  uint64_t lo = 0;
  uint64_t hi = 0;
  size_t width = 0;  // zero-pad to this many digits (the width lo was written with)
};

// Literal text, or (when `ranges` is non-empty) a bracket group.
struct Part {
  std::string literal;
  std::vector<Range> ranges;
};

using Host = std::vector<Part>;

absl::Status Bad(absl::string_view list, size_t pos, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat(why, " at offset ", pos, " of host list '",
                   list.size() > 200 ? absl::StrCat(list.substr(0, 200), "...") : list, "'"));
}

bool IsHostChar(char c) { return absl::ascii_isalnum(c) || c == '-' || c == '.' || c == '_'; }

// Parses "lo" or "lo-hi" at list[*pos], leaving *pos after it.
absl::StatusOr<Range> ParseRange(absl::string_view list, size_t* pos) {
  auto number = [&](uint64_t* out, size_t* width) -> absl::Status {
    const size_t start = *pos;
    while (*pos < list.size() && absl::ascii_isdigit(list[*pos])) ++*pos;
    const size_t n = *pos - start;
    if (n == 0) return Bad(list, start, "expected a number in a bracket group");
    if (n > kMaxDigits) return Bad(list, start, "a number with more than 18 digits");
    if (!absl::SimpleAtoi(list.substr(start, n), out)) return Bad(list, start, "a bad number");
    *width = n;
    return absl::OkStatus();
  };
  Range r;
  size_t hi_width = 0;
  if (absl::Status s = number(&r.lo, &r.width); !s.ok()) return s;
  r.hi = r.lo;
  if (*pos < list.size() && list[*pos] == '-') {
    ++*pos;
    const size_t hi_pos = *pos;
    if (absl::Status s = number(&r.hi, &hi_width); !s.ok()) return s;
    if (r.hi < r.lo) return Bad(list, hi_pos, "a range whose end is below its start");
  }
  return r;
}

// Parses the whole list into hosts.
absl::StatusOr<std::vector<Host>> Parse(absl::string_view list) {
  if (list.empty()) return absl::InvalidArgumentError("the host list is empty");
  if (list.size() > kMaxHostListBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("the host list has ", list.size(), " bytes, more than ", kMaxHostListBytes));
  }
  std::vector<Host> hosts;
  size_t pos = 0;
  while (true) {
    Host host;
    const size_t host_start = pos;
    while (pos < list.size() && list[pos] != ',') {
      const char c = list[pos];
      if (c == '[') {
        const size_t open = pos++;
        Part group;
        while (true) {
          absl::StatusOr<Range> r = ParseRange(list, &pos);
          if (!r.ok()) return r.status();
          group.ranges.push_back(*r);
          if (pos >= list.size()) return Bad(list, open, "an unclosed '['");
          if (list[pos] == ']') break;
          if (list[pos] != ',') {
            return Bad(list, pos,
                       absl::StrCat("unexpected '", absl::CEscape(list.substr(pos, 1)),
                                    "' in a bracket group"));
          }
          ++pos;
        }
        ++pos;  // ']'
        host.push_back(std::move(group));
      } else if (IsHostChar(c)) {
        if (host.empty() || !host.back().ranges.empty()) host.emplace_back();
        host.back().literal.push_back(c);
        ++pos;
      } else {
        return Bad(list, pos,
                   c == ']' ? std::string("a ']' without '['")
                            : absl::StrCat("character '", absl::CEscape(list.substr(pos, 1)),
                                           "' cannot be in a host name"));
      }
    }
    if (host.empty()) return Bad(list, host_start, "an empty host name");
    hosts.push_back(std::move(host));
    if (pos >= list.size()) break;
    ++pos;  // ','
  }
  return hosts;
}

std::string Format(uint64_t n, size_t width) {
  std::string s = absl::StrCat(n);
  if (s.size() < width) s.insert(0, width - s.size(), '0');
  return s;
}

// Number of names `host` expands to, saturating at `cap`.
uint64_t Count(const Host& host, uint64_t cap) {
  uint64_t total = 1;
  for (const Part& p : host) {
    if (p.ranges.empty()) continue;
    uint64_t n = 0;
    for (const Range& r : p.ranges) {
      n += r.hi - r.lo + 1;  // <= 1e18 each; capped below before it can overflow
      if (n > cap) n = cap + 1;
    }
    if (n != 0 && total > cap / n) return cap + 1;
    total *= n;
  }
  return total;
}

// Appends every name of `host` from part i on, with `prefix` built so far.
void Expand(const Host& host, size_t i, std::string prefix, std::vector<std::string>* out) {
  if (i == host.size()) {
    out->push_back(std::move(prefix));
    return;
  }
  const Part& p = host[i];
  if (p.ranges.empty()) {
    Expand(host, i + 1, prefix + p.literal, out);
    return;
  }
  for (const Range& r : p.ranges) {
    for (uint64_t n = r.lo;; ++n) {
      Expand(host, i + 1, prefix + Format(n, r.width), out);
      if (n == r.hi) break;
    }
  }
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ExpandSlurmHostList(absl::string_view list,
                                                             size_t max_hosts) {
  absl::StatusOr<std::vector<Host>> hosts = Parse(list);
  if (!hosts.ok()) return hosts.status();
  uint64_t total = 0;
  for (const Host& h : *hosts) {
    total += Count(h, max_hosts);
    if (total > max_hosts) {
      return absl::InvalidArgumentError(absl::StrCat("the host list '", list.substr(0, 200),
                                                     "' names more than ", max_hosts, " hosts"));
    }
  }
  std::vector<std::string> out;
  out.reserve(total);
  for (const Host& h : *hosts) Expand(h, 0, "", &out);
  return out;
}

absl::StatusOr<std::string> FirstSlurmHost(absl::string_view list) {
  absl::StatusOr<std::vector<Host>> hosts = Parse(list);
  if (!hosts.ok()) return hosts.status();
  std::string first;
  for (const Part& p : hosts->front()) {
    first += p.ranges.empty() ? p.literal : Format(p.ranges.front().lo, p.ranges.front().width);
  }
  return first;
}

}  // namespace fairscale::comm
