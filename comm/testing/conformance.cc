#include "comm/testing/conformance.h"

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

namespace fairscale::comm::testing {
namespace {

using ::fairscale::base::testing::StatusIs;
using ::testing::HasSubstr;

constexpr DataType kDataTypes[] = {DataType::kF32, DataType::kF64, DataType::kF16,
                                   DataType::kBF16, DataType::kI8, DataType::kU8,
                                   DataType::kI32, DataType::kI64};
constexpr ReduceOp kReduceOps[] = {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin,
                                   ReduceOp::kMax, ReduceOp::kAvg};
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

std::string Fmt(absl::Duration d) { return absl::FormatDuration(d); }

// ---------------------------------------------------------------------------------------------
// Element encoding in bulk: the dtype switch is hoisted out of the loop (the 64 MiB cases encode
// tens of millions of values).

template <typename T, typename F>
void EncodeTyped(uint8_t* out, size_t begin, size_t end, F value) {
  T* p = reinterpret_cast<T*>(out);
  for (size_t i = begin; i < end; ++i) p[i - begin] = static_cast<T>(value(i));
}

// Writes value(i) for i in [begin, end) as elements of `dtype` starting at `out`.
template <typename F>
void EncodeRange(DataType dtype, uint8_t* out, size_t begin, size_t end, F value) {
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
long double Garbage(DataType dtype, int rank, size_t i) {
  return MovementValue(dtype, MovementKey(0xBAD, static_cast<uint64_t>(rank), i));
}

std::string ValueString(DataType dtype, long double v) {
  if (IsFloatingPoint(dtype)) return absl::StrFormat("%.10Lg", v);
  return absl::StrCat(static_cast<int64_t>(v));
}

// Compares elements [begin, end) of `buf` with expected(i), bit for bit. "" when equal.
template <typename F>
std::string CompareExact(const TestBuffer& buf, F expected, size_t begin = 0,
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
std::string CompareClose(const TestBuffer& buf, F expected, double tolerance) {
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
uint64_t Digest(const uint8_t* p, size_t n) {
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
absl::Status Await(const Work& work, absl::string_view what, absl::Duration op_timeout = kOpTimeout) {
  const absl::Status s = work.Wait(op_timeout + kWaitSlack);
  if (s.ok()) return s;
  if (absl::StrContains(s.message(), "Work::Wait gave up")) {
    return absl::DeadlineExceededError(absl::StrCat(
        what, ": the backend did not complete the operation within its timeout (",
        Fmt(op_timeout), ") + ", Fmt(kWaitSlack), ": ", s.message()));
  }
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

absl::StatusOr<std::shared_ptr<Communicator>> Connect(const ConformanceParam& p,
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

void ExpectRanksOk(const std::vector<absl::Status>& statuses, int n,
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

void RunResultTest(const ConformanceParam& p, const DataBody& body,
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
void ExpectInvalidArgument(Checker& check, absl::string_view what, absl::string_view op_name,
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

std::string Describe(absl::string_view op, DataType dtype, std::optional<ReduceOp> reduce,
                     size_t count, bool in_place, std::optional<int> root = std::nullopt) {
  return absl::StrCat(op, " ", DataTypeName(dtype), reduce ? " " : "",
                      reduce ? ReduceOpName(*reduce) : "", " count=", count,
                      root ? absl::StrCat(" root=", *root) : "", in_place ? " in-place" : "");
}

// ---------------------------------------------------------------------------------------------
// Result cases. Each issues the same operations on every rank, checks this rank's result against
// the reference and returns an error only when an operation itself fails.

absl::Status AllReduceCase(Communicator& comm, Checker& check, DataType dtype, ReduceOp op,
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

absl::Status ReduceScatterCase(Communicator& comm, Checker& check, DataType dtype, ReduceOp op,
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

absl::Status ReduceCase(Communicator& comm, Checker& check, DataType dtype, ReduceOp op,
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
long double GatherValue(DataType dtype, int salt, int rank, size_t i) {
  return MovementValue(dtype, MovementKey(salt, static_cast<uint64_t>(rank), i));
}

absl::Status AllGatherCase(Communicator& comm, Checker& check, DataType dtype, size_t block,
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

absl::Status BroadcastCase(Communicator& comm, Checker& check, DataType dtype, size_t count,
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
long double AllToAllValue(DataType dtype, int salt, int from, int to, size_t k) {
  return MovementValue(dtype, MovementKey(salt, static_cast<uint64_t>(from) * 64 + to, k));
}

absl::Status AllToAllCase(Communicator& comm, Checker& check, DataType dtype, size_t block,
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
long double P2pValue(DataType dtype, int salt, int from, int to, size_t k) {
  return AllToAllValue(dtype, salt + 1000, from, to, k);
}

// One ring step: every rank sends to rank+1 and receives from rank-1. Even ranks issue the send
// first and odd ranks the recv, an order that completes even if a send waited for its recv.
absl::Status RingCase(Communicator& comm, Checker& check, DataType dtype, size_t count,
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

// ---------------------------------------------------------------------------------------------
// Observations of failure tests, shared through the store so that one rank can check
// properties that involve several ranks (e.g. "some rank next to the mismatch names its peer").

struct Observation {
  absl::Status status;
  absl::Duration elapsed;
};

constexpr char kObservationKey[] = "fs_conformance/observation/";

absl::Status PublishObservation(Store& store, int rank, const Observation& o) {
  return store.Set(absl::StrCat(kObservationKey, rank),
                   absl::StrCat(static_cast<int>(o.status.code()), "\n",
                                absl::ToInt64Nanoseconds(o.elapsed), "\n", o.status.message()));
}

absl::StatusOr<Observation> ReadObservation(Store& store, int rank) {
  FS_ASSIGN_OR_RETURN(std::string v, store.Get(absl::StrCat(kObservationKey, rank),
                                               kStoreTimeout));
  std::vector<std::string> parts = absl::StrSplit(v, absl::MaxSplits('\n', 2));
  int code = 0;
  int64_t ns = 0;
  if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &code) ||
      !absl::SimpleAtoi(parts[1], &ns)) {
    return absl::InternalError(absl::StrCat("bad observation of rank ", rank, ": ", v));
  }
  return Observation{absl::Status(static_cast<absl::StatusCode>(code), parts[2]),
                     absl::Nanoseconds(ns)};
}

// Publishes this rank's observation exactly once: if the body returns before it observed
// anything (e.g. setup failed), a placeholder goes out so that the other ranks do not wait for it.
// Every rank's published observation (waiting for those not yet published).
absl::StatusOr<std::vector<std::optional<Observation>>> ReadAllObservations(Store& store, int n) {
  std::vector<std::optional<Observation>> all(n);
  for (int r = 0; r < n; ++r) {
    FS_ASSIGN_OR_RETURN(all[r], ReadObservation(store, r));
  }
  return all;
}

class ObservationPublisher {
 public:
  ObservationPublisher(Store& store, int rank) : store_(store), rank_(rank) {}
  ~ObservationPublisher() {
    if (!published_) {
      (void)PublishObservation(
          store_, rank_,
          {absl::InternalError(absl::StrCat("rank ", rank_,
                                            " ended before it observed the failure (see its "
                                            "own status)")),
           absl::ZeroDuration()});
    }
  }
  absl::Status Publish(const Observation& o) {
    published_ = true;
    return PublishObservation(store_, rank_, o);
  }

 private:
  Store& store_;
  const int rank_;
  bool published_ = false;
};

std::string DescribeObservations(const std::vector<std::optional<Observation>>& all) {
  std::string out;
  for (size_t r = 0; r < all.size(); ++r) {
    if (!all[r]) continue;
    absl::StrAppend(&out, "\n    rank ", r, " after ", Fmt(all[r]->elapsed), ": ",
                    all[r]->status.ToString());
  }
  return out;
}

bool Names(const absl::Status& s, absl::string_view text) {
  return absl::StrContains(s.message(), text);
}

std::string PeerName(int peer) { return absl::StrCat("peer ", peer); }

bool IsPeerFailureCode(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kAborted;
}

// After `first` failed an operation, the communicator must stay broken: status() reports the
// error and a later operation fails fast with it. Returns the problems found ("" when none).
std::string CheckBroken(Communicator& comm, const absl::Status& first) {
  const absl::Status st = comm.status();
  if (st.ok()) {
    return absl::StrCat("status() is OK after an operation failed with ", first.ToString());
  }
  std::string problems;
  if (st.code() != first.code()) {
    absl::StrAppend(&problems, "status() is ", st.ToString(), " but the failed op reported ",
                    first.ToString(), "; ");
  }
  const absl::Time start = absl::Now();
  const absl::Status later = comm.Barrier().Wait(kFailFast + kWaitSlack);
  const absl::Duration elapsed = absl::Now() - start;
  if (later.ok()) {
    absl::StrAppend(&problems, "a barrier issued after the failure succeeded; ");
  } else {
    if (later.code() != st.code()) {
      absl::StrAppend(&problems, "a barrier issued after the failure failed with ",
                      later.ToString(), " instead of status() ", st.ToString(), "; ");
    }
    if (elapsed > kBrokenFailFast) {
      absl::StrAppend(&problems, "a barrier issued after the failure took ", Fmt(elapsed),
                      " to fail (limit ", Fmt(kBrokenFailFast), "); ");
    }
  }
  return problems;
}

// Connects, runs a barrier, then waits (through the store, not the backend) until every rank's
// barrier has completed: an error of the op under test breaks the communicator, and a rank still
// finishing the barrier would see the barrier fail too ("every pending operation fails").
absl::StatusOr<std::shared_ptr<Communicator>> ConnectAndSync(const ConformanceParam& p,
                                                             Store& store, int rank, int n) {
  FS_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm, Connect(p, kFailureTimeout));
  FS_RETURN_IF_ERROR(Await(comm->Barrier(), "the barrier before the test", kFailureTimeout));
  FS_RETURN_IF_ERROR(store.Set(absl::StrCat("fs_conformance/ready/", rank), "1"));
  std::vector<std::string> keys;
  for (int r = 0; r < n; ++r) keys.push_back(absl::StrCat("fs_conformance/ready/", r));
  FS_RETURN_IF_ERROR(store.Wait(keys, kStoreTimeout));
  return comm;
}

// Collects a failure test's problems on one rank and turns them into the rank's verdict.
class Problems {
 public:
  void Add(std::string p) {
    if (!p.empty()) list_.push_back(std::move(p));
  }
  absl::Status Verdict(int rank, const std::optional<Observation>& mine,
                       const std::vector<std::optional<Observation>>& all) const {
    if (list_.empty()) return absl::OkStatus();
    return absl::InternalError(absl::StrCat(
        "rank ", rank, ": ", absl::StrJoin(list_, "; "),
        mine ? absl::StrCat("\n  this rank observed after ", Fmt(mine->elapsed), ": ",
                            mine->status.ToString())
             : "",
        all.empty() ? "" : absl::StrCat("\n  all ranks observed:", DescribeObservations(all))));
  }

 private:
  std::vector<std::string> list_;
};

// Problems of an op that a peer made fail (mismatch, abort, death): it must fail well before
// its timeout, with a code in `codes`, naming the op and a peer.
void CheckPeerCausedFailure(Problems& problems, const Observation& o, absl::string_view op,
                            absl::Duration limit,
                            const std::vector<absl::StatusCode>& codes) {
  if (o.status.ok()) {
    problems.Add(absl::StrCat("the ", op, " succeeded but had to fail"));
    return;
  }
  if (std::find(codes.begin(), codes.end(), o.status.code()) == codes.end()) {
    std::vector<std::string> names;
    for (absl::StatusCode c : codes) names.push_back(absl::StatusCodeToString(c));
    problems.Add(absl::StrCat("expected ", absl::StrJoin(names, " or "), ", got ",
                              absl::StatusCodeToString(o.status.code())));
  }
  if (o.elapsed > limit) {
    problems.Add(absl::StrCat("took ", Fmt(o.elapsed), " to fail (limit ", Fmt(limit), ")"));
  }
  if (!Names(o.status, op)) problems.Add(absl::StrCat("the message does not name the op '", op, "'"));
  if (!Names(o.status, "peer ")) problems.Add("the message does not name a peer");
}

// A rank that issues `op` after its peers failed (they timed out or aborted). That op may still
// complete: a peer may have sent everything this rank needed before it failed, and its failure
// notice queues behind that data. Then the next operation must fail. Either way the failure must
// come fast, with UNAVAILABLE or ABORTED naming a peer: the peers told this rank (or closed
// their connections); it must not wait for its own timeout.
Observation CheckLateOp(Problems& problems, Communicator& comm, absl::string_view what,
                        const std::function<Work()>& issue) {
  const absl::Time start = absl::Now();
  Observation o{issue().Wait(kFailureTimeout + kWaitSlack), absl::Duration()};
  o.elapsed = absl::Now() - start;
  std::string failed_op(what);
  if (o.status.ok()) {
    const absl::Time next = absl::Now();
    o.status = comm.Barrier().Wait(kFailureTimeout + kWaitSlack);
    o.elapsed = absl::Now() - next;
    failed_op = absl::StrCat("the barrier after ", what);
    if (o.status.ok()) {
      problems.Add(absl::StrCat(what, " and the barrier after it both succeeded although the "
                                      "peers had failed; they must tell this rank"));
      return o;
    }
  }
  if (!IsPeerFailureCode(o.status.code()) || o.elapsed > kFailFast ||
      !Names(o.status, "peer ")) {
    problems.Add(absl::StrCat(failed_op, " failed after ", Fmt(o.elapsed), " with ",
                              o.status.ToString(), "; expected UNAVAILABLE or ABORTED naming a "
                              "peer within ",
                              Fmt(kFailFast)));
  }
  problems.Add(CheckBroken(comm, o.status));
  return o;
}

enum class Mismatch { kCountSmall, kCountLarge, kOp };

void RunMismatchTest(const ConformanceParam& p, Mismatch kind) {
  const int n = p.world_size;
  // The mismatched rank is 1. Small counts stay under every "one exchange" threshold; large ones
  // go through the pipelined algorithms.
  const size_t count = kind == Mismatch::kCountLarge ? (size_t{1} << 18) : 4 * n;
  std::vector<absl::Status> statuses = RunRanks(
      p.runner, n,
      [&](int rank) -> absl::Status {
        Store& store = *CurrentRank()->store;
        ObservationPublisher publisher(store, rank);
        FS_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm,
                            ConnectAndSync(p, store, rank, n));
        std::vector<float> send(count + 1, 1.0f), recv(n * (count + 1), 0.0f);
        std::string op = "all_reduce";
        const absl::Time start = absl::Now();
        Work work;
        if (kind == Mismatch::kOp && rank == 1) {
          op = "all_gather";  // same byte count per rank as the others' all_reduce
          work = comm->AllGather(MakeConstBuffer(send.data(), count / n),
                                 MakeBuffer(recv.data(), count));
        } else {
          const size_t c = (kind != Mismatch::kOp && rank == 1) ? count + 1 : count;
          work = comm->AllReduce(MakeConstBuffer(send.data(), c), MakeBuffer(recv.data(), c),
                                 ReduceOp::kSum);
        }
        Observation mine{work.Wait(kFailureTimeout + kWaitSlack), absl::Duration()};
        mine.elapsed = absl::Now() - start;
        Problems problems;
        CheckPeerCausedFailure(problems, mine, op, kFailFast,
                               {absl::StatusCode::kInvalidArgument,
                                absl::StatusCode::kUnavailable, absl::StatusCode::kAborted});
        if (!mine.status.ok()) problems.Add(CheckBroken(*comm, mine.status));
        FS_RETURN_IF_ERROR(publisher.Publish(mine));
        FS_ASSIGN_OR_RETURN(std::vector<std::optional<Observation>> all,
                            ReadAllObservations(store, n));
        if (rank == 0) {
          // Someone next to the mismatch must say so: rank 1 naming a peer, or a peer of rank 1
          // naming it.
          bool adjacent = false;
          for (int r = 0; r < n; ++r) {
            const absl::Status& s = all[r]->status;
            if (s.code() != absl::StatusCode::kInvalidArgument) continue;
            if (r == 1 ? Names(s, "peer ") : Names(s, PeerName(1))) adjacent = true;
          }
          if (!adjacent) {
            problems.Add("no rank reported INVALID_ARGUMENT naming the peer across the mismatch "
                         "(rank 1 naming a peer, or another rank naming peer 1)");
          }
          if (n == 2 && kind == Mismatch::kCountSmall) {
            for (int r = 0; r < 2; ++r) {
              const absl::Status& s = all[r]->status;
              if (s.code() != absl::StatusCode::kInvalidArgument || !Names(s, PeerName(1 - r))) {
                problems.Add(absl::StrCat("with 2 ranks both are next to the mismatch, but rank ",
                                          r, " did not report INVALID_ARGUMENT naming ",
                                          PeerName(1 - r)));
              }
            }
          }
        }
        return problems.Verdict(rank, mine, rank == 0 ? all : decltype(all){});
      },
      kRunTimeout);
  ExpectRanksOk(statuses, n);
}

// ---------------------------------------------------------------------------------------------
// CommConformance: results.

TEST_P(CommConformance, AllReduce) {
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    for (DataType dtype : kDataTypes) {
      for (ReduceOp op : kReduceOps) {
        for (size_t count : kCounts) {
          for (bool in_place : {false, true}) {
            FS_RETURN_IF_ERROR(AllReduceCase(comm, check, dtype, op, count, in_place));
          }
        }
      }
    }
    return absl::OkStatus();
  });
}

TEST_P(CommConformance, ReduceScatter) {
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    for (DataType dtype : kDataTypes) {
      for (ReduceOp op : kReduceOps) {
        for (size_t block : kCounts) {
          for (bool in_place : {false, true}) {
            FS_RETURN_IF_ERROR(ReduceScatterCase(comm, check, dtype, op, block, in_place));
          }
        }
      }
    }
    return absl::OkStatus();
  });
}

TEST_P(CommConformance, Reduce) {
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    const int n = comm.size();
    int case_index = 0;
    // Every dtype x op x count x layout, the root rotating over the ranks...
    for (DataType dtype : kDataTypes) {
      for (ReduceOp op : kReduceOps) {
        for (size_t count : kCounts) {
          for (bool in_place : {false, true}) {
            FS_RETURN_IF_ERROR(
                ReduceCase(comm, check, dtype, op, count, in_place, case_index++ % n));
          }
        }
      }
    }
    // ...and every root for a few.
    for (int root = 0; root < n; ++root) {
      FS_RETURN_IF_ERROR(ReduceCase(comm, check, DataType::kF32, ReduceOp::kSum, 7, false, root));
      FS_RETURN_IF_ERROR(ReduceCase(comm, check, DataType::kI8, ReduceOp::kMax, 4097, true, root));
      FS_RETURN_IF_ERROR(
          ReduceCase(comm, check, DataType::kBF16, ReduceOp::kAvg, 4097, false, root));
    }
    return absl::OkStatus();
  });
}

TEST_P(CommConformance, AllGather) {
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    int salt = 0;
    for (DataType dtype : kDataTypes) {
      for (size_t block : kCounts) {
        for (bool in_place : {false, true}) {
          FS_RETURN_IF_ERROR(AllGatherCase(comm, check, dtype, block, in_place, ++salt));
        }
      }
    }
    return absl::OkStatus();
  });
}

TEST_P(CommConformance, Broadcast) {
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    int salt = 0;
    for (int root = 0; root < comm.size(); ++root) {
      for (DataType dtype : kDataTypes) {
        for (size_t count : kCounts) {
          FS_RETURN_IF_ERROR(BroadcastCase(comm, check, dtype, count, root, ++salt));
        }
      }
    }
    return absl::OkStatus();
  });
}

TEST_P(CommConformance, AllToAll) {
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    int salt = 0;
    for (DataType dtype : kDataTypes) {
      for (size_t block : kCounts) {
        FS_RETURN_IF_ERROR(AllToAllCase(comm, check, dtype, block, ++salt));
      }
    }
    return absl::OkStatus();
  });
}

TEST_P(CommConformance, SendRecvRing) {
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    int salt = 0;
    for (DataType dtype : kDataTypes) {
      for (size_t count : kCounts) {
        FS_RETURN_IF_ERROR(RingCase(comm, check, dtype, count, ++salt));
      }
    }
    // Several messages in flight to the same peer arrive in issue order.
    const int n = comm.size(), r = comm.rank();
    if (n == 1) return absl::OkStatus();
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    struct Msg {
      DataType dtype;
      size_t count;
    };
    const Msg msgs[] = {{DataType::kI32, 7}, {DataType::kF64, 4097}, {DataType::kU8, 0},
                        {DataType::kF16, 1}, {DataType::kI32, 7}};
    constexpr int kBurstSalt = 500;
    std::vector<std::unique_ptr<TestBuffer>> outs, ins;
    std::vector<Work> sends, recvs;
    for (size_t m = 0; m < std::size(msgs); ++m) {
      outs.push_back(std::make_unique<TestBuffer>(msgs[m].dtype, msgs[m].count));
      ins.push_back(std::make_unique<TestBuffer>(msgs[m].dtype, msgs[m].count));
      outs[m]->Fill([&](size_t k) { return P2pValue(msgs[m].dtype, kBurstSalt + m, r, next, k); });
      ins[m]->Fill([&](size_t k) { return Garbage(msgs[m].dtype, r, k); });
    }
    auto issue_sends = [&] {
      for (auto& b : outs) sends.push_back(comm.Send(b->buffer(), next));
    };
    auto issue_recvs = [&] {
      for (auto& b : ins) recvs.push_back(comm.Recv(b->buffer(), prev));
    };
    if (r % 2 == 0) {
      issue_sends();
      issue_recvs();
    } else {
      issue_recvs();
      issue_sends();
    }
    for (size_t m = 0; m < std::size(msgs); ++m) {
      FS_RETURN_IF_ERROR(Await(sends[m], absl::StrCat("burst send #", m, " to ", next)));
      FS_RETURN_IF_ERROR(Await(recvs[m], absl::StrCat("burst recv #", m, " from ", prev)));
    }
    for (size_t m = 0; m < std::size(msgs); ++m) {
      const std::string what = absl::StrCat("burst message #", m, " from rank ", prev);
      check.ExpectGuards(what, *ins[m]);
      check.Expect(what, CompareExact(*ins[m], [&](size_t k) {
                     return P2pValue(msgs[m].dtype, kBurstSalt + m, prev, r, k);
                   }));
    }
    return absl::OkStatus();
  });
}

TEST_P(CommConformance, SendRecvPairwise) {
  // Every pair (a, b), a < b, exchanges a message each way, the pairs taken in one global order:
  // a issues its send then its recv, b its recv then its send (an order that completes even if a
  // send waited for its recv). Everything is issued before anything is waited for.
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    const int n = comm.size(), r = comm.rank();
    struct Op {
      std::unique_ptr<TestBuffer> buf;
      Work work;
      int peer = 0;
      bool is_recv = false;
      int salt = 0;
    };
    std::vector<Op> ops;
    const std::pair<DataType, size_t> rounds[] = {
        {DataType::kI32, 7}, {DataType::kF64, 4097}, {DataType::kBF16, 1}, {DataType::kU8, 0}};
    int salt = 0;
    for (const auto& [dtype, count] : rounds) {
      ++salt;
      for (int a = 0; a < n; ++a) {
        for (int b = a + 1; b < n; ++b) {
          if (r != a && r != b) continue;
          Op send, recv;
          send.peer = recv.peer = r == a ? b : a;
          send.salt = recv.salt = salt;
          recv.is_recv = true;
          send.buf = std::make_unique<TestBuffer>(dtype, count);
          send.buf->Fill([&](size_t k) { return P2pValue(dtype, salt, r, send.peer, k); });
          recv.buf = std::make_unique<TestBuffer>(dtype, count);
          recv.buf->Fill([&](size_t k) { return Garbage(dtype, r, k); });
          if (r == a) {
            send.work = comm.Send(send.buf->buffer(), send.peer);
            recv.work = comm.Recv(recv.buf->buffer(), recv.peer);
          } else {
            recv.work = comm.Recv(recv.buf->buffer(), recv.peer);
            send.work = comm.Send(send.buf->buffer(), send.peer);
          }
          ops.push_back(std::move(send));
          ops.push_back(std::move(recv));
        }
      }
    }
    for (const Op& op : ops) {
      FS_RETURN_IF_ERROR(Await(op.work, absl::StrCat("pairwise ", op.is_recv ? "recv from " : "send to ",
                                                     op.peer, " (", DataTypeName(op.buf->dtype()),
                                                     " count=", op.buf->count(), ")")));
    }
    for (const Op& op : ops) {
      const DataType dtype = op.buf->dtype();
      const std::string what = absl::StrCat("pairwise ", op.is_recv ? "recv from " : "send to ",
                                            op.peer, " ", DataTypeName(dtype),
                                            " count=", op.buf->count());
      check.ExpectGuards(what, *op.buf);
      const int from = op.is_recv ? op.peer : r;
      const int to = op.is_recv ? r : op.peer;
      check.Expect(what, CompareExact(*op.buf, [&](size_t k) {
                     return P2pValue(dtype, op.salt, from, to, k);
                   }));
    }
    return absl::OkStatus();
  });
}

// A receive buffer of a point-to-point test and what it must hold afterwards.
struct ExpectedMessage {
  std::unique_ptr<TestBuffer> buf;
  int from = 0;
  int salt = 0;
};

void CheckMessages(Checker& check, absl::string_view label, int rank,
                   const std::vector<ExpectedMessage>& msgs) {
  for (const ExpectedMessage& m : msgs) {
    const DataType dtype = m.buf->dtype();
    const std::string what = absl::StrCat(label, ": ", DataTypeName(dtype), " count=",
                                          m.buf->count(), " from rank ", m.from);
    check.ExpectGuards(what, *m.buf);
    check.Expect(what, CompareExact(*m.buf, [&](size_t k) {
                   return P2pValue(dtype, m.salt, m.from, rank, k);
                 }));
  }
}

TEST_P(CommConformance, BatchP2P) {
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    const int n = comm.size(), r = comm.rank();
    std::vector<float> a(64, 1.0f), b(64, 0.0f);
    Work empty = comm.BatchP2P({});
    if (!empty.IsDone() || !empty.Wait(kFailFast).ok()) {
      check.Fail("an empty BatchP2P must be done at once with OK");
    }
    ExpectInvalidArgument(check, "batch_p2p item sending to itself", "batch_p2p",
                          comm.BatchP2P({P2POp::Send(MakeConstBuffer(a.data(), 8), r)}));
    if (n > 1) {
      const int peer = (r + 1) % n;
      ExpectInvalidArgument(check, "batch_p2p with overlapping recv items", "batch_p2p",
                            comm.BatchP2P({P2POp::Recv(MakeBuffer(b.data(), 8), peer),
                                           P2POp::Recv(MakeBuffer(b.data() + 4, 8), peer)}));
    }
    if (n == 1) return absl::OkStatus();

    // 1. One batch per rank: two or more messages to and from every other rank, every send
    // listed before every receive (as plain Sends and Recvs this would wait until the timeout
    // on a rendezvous transport). Per peer, the items match in order.
    const std::pair<DataType, size_t> rounds[] = {{DataType::kF32, kLargeCount},
                                                  {DataType::kI8, 7},
                                                  {DataType::kBF16, 0},
                                                  {DataType::kI64, 4097}};
    std::vector<std::unique_ptr<TestBuffer>> outs;
    std::vector<ExpectedMessage> ins;
    std::vector<P2POp> sends, recvs;
    int salt = 100;
    for (const auto& [dtype, count] : rounds) {
      ++salt;
      for (int peer = 0; peer < n; ++peer) {
        if (peer == r) continue;
        outs.push_back(std::make_unique<TestBuffer>(dtype, count));
        outs.back()->Fill([&](size_t k) { return P2pValue(dtype, salt, r, peer, k); });
        sends.push_back(P2POp::Send(outs.back()->buffer(), peer));
        ExpectedMessage in{std::make_unique<TestBuffer>(dtype, count), peer, salt};
        in.buf->Fill([&](size_t k) { return Garbage(dtype, r, k); });
        recvs.push_back(P2POp::Recv(in.buf->buffer(), peer));
        ins.push_back(std::move(in));
      }
    }
    std::vector<P2POp> all = sends;
    all.insert(all.end(), recvs.begin(), recvs.end());
    FS_RETURN_IF_ERROR(Await(comm.BatchP2P(all), "batch_p2p all-pairs exchange"));
    CheckMessages(check, "batch_p2p all-pairs exchange", r, ins);
    for (size_t i = 0; i < outs.size(); ++i) check.ExpectGuards("batch_p2p send buffer", *outs[i]);

    // 2. A batch on one side matches plain Send/Recv on the other. Pairs (a, b), a < b, in one
    // global order: a posts {send to b, recv from b} as a batch, b a plain Send then Recv.
    // Everything is issued before anything is waited for.
    std::vector<std::unique_ptr<TestBuffer>> mixed_outs;
    std::vector<ExpectedMessage> mixed_ins;
    std::vector<Work> works;
    const int mixed_salt = 200;
    for (int a_rank = 0; a_rank < n; ++a_rank) {
      for (int b_rank = a_rank + 1; b_rank < n; ++b_rank) {
        if (r != a_rank && r != b_rank) continue;
        const int peer = r == a_rank ? b_rank : a_rank;
        const DataType dtype = DataType::kF64;
        const size_t count = 4097;
        mixed_outs.push_back(std::make_unique<TestBuffer>(dtype, count));
        mixed_outs.back()->Fill([&](size_t k) { return P2pValue(dtype, mixed_salt, r, peer, k); });
        ExpectedMessage in{std::make_unique<TestBuffer>(dtype, count), peer, mixed_salt};
        in.buf->Fill([&](size_t k) { return Garbage(dtype, r, k); });
        if (r == a_rank) {
          works.push_back(comm.BatchP2P({P2POp::Send(mixed_outs.back()->buffer(), peer),
                                         P2POp::Recv(in.buf->buffer(), peer)}));
        } else {
          works.push_back(comm.Send(mixed_outs.back()->buffer(), peer));
          works.push_back(comm.Recv(in.buf->buffer(), peer));
        }
        mixed_ins.push_back(std::move(in));
      }
    }
    for (size_t i = 0; i < works.size(); ++i) {
      FS_RETURN_IF_ERROR(Await(works[i], absl::StrCat("batch_p2p against plain send/recv, op #",
                                                      i)));
    }
    CheckMessages(check, "batch_p2p against plain send/recv", r, mixed_ins);
    return absl::OkStatus();
  });
}

TEST_P(CommConformance, Barrier) {
  // A barrier may complete on a rank only after every rank entered it. Each round one rank enters
  // late; entry times go through the store (one clock: the ranks share a machine).
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    const int n = comm.size(), r = comm.rank();
    Store& store = *CurrentRank()->store;
    constexpr int kRounds = 3;
    std::vector<absl::Time> exits(kRounds);
    for (int round = 0; round < kRounds; ++round) {
      if (r == round % n) absl::SleepFor(absl::Milliseconds(200));
      const absl::Time enter = absl::Now();
      FS_RETURN_IF_ERROR(store.Set(absl::StrCat("fs_conformance/barrier/", round, "/", r),
                                   absl::StrCat(absl::ToUnixNanos(enter))));
      FS_RETURN_IF_ERROR(Await(comm.Barrier(), absl::StrCat("barrier round ", round)));
      exits[round] = absl::Now();
    }
    for (int round = 0; round < kRounds; ++round) {
      for (int q = 0; q < n; ++q) {
        FS_ASSIGN_OR_RETURN(std::string v,
                            store.Get(absl::StrCat("fs_conformance/barrier/", round, "/", q),
                                      kStoreTimeout));
        int64_t ns = 0;
        if (!absl::SimpleAtoi(v, &ns)) return absl::InternalError("bad barrier entry time");
        const absl::Time entered = absl::FromUnixNanos(ns);
        if (exits[round] < entered) {
          check.Fail(absl::StrCat("barrier round ", round, " completed on rank ", r, " ",
                                  Fmt(entered - exits[round]), " before rank ", q,
                                  " entered it"));
        }
      }
    }
    return absl::OkStatus();
  });
}

// all_reduce (i64 sum) and all_gather (i32) in a child whose ranks are `members` (old ranks in
// child rank order), then a child barrier.
absl::Status CheckChild(Communicator& child, const std::vector<int>& members, int old_rank,
                        Checker& check, absl::string_view label) {
  const int64_t q = old_rank;
  std::vector<int64_t> sum = {q + 1, 1000 * (q + 1), -(q + 1)};
  FS_RETURN_IF_ERROR(Await(child.AllReduce(MakeConstBuffer(sum.data(), sum.size()),
                                           MakeBuffer(sum.data(), sum.size()), ReduceOp::kSum),
                           absl::StrCat(label, ": child all_reduce")));
  int64_t want = 0;
  for (int m : members) want += m + 1;
  if (sum != std::vector<int64_t>{want, 1000 * want, -want}) {
    check.Fail(absl::StrCat(label, ": child all_reduce gave {", absl::StrJoin(sum, ", "),
                            "}, expected {", want, ", ", 1000 * want, ", ", -want, "}"));
  }
  int32_t mine = old_rank;
  std::vector<int32_t> gathered(members.size(), -1);
  FS_RETURN_IF_ERROR(Await(child.AllGather(MakeConstBuffer(&mine, 1),
                                           MakeBuffer(gathered.data(), gathered.size())),
                           absl::StrCat(label, ": child all_gather")));
  if (!std::equal(gathered.begin(), gathered.end(), members.begin(), members.end())) {
    check.Fail(absl::StrCat(label, ": the child's ranks hold old ranks {",
                            absl::StrJoin(gathered, ", "), "}, expected {",
                            absl::StrJoin(members, ", "), "}"));
  }
  return Await(child.Barrier(), absl::StrCat(label, ": child barrier"));
}

// An all_reduce on the parent communicator.
absl::Status CheckParent(Communicator& comm, Checker& check, absl::string_view label) {
  const int n = comm.size(), r = comm.rank();
  std::vector<int32_t> v = {r + 1, 2 * (r + 1)};
  FS_RETURN_IF_ERROR(Await(comm.AllReduce(MakeConstBuffer(v.data(), 2), MakeBuffer(v.data(), 2),
                                          ReduceOp::kSum),
                           label));
  const int32_t want = n * (n + 1) / 2;
  if (v[0] != want || v[1] != 2 * want) {
    check.Fail(absl::StrCat(label, ": got {", v[0], ", ", v[1], "}, expected {", want, ", ",
                            2 * want, "}"));
  }
  return absl::OkStatus();
}

absl::Status CheckSplit(Communicator& comm, Checker& check, int color, int key,
                        const std::vector<int>& members, absl::string_view label) {
  const int r = comm.rank();
  absl::StatusOr<std::shared_ptr<Communicator>> split = comm.Split(color, key);
  if (!split.ok()) {
    return absl::Status(split.status().code(),
                        absl::StrCat(label, ": Split(", color, ", ", key, "): ",
                                     split.status().message()));
  }
  std::shared_ptr<Communicator> child = *std::move(split);
  if (color < 0) {
    if (child != nullptr) {
      check.Fail(absl::StrCat(label, ": Split(kNoColor) returned a communicator, not nullptr"));
    }
    return CheckParent(comm, check, absl::StrCat(label, ": parent all_reduce after the split"));
  }
  if (child == nullptr) {
    check.Fail(absl::StrCat(label, ": Split(", color, ", ", key, ") returned nullptr"));
    return CheckParent(comm, check, absl::StrCat(label, ": parent all_reduce after the split"));
  }
  const int want_rank =
      static_cast<int>(std::find(members.begin(), members.end(), r) - members.begin());
  if (child->size() != static_cast<int>(members.size()) || child->rank() != want_rank) {
    check.Fail(absl::StrCat(label, ": child of old rank ", r, " is rank ", child->rank(), "/",
                            child->size(), ", expected ", want_rank, "/", members.size(),
                            " (members in order: ", absl::StrJoin(members, ", "), ")"));
    // The child's layout is wrong: running collectives on it could pair the wrong ranks.
    return CheckParent(comm, check, absl::StrCat(label, ": parent all_reduce after the split"));
  }
  if (child->backend() != comm.backend()) {
    check.Fail(absl::StrCat(label, ": child backend '", child->backend(), "'"));
  }
  FS_RETURN_IF_ERROR(CheckChild(*child, members, r, check, label));
  // Parent and child are independent; the parent op also orders every rank's child work before
  // any rank destroys its child.
  FS_RETURN_IF_ERROR(CheckParent(comm, check, absl::StrCat(label, ": parent all_reduce")));
  if (!child->status().ok()) {
    check.Fail(absl::StrCat(label, ": child status() ", child->status().ToString()));
  }
  return absl::OkStatus();
}

TEST_P(CommConformance, Split) {
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    const int n = comm.size(), r = comm.rank();
    // color = rank % 2, key = -rank: each child lists its old ranks in descending order.
    std::vector<int> parity;
    for (int q = n - 1; q >= 0; --q) {
      if (q % 2 == r % 2) parity.push_back(q);
    }
    FS_RETURN_IF_ERROR(CheckSplit(comm, check, r % 2, -r, parity, "split by parity"));
    // Rank 0 leaves (kNoColor); the others keep their order (key = rank).
    std::vector<int> rest;
    for (int q = 1; q < n; ++q) rest.push_back(q);
    FS_RETURN_IF_ERROR(
        CheckSplit(comm, check, r == 0 ? kNoColor : 7, r, rest, "split without rank 0"));
    // One color and equal keys: ordered by old rank.
    std::vector<int> all;
    for (int q = 0; q < n; ++q) all.push_back(q);
    FS_RETURN_IF_ERROR(CheckSplit(comm, check, 0, 0, all, "split into one group"));
    return CheckParent(comm, check, "parent all_reduce after every child is gone");
  });
}

TEST_P(CommConformance, InvalidArguments) {
  // Argument errors are rank-local: every rank passes the same bad arguments, gets an
  // already-failed Work with kInvalidArgument, and the communicator stays usable.
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    const int n = comm.size(), r = comm.rank();
    std::vector<float> a(64, 1.0f), b(64, 0.0f);
    std::vector<int32_t> ia(64, 1), ib(64, 0);
    const ConstBuffer a8 = MakeConstBuffer(a.data(), 8);
    ExpectInvalidArgument(check, "all_reduce with send count 8, recv count 7", "all_reduce",
                          comm.AllReduce(a8, MakeBuffer(b.data(), 7), ReduceOp::kSum));
    ExpectInvalidArgument(check, "all_reduce f32 -> i32", "all_reduce",
                          comm.AllReduce(a8, MakeBuffer(ib.data(), 8), ReduceOp::kSum));
    ExpectInvalidArgument(check, "all_reduce i32 avg", "all_reduce",
                          comm.AllReduce(MakeConstBuffer(ia.data(), 8), MakeBuffer(ib.data(), 8),
                                         ReduceOp::kAvg));
    ExpectInvalidArgument(check, "all_reduce partially overlapping", "all_reduce",
                          comm.AllReduce(a8, MakeBuffer(a.data() + 4, 8), ReduceOp::kSum));
    ExpectInvalidArgument(check, "all_reduce null send with count 3", "all_reduce",
                          comm.AllReduce(ConstBuffer(nullptr, 3, DataType::kF32),
                                         MakeBuffer(b.data(), 3), ReduceOp::kSum));
    ExpectInvalidArgument(check, "all_reduce invalid dtype", "all_reduce",
                          comm.AllReduce(ConstBuffer(a.data(), 8, static_cast<DataType>(99)),
                                         Buffer{b.data(), 8, static_cast<DataType>(99)},
                                         ReduceOp::kSum));
    ExpectInvalidArgument(check, "all_reduce invalid op", "all_reduce",
                          comm.AllReduce(a8, MakeBuffer(b.data(), 8), static_cast<ReduceOp>(42)));
    ExpectInvalidArgument(check, "broadcast root == size", "broadcast",
                          comm.Broadcast(MakeBuffer(b.data(), 8), n));
    ExpectInvalidArgument(check, "broadcast root -1", "broadcast",
                          comm.Broadcast(MakeBuffer(b.data(), 8), -1));
    ExpectInvalidArgument(check, "reduce root == size", "reduce",
                          comm.Reduce(a8, MakeBuffer(b.data(), 8), ReduceOp::kSum, n));
    ExpectInvalidArgument(
        check, "reduce_scatter send count size*4+1", "reduce_scatter",
        comm.ReduceScatter(MakeConstBuffer(a.data(), n * 4 + 1), MakeBuffer(b.data(), 4),
                           ReduceOp::kSum));
    ExpectInvalidArgument(check, "all_gather recv count size*4+1", "all_gather",
                          comm.AllGather(MakeConstBuffer(a.data(), 4),
                                         MakeBuffer(b.data(), n * 4 + 1)));
    if (n > 1) {
      // send overlaps recv but is not block `rank` of it.
      const int wrong = (r + 1) % n;
      ExpectInvalidArgument(check, "all_gather with a wrong in-place layout", "all_gather",
                            comm.AllGather(MakeConstBuffer(b.data() + wrong * 4, 4),
                                           MakeBuffer(b.data(), n * 4)));
      ExpectInvalidArgument(check, "all_to_all count not divisible by size", "all_to_all",
                            comm.AllToAll(MakeConstBuffer(a.data(), n * 2 + 1),
                                          MakeBuffer(b.data(), n * 2 + 1)));
    }
    ExpectInvalidArgument(check, "all_to_all in place", "all_to_all",
                          comm.AllToAll(MakeConstBuffer(a.data(), n * 2),
                                        MakeBuffer(a.data(), n * 2)));
    ExpectInvalidArgument(check, "send to itself", "send", comm.Send(a8, r));
    ExpectInvalidArgument(check, "send to rank -1", "send", comm.Send(a8, -1));
    ExpectInvalidArgument(check, "recv from rank size", "recv",
                          comm.Recv(MakeBuffer(b.data(), 8), n));
    if (!comm.SupportsDevice(Device::Cuda(0))) {
      Buffer cuda = MakeBuffer(b.data(), 8);
      cuda.device = Device::Cuda(0);
      ExpectInvalidArgument(check, "broadcast of an unsupported device buffer", "broadcast",
                            comm.Broadcast(cuda, 0));
    }
    if (!comm.status().ok()) {
      check.Fail(absl::StrCat("argument errors broke the communicator: status() ",
                              comm.status().ToString()));
    }
    return CheckParent(comm, check, "all_reduce after the argument errors");
  });
}

TEST_P(CommConformance, LargeMessages) {
  // 1<<20 elements (1-8 MiB) for one representative case per operation.
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    const int n = comm.size();
    const size_t block = kLargeCount / n;
    FS_RETURN_IF_ERROR(AllReduceCase(comm, check, DataType::kF32, ReduceOp::kSum, kLargeCount,
                                     false));
    FS_RETURN_IF_ERROR(AllReduceCase(comm, check, DataType::kBF16, ReduceOp::kMax, kLargeCount,
                                     true));
    FS_RETURN_IF_ERROR(AllReduceCase(comm, check, DataType::kI64, ReduceOp::kProduct,
                                     kLargeCount, false));
    FS_RETURN_IF_ERROR(AllReduceCase(comm, check, DataType::kF16, ReduceOp::kAvg, kLargeCount,
                                     false));
    FS_RETURN_IF_ERROR(ReduceScatterCase(comm, check, DataType::kF64, ReduceOp::kSum, block,
                                         false));
    FS_RETURN_IF_ERROR(ReduceScatterCase(comm, check, DataType::kI32, ReduceOp::kMin, block,
                                         true));
    FS_RETURN_IF_ERROR(AllGatherCase(comm, check, DataType::kI8, block, false, 1));
    FS_RETURN_IF_ERROR(AllGatherCase(comm, check, DataType::kF32, block, true, 2));
    FS_RETURN_IF_ERROR(BroadcastCase(comm, check, DataType::kU8, kLargeCount, n - 1, 3));
    FS_RETURN_IF_ERROR(AllToAllCase(comm, check, DataType::kI32, block, 4));
    FS_RETURN_IF_ERROR(ReduceCase(comm, check, DataType::kF32, ReduceOp::kMin, kLargeCount,
                                  false, 0));
    FS_RETURN_IF_ERROR(ReduceCase(comm, check, DataType::kI64, ReduceOp::kSum, kLargeCount,
                                  true, n - 1));
    return RingCase(comm, check, DataType::kF32, kLargeCount, 5);
  });
}

TEST_P(CommConformance, HugeMessages) {
  // One 64 MiB message each for all_reduce and all_gather (f32).
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    const size_t count = kHugeBytes / sizeof(float);
    FS_RETURN_IF_ERROR(AllReduceCase(comm, check, DataType::kF32, ReduceOp::kSum, count, false));
    return AllGatherCase(comm, check, DataType::kF32, count / comm.size(), false, 6);
  });
}

// ---------------------------------------------------------------------------------------------
// CommFailureConformance: errors reach every rank, in time, and leave the communicator broken.

TEST_P(CommFailureConformance, CountMismatchSmall) {
  RunMismatchTest(GetParam(), Mismatch::kCountSmall);
}

TEST_P(CommFailureConformance, CountMismatchLarge) {
  RunMismatchTest(GetParam(), Mismatch::kCountLarge);
}

TEST_P(CommFailureConformance, OpMismatch) { RunMismatchTest(GetParam(), Mismatch::kOp); }

TEST_P(CommFailureConformance, Timeout) {
  // The last rank never issues the all_reduce (1 s timeout) that the others issue.
  const ConformanceParam& p = GetParam();
  const int n = p.world_size;
  const int skipper = n - 1;
  std::vector<absl::Status> statuses = RunRanks(
      p.runner, n,
      [&](int rank) -> absl::Status {
        Store& store = *CurrentRank()->store;
        ObservationPublisher publisher(store, rank);
        FS_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm,
                            ConnectAndSync(p, store, rank, n));
        std::vector<float> buf(1024, 1.0f);
        const ConstBuffer in = MakeConstBuffer(buf.data(), buf.size());
        const Buffer out = MakeBuffer(buf.data(), buf.size());
        Problems problems;
        std::vector<std::optional<Observation>> all(n);
        Observation mine;
        if (rank != skipper) {
          OpOptions opts;
          opts.timeout = kShortTimeout;
          const absl::Time start = absl::Now();
          Work work = comm->AllReduce(in, out, ReduceOp::kSum, opts);
          mine.status = work.Wait(kShortTimeout + kWaitSlack);
          mine.elapsed = absl::Now() - start;
          const absl::Status& s = mine.status;
          if (s.ok()) {
            problems.Add(absl::StrCat("the all_reduce succeeded although rank ", skipper,
                                      " never issued it"));
          } else {
            if (s.code() == absl::StatusCode::kDeadlineExceeded) {
              if (mine.elapsed < kShortTimeout - absl::Milliseconds(50)) {
                problems.Add(absl::StrCat("timed out after ", Fmt(mine.elapsed),
                                          ", before its timeout of ", Fmt(kShortTimeout)));
              }
              if (!Names(s, "all_reduce")) problems.Add("the message does not name the op");
              if (!Names(s, "peer ")) {
                problems.Add("the message does not name the peer it was waiting for");
              }
            } else if (s.code() == absl::StatusCode::kUnavailable) {
              // A peer that timed out first and told this rank.
              if (!Names(s, "peer ")) problems.Add("the message does not name a peer");
            } else {
              problems.Add(absl::StrCat("expected DEADLINE_EXCEEDED (or UNAVAILABLE from a peer "
                                        "that timed out first), got ",
                                        absl::StatusCodeToString(s.code())));
            }
            if (mine.elapsed > kShortTimeout + kShortTimeoutSlack) {
              problems.Add(absl::StrCat("took ", Fmt(mine.elapsed), " to fail; the timeout is ",
                                        Fmt(kShortTimeout), " (slack ",
                                        Fmt(kShortTimeoutSlack), ")"));
            }
            problems.Add(CheckBroken(*comm, s));
          }
          FS_RETURN_IF_ERROR(publisher.Publish(mine));
          for (int r = 0; r < n; ++r) {
            FS_ASSIGN_OR_RETURN(all[r], ReadObservation(store, r));
          }
        } else {
          // Once the others gave up, this rank must learn of it (CheckLateOp).
          for (int r = 0; r < n; ++r) {
            if (r == skipper) continue;
            FS_ASSIGN_OR_RETURN(all[r], ReadObservation(store, r));
          }
          mine = CheckLateOp(problems, *comm, "the skipped all_reduce issued late", [&] {
            return comm->AllReduce(in, out, ReduceOp::kSum);
          });
          FS_RETURN_IF_ERROR(publisher.Publish(mine));
          all[rank] = mine;
        }
        if (rank == 0) {
          bool any_deadline = false;
          for (int r = 0; r < n; ++r) {
            if (r != skipper && all[r]->status.code() == absl::StatusCode::kDeadlineExceeded) {
              any_deadline = true;
            }
          }
          if (!any_deadline) problems.Add("no rank reported DEADLINE_EXCEEDED");
          if (n == 2 && (all[0]->status.code() != absl::StatusCode::kDeadlineExceeded ||
                         !Names(all[0]->status, PeerName(1)))) {
            problems.Add("rank 0 must report DEADLINE_EXCEEDED naming peer 1, the rank it was "
                         "waiting for");
          }
        }
        return problems.Verdict(rank, mine, rank == 0 ? all : decltype(all){});
      },
      kRunTimeout);
  ExpectRanksOk(statuses, n);
}

TEST_P(CommFailureConformance, Abort) {
  // Rank 0 aborts from another thread while its all_reduce is pending (the last rank has not
  // issued it yet); the ranks in between have it pending too; the last rank issues it once they
  // all saw theirs fail.
  const ConformanceParam& p = GetParam();
  const int n = p.world_size;
  const int late = n - 1;
  constexpr absl::Duration kAbortDelay = absl::Milliseconds(300);
  std::vector<absl::Status> statuses = RunRanks(
      p.runner, n,
      [&](int rank) -> absl::Status {
        Store& store = *CurrentRank()->store;
        ObservationPublisher publisher(store, rank);
        FS_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm,
                            ConnectAndSync(p, store, rank, n));
        std::vector<float> buf(1024, 1.0f);
        const ConstBuffer in = MakeConstBuffer(buf.data(), buf.size());
        const Buffer out = MakeBuffer(buf.data(), buf.size());
        Problems problems;
        Observation mine;
        if (rank == 0) {
          const absl::Time start = absl::Now();
          Work work = comm->AllReduce(in, out, ReduceOp::kSum);
          absl::Time abort_time;
          std::thread aborter([&] {
            absl::SleepFor(kAbortDelay);
            abort_time = absl::Now();
            comm->Abort(absl::CancelledError("test"));
          });
          mine.status = work.Wait(kFailureTimeout + kWaitSlack);
          const absl::Time done = absl::Now();
          aborter.join();
          mine.elapsed = done - start;
          if (mine.status.code() != absl::StatusCode::kCancelled ||
              !Names(mine.status, "test")) {
            problems.Add(absl::StrCat("the pending all_reduce of the aborting rank must fail "
                                      "with the abort reason CANCELLED: test, got ",
                                      mine.status.ToString()));
          }
          if (done - abort_time > kFailFast) {
            problems.Add(absl::StrCat("the pending all_reduce failed ", Fmt(done - abort_time),
                                      " after Abort()"));
          }
          if (!mine.status.ok()) problems.Add(CheckBroken(*comm, mine.status));
          // Abort is idempotent: a second reason does not replace the first.
          comm->Abort(absl::InternalError("second abort"));
          if (comm->status().code() != absl::StatusCode::kCancelled) {
            problems.Add(absl::StrCat("after a second Abort() status() is ",
                                      comm->status().ToString()));
          }
        } else {
          if (rank == late) {
            // Only once every other rank has seen its op fail: before that, data this rank
            // sends could still complete theirs (rank 0 sent its part before aborting).
            for (int r = 0; r < n; ++r) {
              if (r == late) continue;
              FS_RETURN_IF_ERROR(ReadObservation(store, r).status());
            }
            mine = CheckLateOp(problems, *comm, "an all_reduce issued after rank 0 aborted",
                               [&] { return comm->AllReduce(in, out, ReduceOp::kSum); });
          } else {
            const absl::Time start = absl::Now();
            Work work = comm->AllReduce(in, out, ReduceOp::kSum);
            mine.status = work.Wait(kFailureTimeout + kWaitSlack);
            mine.elapsed = absl::Now() - start;
            CheckPeerCausedFailure(problems, mine, "all_reduce", kAbortDelay + kFailFast,
                                   {absl::StatusCode::kUnavailable, absl::StatusCode::kAborted});
            if (!mine.status.ok()) problems.Add(CheckBroken(*comm, mine.status));
          }
        }
        FS_RETURN_IF_ERROR(publisher.Publish(mine));
        FS_ASSIGN_OR_RETURN(std::vector<std::optional<Observation>> all,
                            ReadAllObservations(store, n));
        return problems.Verdict(rank, mine, rank == 0 ? all : decltype(all){});
      },
      kRunTimeout);
  ExpectRanksOk(statuses, n);
}

TEST_P(CommFailureConformance, AbortWithPendingReceives) {
  // Every rank r waits in Recv from rank r+1 (mod n) and nothing is in flight; rank 0 aborts.
  // Every peer must be told, including those that wait on another rank.
  const ConformanceParam& p = GetParam();
  const int n = p.world_size;
  constexpr absl::Duration kAbortDelay = absl::Milliseconds(300);
  std::vector<absl::Status> statuses = RunRanks(
      p.runner, n,
      [&](int rank) -> absl::Status {
        Store& store = *CurrentRank()->store;
        ObservationPublisher publisher(store, rank);
        FS_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm,
                            ConnectAndSync(p, store, rank, n));
        std::vector<float> buf(16, 0.0f);
        Problems problems;
        Observation mine;
        const absl::Time start = absl::Now();
        Work work = comm->Recv(MakeBuffer(buf.data(), buf.size()), (rank + 1) % n);
        if (rank == 0) {
          absl::Time abort_time;
          std::thread aborter([&] {
            absl::SleepFor(kAbortDelay);
            abort_time = absl::Now();
            comm->Abort(absl::CancelledError("test"));
          });
          mine.status = work.Wait(kFailureTimeout + kWaitSlack);
          const absl::Time done = absl::Now();
          aborter.join();
          mine.elapsed = done - start;
          if (mine.status.code() != absl::StatusCode::kCancelled ||
              !Names(mine.status, "test")) {
            problems.Add(absl::StrCat("the pending recv of the aborting rank must fail with the "
                                      "abort reason CANCELLED: test, got ",
                                      mine.status.ToString()));
          }
          if (done - abort_time > kFailFast) {
            problems.Add(absl::StrCat("the pending recv failed ", Fmt(done - abort_time),
                                      " after Abort()"));
          }
        } else {
          mine.status = work.Wait(kFailureTimeout + kWaitSlack);
          mine.elapsed = absl::Now() - start;
          CheckPeerCausedFailure(problems, mine, "recv", kAbortDelay + kFailFast,
                                 {absl::StatusCode::kUnavailable, absl::StatusCode::kAborted});
        }
        if (!mine.status.ok()) problems.Add(CheckBroken(*comm, mine.status));
        FS_RETURN_IF_ERROR(publisher.Publish(mine));
        FS_ASSIGN_OR_RETURN(std::vector<std::optional<Observation>> all,
                            ReadAllObservations(store, n));
        return problems.Verdict(rank, mine, rank == 0 ? all : decltype(all){});
      },
      kRunTimeout);
  ExpectRanksOk(statuses, n);
}

TEST_P(CommFailureConformance, PeerKilled) {
  const ConformanceParam& p = GetParam();
  if (p.runner != RunnerKind::kProcesses) {
    GTEST_SKIP() << "needs the process runner (rank 1 SIGKILLs itself)";
  }
  const int n = p.world_size;
  constexpr int kVictim = 1;
  constexpr size_t kCount = size_t{1} << 22;  // 16 MiB of f32
  std::vector<absl::Status> statuses = RunRanks(
      p.runner, n,
      [&](int rank) -> absl::Status {
        Store& store = *CurrentRank()->store;
        ObservationPublisher publisher(store, rank);
        FS_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm,
                            ConnectAndSync(p, store, rank, n));
        std::vector<float> send(kCount, 1.0f), recv(kCount, 0.0f);
        const absl::Time start = absl::Now();
        Work work = comm->AllReduce(MakeConstBuffer(send.data(), kCount),
                                    MakeBuffer(recv.data(), kCount), ReduceOp::kSum);
        if (rank == kVictim) {
          absl::SleepFor(absl::Milliseconds(1));
          raise(SIGKILL);
        }
        Observation mine;
        mine.status = work.Wait(kFailureTimeout + kWaitSlack);
        mine.elapsed = absl::Now() - start;
        Problems problems;
        CheckPeerCausedFailure(problems, mine, "all_reduce", kFailureTimeout,
                               {absl::StatusCode::kUnavailable});
        if (!mine.status.ok()) problems.Add(CheckBroken(*comm, mine.status));
        FS_RETURN_IF_ERROR(publisher.Publish(mine));
        std::vector<std::optional<Observation>> all(n);
        for (int r = 0; r < n; ++r) {
          if (r == kVictim) continue;
          FS_ASSIGN_OR_RETURN(all[r], ReadObservation(store, r));
        }
        if (rank == 0) {
          bool named = false;
          for (int r = 0; r < n; ++r) {
            if (r != kVictim && Names(all[r]->status, PeerName(kVictim))) named = true;
          }
          if (!named) problems.Add("no surviving rank names peer 1, the rank that died");
          if (n == 2 && !Names(all[0]->status, PeerName(kVictim))) {
            problems.Add("rank 0 waited on peer 1 only, but its message does not name it");
          }
        }
        return problems.Verdict(rank, mine, rank == 0 ? all : decltype(all){});
      },
      kRunTimeout);
  ExpectRanksOk(statuses, n, {kVictim});
  ASSERT_EQ(statuses.size(), static_cast<size_t>(n));
  EXPECT_THAT(statuses[kVictim], StatusIs(absl::StatusCode::kInternal, HasSubstr("signal 9")));
}

}  // namespace

void PrintTo(const ConformanceParam& param, std::ostream* os) {
  *os << param.backend << "/" << RunnerKindName(param.runner) << "/ws" << param.world_size;
}

std::vector<ConformanceParam> ConformanceParams(const std::string& backend, RunnerKind runner) {
  std::vector<ConformanceParam> params;
  for (int n = 1; n <= 4; ++n) params.push_back({backend, runner, n});
  return params;
}

std::vector<ConformanceParam> FailureConformanceParams(const std::string& backend,
                                                       RunnerKind runner) {
  return {{backend, runner, 2}, {backend, runner, 3}};
}

std::string ConformanceParamName(const ::testing::TestParamInfo<ConformanceParam>& info) {
  return absl::StrCat("ws", info.param.world_size);
}

}  // namespace fairscale::comm::testing
