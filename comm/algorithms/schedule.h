// Schedule: one rank's point-to-point plan for one collective, and RunSchedule, which executes
// it over a Transport (internal to //comm/algorithms). Every algorithm of this package builds a
// Schedule and runs it, so posting, pipelining, scratch management and the deadlock rules live
// here once.
//
// A Schedule is a list of steps. A step may send one message and/or receive one message (and
// then reduce it). RunSchedule posts sends in step order as soon as their input is ready, keeps
// a few receives posted ahead of the one it waits for (so consecutive segments overlap), and
// receives into at most `slots` scratch slots of `slot_bytes` each.
//
// Rules a builder follows, so that all ranks agree and nobody deadlocks even on a rendezvous
// transport (where a send completes only once the receiver has posted the receive):
// * Between any two ranks, both sides list their messages in the same order (the transport
//   matches them in order).
// * A send that forwards received data names that receive in `send_after`; data only flows from
//   earlier steps to later ones.
// * A scratch slot is written by the receive of its own step and may be read by later steps; it
//   is free once every step that reads it is done. `slots` must exceed the number of received
//   slots that can wait for their forwarding send at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "comm/algorithms/algorithms.h"
#include "comm/types.h"

namespace fairscale::comm::algo {

// Memory a step reads or writes: a fixed address, or the scratch slot of an earlier (or the
// same) step's receive.
// Builders only ever name caller-writable memory (or scratch) as a destination, so Loc keeps a
// plain char* for both directions.
struct Loc {
  char* ptr = nullptr;
  int slot_of = -1;  // step index; -1 = use ptr

  static Loc At(const void* p) { return {const_cast<char*>(static_cast<const char*>(p)), -1}; }
  static Loc SlotOf(int step) { return {nullptr, step}; }
  bool is_slot() const { return slot_of >= 0; }
};

struct Step {
  // Send `send_bytes` from `send_src` to `send_peer` (-1: no send), once the receive of step
  // `send_after` (-1: none) has completed and been reduced.
  int send_peer = -1;
  size_t send_bytes = 0;
  Loc send_src;
  int send_after = -1;

  // Receive `recv_bytes` from `recv_peer` (-1: no receive) into `recv_dst`, which is a fixed
  // address or Loc::SlotOf(this step).
  int recv_peer = -1;
  size_t recv_bytes = 0;
  Loc recv_dst;

  // Then, if `reduce`: reduce_out = reduce_a (op) received, element-wise.
  bool reduce = false;
  Loc reduce_out;
  Loc reduce_a;

  // Tag of this step's messages; 0 = the operation's (Context::tag). Batched send/recv gives
  // each item its own per-peer tag.
  uint64_t tag = 0;
};

struct Schedule {
  std::vector<Step> steps;
  int slots = 0;
  size_t slot_bytes = 0;
  ReduceOp op = ReduceOp::kSum;
  DataType dtype = DataType::kU8;

  int Add(const Step& step) {
    steps.push_back(step);
    return static_cast<int>(steps.size()) - 1;
  }
};

// Runs `schedule` to completion: every send completed, every receive completed and reduced.
// kInternal for a schedule that breaks the rules above.
absl::Status RunSchedule(const Schedule& schedule, const Context& ctx);

// ---- Layout helpers shared by the builders.

// n blocks of a buffer, in elements.
struct Blocks {
  std::vector<size_t> offset;
  std::vector<size_t> length;

  // n blocks of `block_count` elements each.
  static Blocks Equal(int n, size_t block_count);
  // `count` elements split into n blocks whose lengths differ by at most one.
  static Blocks Balanced(int n, size_t count);
};

// Elements per pipeline segment (at least 1).
size_t SegmentElems(const Context& ctx, DataType dtype);
// Segments of a run of `count` elements: at least one (so a zero-length run still sends one
// zero-byte message and a rank that disagrees about the count hears about it).
size_t NumSegments(size_t count, size_t segment_elems);

inline int Mod(int a, int n) { return ((a % n) + n) % n; }

}  // namespace fairscale::comm::algo
