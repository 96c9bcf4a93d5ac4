// Shared helpers of the conformance suite (internal to //comm/testing:conformance): test
// buffers with guard bytes, the reference values, the per-op cases, the rank runners' glue and
// the failure-test bookkeeping (observations published through the store). Used by
// conformance.cc (result cases) and conformance_failures.cc (failure cases).
#pragma once

#include <signal.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/communicator.h"
#include "comm/registry.h"
#include "comm/store/store.h"
#include "comm/testing/reference.h"
#include "comm/types.h"
#include "comm/work.h"
#include "gmock/gmock.h"
#include "comm/testing/conformance.h"

namespace fairscale::comm::testing::conformance_internal {

using ::fairscale::base::testing::StatusIs;
using ::testing::HasSubstr;

inline constexpr const auto& kDataTypes = ::fairscale::comm::testing::kAllDataTypes;
inline constexpr const auto& kReduceOps = ::fairscale::comm::testing::kAllReduceOps;
// Element counts of the small cases: empty, one element, odd, just above a power of two.
constexpr size_t kCounts[] = {0, 1, 7, 4097};
constexpr size_t kLargeCount = size_t{1} << 20;
constexpr size_t kHugeBytes = size_t{64} << 20;

// Default operation timeout of the communicators of the result tests, and how much longer than
// an operation's timeout the suite waits before it calls the backend hung.
constexpr absl::Duration kOpTimeout = absl::Seconds(30);
constexpr absl::Duration kWaitSlack = absl::Seconds(10);
// Bound of one rank body (a run of RunThreads / RunProcesses).
constexpr absl::Duration kRunTimeout = absl::Seconds(90);
// Store waits of the suite's own bookkeeping (digests, observations).
constexpr absl::Duration kStoreTimeout = absl::Seconds(30);

// Failure tests: the timeout of the operation that must fail on its own, and how soon an error
// caused by a peer (mismatch, abort, death, an op issued on a broken communicator) must surface.
constexpr absl::Duration kFailureTimeout = absl::Seconds(20);
constexpr absl::Duration kFailFast = absl::Seconds(5);
constexpr absl::Duration kBrokenFailFast = absl::Seconds(1);
constexpr absl::Duration kShortTimeout = absl::Seconds(1);
constexpr absl::Duration kShortTimeoutSlack = absl::Seconds(3);

inline std::string Fmt(absl::Duration d) { return absl::FormatDuration(d); }

// ---------------------------------------------------------------------------------------------
// Element encoding in bulk: the dtype switch is hoisted out of the loop (the 64 MiB cases encode
// tens of millions of values).

template <typename T, typename F>
inline void EncodeTyped(uint8_t* out, size_t begin, size_t end, F value) {
  T* p = reinterpret_cast<T*>(out);
  for (size_t i = begin; i < end; ++i) p[i - begin] = static_cast<T>(value(i));
}

// Writes value(i) for i in [begin, end) as elements of `dtype` starting at `out`.
template <typename F>
inline void EncodeRange(DataType dtype, uint8_t* out, size_t begin, size_t end, F value) {
  switch (dtype) {
    case DataType::kF32: return EncodeTyped<float>(out, begin, end, value);
    case DataType::kF64: return EncodeTyped<double>(out, begin, end, value);
    case DataType::kI8: return EncodeTyped<int8_t>(out, begin, end, value);
    case DataType::kU8: return EncodeTyped<uint8_t>(out, begin, end, value);
    case DataType::kI32: return EncodeTyped<int32_t>(out, begin, end, value);
    case DataType::kI64: return EncodeTyped<int64_t>(out, begin, end, value);
    case DataType::kF16:
    case DataType::kBF16:
      for (size_t i = begin; i < end; ++i) {
        EncodeValue(dtype, value(i), out + (i - begin) * SizeOf(dtype));
      }
      return;
  }
}

// ---------------------------------------------------------------------------------------------
// Buffers with guard bytes on both sides, so a backend that writes past a buffer is caught.

class TestBuffer {
 public:
  static constexpr size_t kGuard = 64;
  static constexpr uint8_t kGuardByte = 0xA5;

  TestBuffer(DataType dtype, size_t count)
      : dtype_(dtype), count_(count), storage_(count * SizeOf(dtype) + 2 * kGuard, kGuardByte) {}

  DataType dtype() const { return dtype_; }
  size_t count() const { return count_; }
  size_t bytes() const { return count_ * SizeOf(dtype_); }
  // Null when empty (the interface allows null data exactly when count is 0).
  uint8_t* data() { return count_ == 0 ? nullptr : storage_.data() + kGuard; }
  const uint8_t* data() const { return count_ == 0 ? nullptr : storage_.data() + kGuard; }
  Buffer buffer() { return {data(), count_, dtype_, Device::Cpu()}; }
  Buffer Slice(size_t offset, size_t n) {
    uint8_t* base = data();
    return {base == nullptr ? nullptr : base + offset * SizeOf(dtype_), n, dtype_, Device::Cpu()};
  }

  template <typename F>  // F(size_t i) -> long double
  void Fill(F value, size_t begin = 0, size_t end = SIZE_MAX) {
    end = std::min(end, count_);
    if (begin >= end) return;
    EncodeRange(dtype_, data() + begin * SizeOf(dtype_), begin, end, value);
  }

  bool GuardsIntact() const {
    const uint8_t* begin = storage_.data();
    const uint8_t* end = begin + storage_.size();
    for (size_t i = 0; i < kGuard; ++i) {
      if (begin[i] != kGuardByte || end[-1 - static_cast<ptrdiff_t>(i)] != kGuardByte) {
        return false;
      }
    }
    return true;
  }

 private:
  DataType dtype_;
  size_t count_;
  std::vector<uint8_t> storage_;
};

// Garbage that a correct op overwrites (recv buffers start with it).
inline long double Garbage(DataType dtype, int rank, size_t i) {
  return MovementValue(dtype, MovementKey(0xBAD, static_cast<uint64_t>(rank), i));
}

inline std::string ValueString(DataType dtype, long double v) {
  if (IsFloatingPoint(dtype)) return absl::StrFormat("%.10Lg", v);
  return absl::StrCat(static_cast<int64_t>(v));
}

// Compares elements [begin, end) of `buf` with expected(i), bit for bit. "" when equal.
template <typename F>
inline std::string CompareExact(const TestBuffer& buf, F expected, size_t begin = 0,
                         size_t end = SIZE_MAX) {
  const DataType dtype = buf.dtype();
  const size_t size = SizeOf(dtype);
  end = std::min(end, buf.count());
  const uint8_t* p = buf.data();
  // Encode the expected values a chunk at a time and memcmp whole chunks; only a chunk that
  // differs is compared element by element.
  constexpr size_t kChunk = 16384;
  std::vector<uint8_t> want(kChunk * size);
  size_t mismatches = 0, first = 0;
  long double first_want = 0;
  for (size_t c = begin; c < end; c += kChunk) {
    const size_t c_end = std::min(end, c + kChunk);
    EncodeRange(dtype, want.data(), c, c_end, expected);
    if (std::memcmp(want.data(), p + c * size, (c_end - c) * size) == 0) continue;
    for (size_t i = c; i < c_end; ++i) {
      if (std::memcmp(want.data() + (i - c) * size, p + i * size, size) != 0) {
        if (mismatches++ == 0) {
          first = i;
          first_want = expected(i);
        }
      }
    }
  }
  if (mismatches == 0) return "";
  return absl::StrCat(mismatches, " of ", end - begin, " elements differ; first at [", first,
                      "]: expected ", ValueString(dtype, first_want), ", got ",
                      ValueString(dtype, DecodeValue(dtype, p + first * size)));
}

// Like CompareExact within |got - want| <= tolerance * max(1, |want|).
template <typename F>
inline std::string CompareClose(const TestBuffer& buf, F expected, double tolerance) {
  const DataType dtype = buf.dtype();
  const size_t size = SizeOf(dtype);
  const uint8_t* p = buf.data();
  size_t mismatches = 0, first = 0;
  long double first_want = 0;
  for (size_t i = 0; i < buf.count(); ++i) {
    const long double want = expected(i);
    const long double got = DecodeValue(dtype, p + i * size);
    const long double scale = std::max<long double>(1, want < 0 ? -want : want);
    const long double diff = got - want;
    if (!(diff <= tolerance * scale && -diff <= tolerance * scale)) {  // NaN fails too
      if (mismatches++ == 0) {
        first = i;
        first_want = want;
      }
    }
  }
  if (mismatches == 0) return "";
  return absl::StrCat(mismatches, " of ", buf.count(), " elements are off by more than ",
                      tolerance, " (relative); first at [", first, "]: expected ",
                      ValueString(dtype, first_want), ", got ",
                      ValueString(dtype, DecodeValue(dtype, p + first * size)));
}

// FNV-1a style digest over 8-byte words (then the tail bytes): only compared between ranks.
inline uint64_t Digest(const uint8_t* p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull ^ n;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * 0x100000001b3ull;
    h ^= h >> 29;
  }
  for (; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

// ---------------------------------------------------------------------------------------------
// Per-rank verdicts.

// Collects the failed checks of one rank body, and digests of results that every rank must
// share; Finish() compares those across ranks through the store (independent of the backend).
class Checker {
 public:
  static constexpr size_t kMaxMessages = 12;
  static constexpr char kDigestKey[] = "fs_conformance/digests/";

  Checker(int rank, int size) : rank_(rank), size_(size) {}

  void Fail(std::string message) {
    if (messages_.size() < kMaxMessages) messages_.push_back(std::move(message));
    ++failures_;
  }
  // Fails with "<what>: <diff>" when diff is not empty.
  void Expect(absl::string_view what, const std::string& diff) {
    if (!diff.empty()) Fail(absl::StrCat(what, ": ", diff));
  }
  void ExpectGuards(absl::string_view what, const TestBuffer& buf) {
    if (!buf.GuardsIntact()) Fail(absl::StrCat(what, ": wrote outside the buffer"));
  }
  void RecordShared(absl::string_view what, const TestBuffer& buf) {
    absl::StrAppend(&digests_, what, "=", absl::Hex(Digest(buf.data(), buf.bytes())), "\n");
  }

  absl::Status Finish(Store& store) {
    FS_RETURN_IF_ERROR(store.Set(absl::StrCat(kDigestKey, rank_), digests_));
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      absl::StatusOr<std::string> got = store.Get(absl::StrCat(kDigestKey, r), kStoreTimeout);
      if (!got.ok()) return got.status();
      const std::string& theirs = *got;
      if (absl::StartsWith(theirs, kFailedMarker)) continue;  // rank r reports its own error
      if (theirs == digests_) continue;
      std::vector<absl::string_view> mine_lines = absl::StrSplit(digests_, '\n');
      std::vector<absl::string_view> their_lines = absl::StrSplit(theirs, '\n');
      for (size_t i = 0; i < std::max(mine_lines.size(), their_lines.size()); ++i) {
        absl::string_view a = i < mine_lines.size() ? mine_lines[i] : "(nothing)";
        absl::string_view b = i < their_lines.size() ? their_lines[i] : "(nothing)";
        if (a != b) {
          Fail(absl::StrCat("ranks ", rank_, " and ", r,
                            " got different bytes where every rank must get the same: ", a,
                            " here vs ", b, " on rank ", r));
          break;
        }
      }
    }
    if (failures_ == 0) return absl::OkStatus();
    return absl::InternalError(absl::StrCat(failures_, " conformance check(s) failed on rank ",
                                            rank_, "/", size_, ":\n  ",
                                            absl::StrJoin(messages_, "\n  "),
                                            failures_ > messages_.size() ? "\n  ..." : ""));
  }

  // Publishes that this rank failed, so that the others do not wait for its digests.
  static void PublishFailure(Store& store, int rank, const absl::Status& status) {
    (void)store.Set(absl::StrCat(kDigestKey, rank), absl::StrCat(kFailedMarker, status.ToString()));
  }

 private:
  static constexpr char kFailedMarker[] = "FAILED: ";
  const int rank_;
  const int size_;
  std::vector<std::string> messages_;
  size_t failures_ = 0;
  std::string digests_;
};

// Waits for `work` a little longer than the op's own timeout; errors are prefixed with `what`.
inline absl::Status Await(const Work& work, absl::string_view what, absl::Duration op_timeout = kOpTimeout) {
  const absl::Status s = work.Wait(op_timeout + kWaitSlack);
  if (s.ok()) return s;
  if (absl::StrContains(s.message(), "Work::Wait gave up")) {
    return absl::DeadlineExceededError(absl::StrCat(
        what, ": the backend did not complete the operation within its timeout (",
        Fmt(op_timeout), ") + ", Fmt(kWaitSlack), ": ", s.message()));
  }
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

inline absl::StatusOr<std::shared_ptr<Communicator>> Connect(const ConformanceParam& p,
                                                      absl::Duration timeout) {
  const CommConfig config = RankConfig(timeout);
  absl::StatusOr<std::shared_ptr<Communicator>> comm = CreateCommunicator(p.backend, config);
  if (!comm.ok()) {
    return absl::Status(comm.status().code(),
                        absl::StrCat("CreateCommunicator(\"", p.backend, "\") on rank ",
                                     config.rank, "/", config.size, ": ",
                                     comm.status().message()));
  }
  const std::shared_ptr<Communicator>& c = *comm;
  if (c == nullptr) return absl::InternalError("CreateCommunicator returned null");
  if (c->rank() != config.rank || c->size() != config.size || c->backend() != p.backend ||
      !c->status().ok()) {
    return absl::InternalError(absl::StrCat(
        "new communicator says rank ", c->rank(), "/", c->size(), " backend '", c->backend(),
        "' status ", c->status().ToString(), "; expected rank ", config.rank, "/", config.size,
        " backend '", p.backend, "' status OK"));
  }
  return comm;
}

inline void ExpectRanksOk(const std::vector<absl::Status>& statuses, int n,
                   const std::vector<int>& skip = {}) {
  ASSERT_EQ(statuses.size(), static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    if (std::find(skip.begin(), skip.end(), r) != skip.end()) continue;
    EXPECT_TRUE(statuses[r].ok()) << "rank " << r << " of " << n << ": " << statuses[r];
  }
}

// Runs `body` on every rank with a fresh communicator (default timeout kOpTimeout), then a
// barrier, then the cross-rank comparison of the recorded results.
using DataBody = std::function<absl::Status(Communicator& comm, Checker& check)>;

inline void RunResultTest(const ConformanceParam& p, const DataBody& body,
                   absl::Duration run_timeout = kRunTimeout) {
  std::vector<absl::Status> statuses = RunRanks(
      p.runner, p.world_size,
      [&](int rank) -> absl::Status {
        Store& store = *CurrentRank()->store;
        absl::StatusOr<std::shared_ptr<Communicator>> comm = Connect(p, kOpTimeout);
        if (!comm.ok()) {
          Checker::PublishFailure(store, rank, comm.status());
          return comm.status();
        }
        Checker check(rank, p.world_size);
        absl::Status s = body(**comm, check);
        if (s.ok()) s = Await((*comm)->Barrier(), "the final barrier");
        if (s.ok() && !(*comm)->status().ok()) {
          s = absl::InternalError(absl::StrCat("status() is ", (*comm)->status().ToString(),
                                               " although every operation succeeded"));
        }
        if (!s.ok()) {
          Checker::PublishFailure(store, rank, s);
          return s;
        }
        return check.Finish(store);
      },
      run_timeout);
  ExpectRanksOk(statuses, p.world_size);
}

// An argument error must come back as an already-failed Work with kInvalidArgument.
inline void ExpectInvalidArgument(Checker& check, absl::string_view what, absl::string_view op_name,
                           const Work& work) {
  if (!work.IsDone()) {
    check.Fail(absl::StrCat(what, ": returned a pending Work; argument errors must fail at once"));
  }
  const absl::Status s = work.Wait(kFailFast);
  if (s.code() != absl::StatusCode::kInvalidArgument) {
    check.Fail(absl::StrCat(what, ": expected INVALID_ARGUMENT, got ", s.ToString()));
  } else if (!absl::StrContains(s.message(), op_name)) {
    check.Fail(absl::StrCat(what, ": the message does not name the op '", op_name,
                            "': ", s.message()));
  }
}

inline std::string Describe(absl::string_view op, DataType dtype, std::optional<ReduceOp> reduce,
                     size_t count, bool in_place, std::optional<int> root = std::nullopt) {
  return absl::StrCat(op, " ", DataTypeName(dtype), reduce ? " " : "",
                      reduce ? ReduceOpName(*reduce) : "", " count=", count,
                      root ? absl::StrCat(" root=", *root) : "", in_place ? " in-place" : "");
}

// ---------------------------------------------------------------------------------------------
// Result cases. Each issues the same operations on every rank, checks this rank's result against
// the reference and returns an error only when an operation itself fails.

inline absl::Status AllReduceCase(Communicator& comm, Checker& check, DataType dtype, ReduceOp op,
                           size_t count, bool in_place) {
  const int n = comm.size(), r = comm.rank();
  const std::string what = Describe("all_reduce", dtype, op, count, in_place);
  TestBuffer send(dtype, count), recv(dtype, count);
  auto input = [&](size_t i) { return ReductionInput(dtype, op, r, i); };
  send.Fill(input);
  recv.Fill([&](size_t i) { return Garbage(dtype, r, i); });
  Buffer out = in_place ? send.buffer() : recv.buffer();
  if (op == ReduceOp::kAvg && !IsFloatingPoint(dtype)) {
    ExpectInvalidArgument(check, what, "all_reduce", comm.AllReduce(send.buffer(), out, op));
    return absl::OkStatus();
  }
  FS_RETURN_IF_ERROR(Await(comm.AllReduce(send.buffer(), out, op), what));
  TestBuffer& result = in_place ? send : recv;
  check.ExpectGuards(what, result);
  if (!in_place) check.Expect(absl::StrCat(what, " changed its send buffer"), CompareExact(send, input));
  auto expected = [&](size_t i) { return ReferenceReduction(dtype, op, n, i); };
  check.Expect(what, op == ReduceOp::kAvg ? CompareClose(result, expected, AvgTolerance(dtype))
                                          : CompareExact(result, expected));
  check.RecordShared(what, result);
  return absl::OkStatus();
}

inline absl::Status ReduceScatterCase(Communicator& comm, Checker& check, DataType dtype, ReduceOp op,
                               size_t block, bool in_place) {
  const int n = comm.size(), r = comm.rank();
  const std::string what = Describe("reduce_scatter", dtype, op, block, in_place);
  TestBuffer send(dtype, block * n), recv(dtype, block);
  auto input = [&](size_t i) { return ReductionInput(dtype, op, r, i); };
  send.Fill(input);
  recv.Fill([&](size_t i) { return Garbage(dtype, r, i); });
  Buffer out = in_place ? send.Slice(r * block, block) : recv.buffer();
  if (op == ReduceOp::kAvg && !IsFloatingPoint(dtype)) {
    ExpectInvalidArgument(check, what, "reduce_scatter",
                          comm.ReduceScatter(send.buffer(), out, op));
    return absl::OkStatus();
  }
  FS_RETURN_IF_ERROR(Await(comm.ReduceScatter(send.buffer(), out, op), what));
  auto expected = [&](size_t i) { return ReferenceReduction(dtype, op, n, r * block + i); };
  if (in_place) {
    check.ExpectGuards(what, send);
    // Only block r is defined after an in-place reduce_scatter.
    auto expected_in_place = [&](size_t i) {
      return ReferenceReduction(dtype, op, n, i);
    };
    if (op == ReduceOp::kAvg) {
      TestBuffer copy(dtype, block);
      if (block > 0) std::memcpy(copy.data(), send.data() + r * block * SizeOf(dtype), copy.bytes());
      check.Expect(what, CompareClose(copy, expected, AvgTolerance(dtype)));
    } else {
      check.Expect(what, CompareExact(send, expected_in_place, r * block, (r + 1) * block));
    }
  } else {
    check.ExpectGuards(what, recv);
    check.Expect(absl::StrCat(what, " changed its send buffer"), CompareExact(send, input));
    check.Expect(what, op == ReduceOp::kAvg ? CompareClose(recv, expected, AvgTolerance(dtype))
                                            : CompareExact(recv, expected));
  }
  return absl::OkStatus();
}

inline absl::Status ReduceCase(Communicator& comm, Checker& check, DataType dtype, ReduceOp op,
                        size_t count, bool in_place, int root) {
  const int n = comm.size(), r = comm.rank();
  const std::string what = Describe("reduce", dtype, op, count, in_place, root);
  TestBuffer send(dtype, count), recv(dtype, count);
  auto input = [&](size_t i) { return ReductionInput(dtype, op, r, i); };
  send.Fill(input);
  recv.Fill([&](size_t i) { return Garbage(dtype, r, i); });
  // Off the root, recv is ignored: pass {} as the contract says.
  Buffer out = r != root ? Buffer{} : in_place ? send.buffer() : recv.buffer();
  if (op == ReduceOp::kAvg && !IsFloatingPoint(dtype)) {
    ExpectInvalidArgument(check, what, "reduce", comm.Reduce(send.buffer(), out, op, root));
    return absl::OkStatus();
  }
  FS_RETURN_IF_ERROR(Await(comm.Reduce(send.buffer(), out, op, root), what));
  check.ExpectGuards(what, send);
  check.ExpectGuards(what, recv);
  if (r != root || !in_place) {
    check.Expect(absl::StrCat(what, " changed its send buffer"), CompareExact(send, input));
  }
  if (r != root) {
    check.Expect(absl::StrCat(what, " wrote the recv buffer of a non-root rank"),
                 CompareExact(recv, [&](size_t i) { return Garbage(dtype, r, i); }));
    return absl::OkStatus();
  }
  TestBuffer& result = in_place ? send : recv;
  auto expected = [&](size_t i) { return ReferenceReduction(dtype, op, n, i); };
  check.Expect(what, op == ReduceOp::kAvg ? CompareClose(result, expected, AvgTolerance(dtype))
                                          : CompareExact(result, expected));
  return absl::OkStatus();
}

// Block b of an all_gather result holds rank b's send buffer: MovementValue(key(b, i)).
inline long double GatherValue(DataType dtype, int salt, int rank, size_t i) {
  return MovementValue(dtype, MovementKey(salt, static_cast<uint64_t>(rank), i));
}

inline absl::Status AllGatherCase(Communicator& comm, Checker& check, DataType dtype, size_t block,
                           bool in_place, int salt) {
  const int n = comm.size(), r = comm.rank();
  const std::string what = Describe("all_gather", dtype, std::nullopt, block, in_place);
  TestBuffer send(dtype, block), recv(dtype, block * n);
  auto mine = [&](size_t i) { return GatherValue(dtype, salt, r, i); };
  recv.Fill([&](size_t i) { return Garbage(dtype, r, i); });
  ConstBuffer in;
  if (in_place) {
    recv.Fill([&](size_t i) { return mine(i - r * block); }, r * block, (r + 1) * block);
    in = recv.Slice(r * block, block);
  } else {
    send.Fill(mine);
    in = send.buffer();
  }
  FS_RETURN_IF_ERROR(Await(comm.AllGather(in, recv.buffer()), what));
  check.ExpectGuards(what, recv);
  if (!in_place) {
    check.ExpectGuards(what, send);
    check.Expect(absl::StrCat(what, " changed its send buffer"), CompareExact(send, mine));
  }
  check.Expect(what, CompareExact(recv, [&](size_t i) {
                 return GatherValue(dtype, salt, static_cast<int>(block == 0 ? 0 : i / block),
                                    block == 0 ? 0 : i % block);
               }));
  check.RecordShared(what, recv);
  return absl::OkStatus();
}

inline absl::Status BroadcastCase(Communicator& comm, Checker& check, DataType dtype, size_t count,
                           int root, int salt) {
  const int r = comm.rank();
  const std::string what = Describe("broadcast", dtype, std::nullopt, count, false, root);
  TestBuffer buf(dtype, count);
  auto root_value = [&](size_t i) { return GatherValue(dtype, salt, root, i); };
  if (r == root) {
    buf.Fill(root_value);
  } else {
    buf.Fill([&](size_t i) { return Garbage(dtype, r, i); });
  }
  FS_RETURN_IF_ERROR(Await(comm.Broadcast(buf.buffer(), root), what));
  check.ExpectGuards(what, buf);
  check.Expect(what, CompareExact(buf, root_value));
  check.RecordShared(what, buf);
  return absl::OkStatus();
}

// Element k of the block that `from` sends to `to`.
inline long double AllToAllValue(DataType dtype, int salt, int from, int to, size_t k) {
  return MovementValue(dtype, MovementKey(salt, static_cast<uint64_t>(from) * 64 + to, k));
}

inline absl::Status AllToAllCase(Communicator& comm, Checker& check, DataType dtype, size_t block,
                          int salt) {
  const int n = comm.size(), r = comm.rank();
  const std::string what =
      absl::StrCat("all_to_all ", DataTypeName(dtype), " block=", block, " count=", block * n);
  TestBuffer send(dtype, block * n), recv(dtype, block * n);
  auto sent = [&](size_t i) {
    return AllToAllValue(dtype, salt, r, static_cast<int>(i / block), i % block);
  };
  if (block > 0) send.Fill(sent);
  recv.Fill([&](size_t i) { return Garbage(dtype, r, i); });
  FS_RETURN_IF_ERROR(Await(comm.AllToAll(send.buffer(), recv.buffer()), what));
  check.ExpectGuards(what, send);
  check.ExpectGuards(what, recv);
  if (block == 0) return absl::OkStatus();
  check.Expect(absl::StrCat(what, " changed its send buffer"), CompareExact(send, sent));
  check.Expect(what, CompareExact(recv, [&](size_t i) {
                 return AllToAllValue(dtype, salt, static_cast<int>(i / block), r, i % block);
               }));
  return absl::OkStatus();
}

// The message `from` sends to `to`, element k.
inline long double P2pValue(DataType dtype, int salt, int from, int to, size_t k) {
  return AllToAllValue(dtype, salt + 1000, from, to, k);
}

// One ring step: every rank sends to rank+1 and receives from rank-1. Even ranks issue the send
// first and odd ranks the recv, an order that completes even if a send waited for its recv.
inline absl::Status RingCase(Communicator& comm, Checker& check, DataType dtype, size_t count,
                      int salt) {
  const int n = comm.size(), r = comm.rank();
  if (n == 1) return absl::OkStatus();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  const std::string what = absl::StrCat("ring send/recv ", DataTypeName(dtype), " count=", count);
  TestBuffer out(dtype, count), in(dtype, count);
  auto sent = [&](size_t k) { return P2pValue(dtype, salt, r, next, k); };
  out.Fill(sent);
  in.Fill([&](size_t i) { return Garbage(dtype, r, i); });
  Work send_work, recv_work;
  if (r % 2 == 0) {
    send_work = comm.Send(out.buffer(), next);
    recv_work = comm.Recv(in.buffer(), prev);
  } else {
    recv_work = comm.Recv(in.buffer(), prev);
    send_work = comm.Send(out.buffer(), next);
  }
  FS_RETURN_IF_ERROR(Await(send_work, absl::StrCat(what, " (send to ", next, ")")));
  FS_RETURN_IF_ERROR(Await(recv_work, absl::StrCat(what, " (recv from ", prev, ")")));
  check.ExpectGuards(what, out);
  check.ExpectGuards(what, in);
  check.Expect(absl::StrCat(what, " changed its send buffer"), CompareExact(out, sent));
  check.Expect(absl::StrCat(what, " from rank ", prev),
               CompareExact(in, [&](size_t k) { return P2pValue(dtype, salt, prev, r, k); }));
  return absl::OkStatus();
}

}  // namespace fairscale::comm::testing::conformance_internal
