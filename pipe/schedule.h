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
  // Interleaved 1F1B (Megatron-LM's interleaved schedule, PyTorch's ScheduleInterleaved1F1B):
  // each rank holds v model chunks (virtual stages); the layers are cut into p * v virtual
  // stages and virtual stage c runs on rank c % p as its local chunk c / p, so activations go
  // around the ranks v times (rank p - 1 sends to rank 0 between rounds). Rank r runs the m * v
  // (chunk, micro-batch) forwards in groups of p micro-batches: forward unit k is local chunk
  // (k / p) % v of micro-batch (k / (p v)) p + k % p; backward unit k the same with chunk
  // v - 1 - (k / p) % v. It runs w = min((v - 1) p + 2 (p - r - 1), m v) warm-up forwards, then
  // alternates forward / backward, then drains the backwards, so at most min(w + 1, m v) chunk
  // forwards (each 1/v of the rank's layers) are in flight: InterleavedInFlightBound. Requires
  // m % p == 0 when v > 1 (as Megatron). With v == 1 it is exactly k1F1B. The bubble is
  // (p - 1) / v of a micro-batch's full-model time per rank instead of p - 1.
  kInterleaved1F1B,
};
const char* ScheduleName(Schedule schedule);  // "gpipe", "1f1b", "interleaved"

enum class Phase { kForward, kBackward };

struct Action {
  Phase phase = Phase::kForward;
  int64_t micro_batch = 0;
  // The rank's local model chunk (0 <= chunk < virtual stages; virtual stage chunk * p + rank).
  int64_t chunk = 0;
  bool operator==(const Action& o) const {
    return phase == o.phase && micro_batch == o.micro_batch && chunk == o.chunk;
  }
};

// The actions of `stage` (0-based rank) of `stages` for `micro_batches` micro-batches and
// `virtual_stages` chunks per rank: every (chunk, micro-batch) forward once, then later its
// backward once. Requires 0 <= stage < stages, micro_batches >= 1, virtual_stages >= 1, and
// for virtual_stages > 1 the schedule kInterleaved1F1B and micro_batches % stages == 0
// (ValidateSchedule says so in words).
std::vector<Action> MakeSchedule(Schedule schedule, int64_t stages, int64_t stage,
                                 int64_t micro_batches, int64_t virtual_stages = 1);

// "" if MakeSchedule accepts the combination, else why not (naming the values).
std::string ValidateSchedule(Schedule schedule, int64_t stages, int64_t micro_batches,
                             int64_t virtual_stages);

// kInterleaved1F1B's bound on the chunk forwards in flight on `stage`: min(w + 1, m v) with
// w = min((v - 1) p + 2 (p - stage - 1), m v) warm-up forwards; p - stage (capped at m) for
// v == 1 (1F1B's bound).
int64_t InterleavedInFlightBound(int64_t stages, int64_t stage, int64_t micro_batches,
                                 int64_t virtual_stages);

// The largest number of (chunk, micro-batch) units whose forward has run and whose backward has
// not, over the prefixes of `actions`.
int64_t MaxInFlight(const std::vector<Action>& actions);

// "F0 F1 B0 B1"; with chunks other than 0 every action names its chunk: "F0.0 F0.1 B0.1".
std::string DescribeActions(const std::vector<Action>& actions);

}  // namespace fairscale::pipe
