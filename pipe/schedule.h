// Pipeline schedules: the order in which one stage runs the forward and backward passes of its
// micro-batches (part of //pipe, no LibTorch). Pipe executes these lists; the schedule tests
// check them, and Pipe's trace, against the properties each schedule promises.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fairscale::pipe {

enum class Schedule {
  // All forwards (micro-batch 0..m-1), then all backwards (0..m-1). Every stage holds the
  // activations of all m micro-batches at the end of the forward phase.
  kGPipe,
  // One forward, one backward: stage s runs min(p - s - 1, m) warm-up forwards, then
  // alternates forward / backward, then drains the remaining backwards. At most p - s
  // micro-batches (forward done, backward not yet) are in flight on stage s.
  k1F1B,
};
const char* ScheduleName(Schedule schedule);  // "gpipe", "1f1b"

enum class Phase { kForward, kBackward };

struct Action {
  Phase phase = Phase::kForward;
  int64_t micro_batch = 0;
  bool operator==(const Action& o) const {
    return phase == o.phase && micro_batch == o.micro_batch;
  }
};

// The actions of `stage` (0-based) of `stages` for `micro_batches` micro-batches: every
// micro-batch's forward once, then later its backward once. Requires 0 <= stage < stages and
// micro_batches >= 1.
std::vector<Action> MakeSchedule(Schedule schedule, int64_t stages, int64_t stage,
                                 int64_t micro_batches);

// The largest number of micro-batches whose forward has run and whose backward has not, over
// the prefixes of `actions`.
int64_t MaxInFlight(const std::vector<Action>& actions);

// "F0 F1 B0 B1".
std::string DescribeActions(const std::vector<Action>& actions);

}  // namespace fairscale::pipe
