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
    case Schedule::kInterleaved1F1B:
      return "interleaved";
  }
  return "unknown";
}

namespace {

// Interleaved 1F1B's warm-up forwards on `stage` (Megatron-LM): enough that the last virtual
// stage of the first round of micro-batches has run before this rank's first backward, plus
// two slots per later rank so that the forwards and backwards of different ranks interleave.
int64_t InterleavedWarmup(int64_t p, int64_t stage, int64_t m, int64_t v) {
  if (v == 1) return std::min(p - stage - 1, m);
  return std::min((v - 1) * p + 2 * (p - stage - 1), m * v);
}

// Forward (or backward) unit k of a rank under interleaved 1F1B.
Action InterleavedUnit(Phase phase, int64_t k, int64_t p, int64_t v) {
  const int64_t group = k / (p * v);
  const int64_t within = k % (p * v);
  const int64_t chunk = phase == Phase::kForward ? within / p : v - 1 - within / p;
  return {phase, group * p + within % p, chunk};
}

}  // namespace

std::string ValidateSchedule(Schedule schedule, int64_t stages, int64_t micro_batches,
                             int64_t virtual_stages) {
  if (virtual_stages < 1) return absl::StrCat("virtual stages must be >= 1, got ", virtual_stages);
  if (virtual_stages == 1) return "";
  if (schedule != Schedule::kInterleaved1F1B) {
    return absl::StrCat("virtual stages = ", virtual_stages, " needs the schedule \"",
                        ScheduleName(Schedule::kInterleaved1F1B), "\", not \"",
                        ScheduleName(schedule), "\"");
  }
  if (micro_batches % stages != 0) {
    return absl::StrCat("the interleaved schedule with ", virtual_stages,
                        " virtual stages needs chunks (micro-batches) to be a multiple of the ",
                        stages, " pipeline stages, got chunks = ", micro_batches);
  }
  return "";
}

int64_t InterleavedInFlightBound(int64_t stages, int64_t stage, int64_t micro_batches,
                                 int64_t virtual_stages) {
  const int64_t total = micro_batches * virtual_stages;
  if (virtual_stages == 1) return std::min(stages - stage, micro_batches);
  return std::min(InterleavedWarmup(stages, stage, micro_batches, virtual_stages) + 1, total);
}

std::vector<Action> MakeSchedule(Schedule schedule, int64_t stages, int64_t stage,
                                 int64_t micro_batches, int64_t virtual_stages) {
  const int64_t m = micro_batches;
  std::vector<Action> out;
  out.reserve(2 * m * virtual_stages);
  if (virtual_stages > 1) {
    const int64_t p = stages;
    const int64_t v = virtual_stages;
    const int64_t total = m * v;
    const int64_t warmup = InterleavedWarmup(p, stage, m, v);
    int64_t next_forward = 0;
    int64_t next_backward = 0;
    for (; next_forward < warmup; ++next_forward) {
      out.push_back(InterleavedUnit(Phase::kForward, next_forward, p, v));
    }
    while (next_forward < total) {
      out.push_back(InterleavedUnit(Phase::kForward, next_forward++, p, v));
      out.push_back(InterleavedUnit(Phase::kBackward, next_backward++, p, v));
    }
    while (next_backward < total) {
      out.push_back(InterleavedUnit(Phase::kBackward, next_backward++, p, v));
    }
    return out;
  }
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
  const bool chunks =
      std::any_of(actions.begin(), actions.end(), [](const Action& a) { return a.chunk != 0; });
  std::string out;
  for (const Action& a : actions) {
    absl::StrAppend(&out, out.empty() ? "" : " ", a.phase == Phase::kForward ? "F" : "B",
                    a.micro_batch);
    if (chunks) absl::StrAppend(&out, ".", a.chunk);
  }
  return out;
}

}  // namespace fairscale::pipe
