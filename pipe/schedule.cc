#include "pipe/schedule.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace fairscale::pipe {

const char* ScheduleName(Schedule schedule) {
  switch (schedule) {
    case Schedule::kGPipe:
      return "gpipe";
    case Schedule::k1F1B:
      return "1f1b";
  }
  return "unknown";
}

std::vector<Action> MakeSchedule(Schedule schedule, int64_t stages, int64_t stage,
                                 int64_t micro_batches) {
  const int64_t m = micro_batches;
  std::vector<Action> out;
  out.reserve(2 * m);
  if (schedule == Schedule::kGPipe) {
    for (int64_t i = 0; i < m; ++i) out.push_back({Phase::kForward, i});
    for (int64_t i = 0; i < m; ++i) out.push_back({Phase::kBackward, i});
    return out;
  }
  // 1F1B. Stage s needs p - s - 1 forwards ahead of its first backward so that the pipeline
  // is full when the last stage starts its backwards; after that each backward frees the slot
  // that the next forward takes.
  const int64_t warmup = std::min(stages - stage - 1, m);
  int64_t next_forward = 0;
  int64_t next_backward = 0;
  for (; next_forward < warmup; ++next_forward) out.push_back({Phase::kForward, next_forward});
  while (next_forward < m) {
    out.push_back({Phase::kForward, next_forward++});
    out.push_back({Phase::kBackward, next_backward++});
  }
  while (next_backward < m) out.push_back({Phase::kBackward, next_backward++});
  return out;
}

int64_t MaxInFlight(const std::vector<Action>& actions) {
  int64_t in_flight = 0;
  int64_t peak = 0;
  for (const Action& a : actions) {
    in_flight += a.phase == Phase::kForward ? 1 : -1;
    peak = std::max(peak, in_flight);
  }
  return peak;
}

std::string DescribeActions(const std::vector<Action>& actions) {
  std::string out;
  for (const Action& a : actions) {
    absl::StrAppend(&out, out.empty() ? "" : " ", a.phase == Phase::kForward ? "F" : "B",
                    a.micro_batch);
  }
  return out;
}

}  // namespace fairscale::pipe
