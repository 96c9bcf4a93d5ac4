// TracingCommunicator over the inproc backend, 1-4 rank threads: every result equals the one the
// unwrapped communicator computes for the same inputs (and, for all_reduce, a local reference);
// each operation is one "comm" event with the documented bytes, seq and args; Split wraps the
// child; a disabled recorder records nothing; errors pass through unchanged.
#include "trace/tracing_communicator.h"

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/registry.h"
#include "comm/testing/rank_runner.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::trace {
namespace {

using comm::testing::Check;
using ::fairscale::base::testing::IsOk;
using ::fairscale::base::testing::StatusIs;
using ::testing::HasSubstr;

template <typename T>
absl::Status SameBytes(const std::vector<T>& a, const std::vector<T>& b, const std::string& what) {
  return Check(a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0,
               absl::StrCat(what, ": traced result differs from the plain communicator's"));
}

absl::StatusOr<std::shared_ptr<comm::Communicator>> MakeInproc(const std::string& name) {
  comm::CommConfig config = comm::testing::RankConfig(absl::Seconds(30));
  config.name = name;
  return comm::CreateCommunicator("inproc", config);
}

// What one operation should have recorded.
struct Expected {
  std::string name;
  int64_t bytes;
};

// Runs the same operations on `c` and returns the outputs concatenated per op kind.
struct Outputs {
  std::vector<float> all_reduce;
  std::vector<int32_t> all_gather;
  std::vector<double> reduce_scatter;
  std::vector<int64_t> broadcast;
  std::vector<float> reduce;
  std::vector<int32_t> all_to_all;
  std::vector<int32_t> recv;
};

absl::StatusOr<Outputs> RunOps(comm::Communicator& c, std::vector<Expected>* expected) {
  const int n = c.size(), r = c.rank();
  Outputs out;
  auto add = [expected](const char* name, int64_t bytes) {
    if (expected != nullptr) expected->push_back({name, bytes});
  };
  std::vector<float> ar_in(5);
  for (int i = 0; i < 5; ++i) ar_in[i] = static_cast<float>(r * 10 + i);
  out.all_reduce.resize(5);
  FS_RETURN_IF_ERROR(c.AllReduce(comm::MakeConstBuffer(ar_in.data(), 5),
                                 comm::MakeBuffer(out.all_reduce.data(), 5), comm::ReduceOp::kSum)
                         .Wait());
  add("all_reduce", 5 * 4);

  std::vector<int32_t> ag_in = {r, r + 100, r * r};
  out.all_gather.resize(3 * n);
  FS_RETURN_IF_ERROR(c.AllGather(comm::MakeConstBuffer(ag_in.data(), 3),
                                 comm::MakeBuffer(out.all_gather.data(), 3 * n))
                         .Wait());
  add("all_gather", 3 * n * 4);

  std::vector<double> rs_in(2 * n);
  for (int i = 0; i < 2 * n; ++i) rs_in[i] = (i * 7 + r * 3) % 11;
  out.reduce_scatter.resize(2);
  FS_RETURN_IF_ERROR(c.ReduceScatter(comm::MakeConstBuffer(rs_in.data(), 2 * n),
                                     comm::MakeBuffer(out.reduce_scatter.data(), 2),
                                     comm::ReduceOp::kMax)
                         .Wait());
  add("reduce_scatter", 2 * n * 8);

  out.broadcast = {r, r + 1, r + 2, r + 3};
  FS_RETURN_IF_ERROR(c.Broadcast(comm::MakeBuffer(out.broadcast.data(), 4), n - 1).Wait());
  add("broadcast", 4 * 8);

  std::vector<float> red_in = {1.5f * r, 2.0f};
  out.reduce.assign(2, -1.0f);
  FS_RETURN_IF_ERROR(c.Reduce(comm::MakeConstBuffer(red_in.data(), 2),
                              r == 0 ? comm::MakeBuffer(out.reduce.data(), 2) : comm::Buffer{},
                              comm::ReduceOp::kSum, 0)
                         .Wait());
  add("reduce", 2 * 4);

  std::vector<int32_t> a2a_in(2 * n);
  for (int i = 0; i < 2 * n; ++i) a2a_in[i] = r * 1000 + i;
  out.all_to_all.resize(2 * n);
  FS_RETURN_IF_ERROR(c.AllToAll(comm::MakeConstBuffer(a2a_in.data(), 2 * n),
                                comm::MakeBuffer(out.all_to_all.data(), 2 * n))
                         .Wait());
  add("all_to_all", 2 * n * 4);

  if (n > 1) {
    // A ring: rank 0 sends first, every other rank receives first, so no two ranks wait for each
    // other.
    std::vector<int32_t> msg = {r, -r, 7};
    out.recv.assign(3, 0);
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    auto send = [&] { return c.Send(comm::MakeConstBuffer(msg.data(), 3), next).Wait(); };
    auto recv = [&] { return c.Recv(comm::MakeBuffer(out.recv.data(), 3), prev).Wait(); };
    if (r == 0) {
      FS_RETURN_IF_ERROR(send());
      add("send", 12);
      FS_RETURN_IF_ERROR(recv());
      add("recv", 12);
    } else {
      FS_RETURN_IF_ERROR(recv());
      add("recv", 12);
      FS_RETURN_IF_ERROR(send());
      add("send", 12);
    }
  }
  FS_RETURN_IF_ERROR(c.Barrier().Wait());
  add("barrier", 0);
  return out;
}

std::vector<Event> CommEvents(const Recorder& recorder) {
  std::vector<Event> out;
  for (const Event& e : recorder.Events()) {
    if (e.phase == Phase::kComplete && e.category == kCategoryComm) out.push_back(e);
  }
  return out;
}

TEST(TracingCommunicator, ForwardsResultsAndRecordsOneEventPerOperation) {
  for (int n = 1; n <= 4; ++n) {
    std::vector<absl::Status> statuses = comm::testing::RunThreads(
        n,
        [n](int rank) -> absl::Status {
          FS_ASSIGN_OR_RETURN(std::shared_ptr<comm::Communicator> plain, MakeInproc("plain"));
          FS_ASSIGN_OR_RETURN(std::shared_ptr<comm::Communicator> inner, MakeInproc("traced"));
          auto recorder = std::make_shared<Recorder>(rank);
          TracingCommunicator traced(inner, recorder);
          FS_RETURN_IF_ERROR(Check(traced.rank() == rank && traced.size() == n &&
                                       traced.backend() == "inproc",
                                   "rank/size/backend not forwarded"));
          FS_ASSIGN_OR_RETURN(Outputs want, RunOps(*plain, nullptr));
          std::vector<Expected> expected;
          FS_ASSIGN_OR_RETURN(Outputs got, RunOps(traced, &expected));

          // An independent check that the ops did something: sum over ranks of r*10+i.
          for (int i = 0; i < 5; ++i) {
            const float sum = 10.0f * n * (n - 1) / 2 + static_cast<float>(n * i);
            FS_RETURN_IF_ERROR(Check(got.all_reduce[i] == sum, "all_reduce sum"));
          }
          FS_RETURN_IF_ERROR(SameBytes(got.all_reduce, want.all_reduce, "all_reduce"));
          FS_RETURN_IF_ERROR(SameBytes(got.all_gather, want.all_gather, "all_gather"));
          FS_RETURN_IF_ERROR(SameBytes(got.reduce_scatter, want.reduce_scatter, "reduce_scatter"));
          FS_RETURN_IF_ERROR(SameBytes(got.broadcast, want.broadcast, "broadcast"));
          FS_RETURN_IF_ERROR(SameBytes(got.reduce, want.reduce, "reduce"));
          FS_RETURN_IF_ERROR(SameBytes(got.all_to_all, want.all_to_all, "all_to_all"));
          FS_RETURN_IF_ERROR(SameBytes(got.recv, want.recv, "recv"));

          // Every op was waited for before the next was issued, and a Work counts as done only
          // after its OnDone callbacks ran: the events are all there, in issue order.
          const std::vector<Event> events = CommEvents(*recorder);
          FS_RETURN_IF_ERROR(Check(events.size() == expected.size(),
                                   absl::StrCat(events.size(), " events for ", expected.size(),
                                                " operations")));
          int64_t collective_seq = 0;
          std::map<int, int64_t> lane_end;
          for (size_t i = 0; i < events.size(); ++i) {
            const Event& e = events[i];
            const std::string where = absl::StrCat("event ", i, " (", e.name, ")");
            FS_RETURN_IF_ERROR(Check(e.name == expected[i].name,
                                     absl::StrCat(where, ": expected ", expected[i].name)));
            FS_RETURN_IF_ERROR(Check(e.IntArg("bytes", -1) == expected[i].bytes,
                                     absl::StrCat(where, ": bytes ", e.IntArg("bytes", -1),
                                                  " != ", expected[i].bytes)));
            FS_RETURN_IF_ERROR(Check(e.pid == rank && e.tid >= kFirstLaneTid && e.dur_ns >= 0,
                                     absl::StrCat(where, ": pid/tid/dur")));
            FS_RETURN_IF_ERROR(
                Check(e.StringArg("group") == absl::StrCat(rank, "/", n) &&
                          e.StringArg("backend") == "inproc" && e.StringArg("error").empty(),
                      absl::StrCat(where, ": group/backend/error args")));
            if (e.name != "send" && e.name != "recv") {
              FS_RETURN_IF_ERROR(Check(e.IntArg("seq") == ++collective_seq,
                                       absl::StrCat(where, ": seq ", e.IntArg("seq"))));
            } else {
              FS_RETURN_IF_ERROR(Check(e.IntArg("seq") == 1 && e.IntArg("peer", -1) >= 0,
                                       absl::StrCat(where, ": p2p seq/peer")));
            }
            // Spans on one lane never overlap.
            FS_RETURN_IF_ERROR(Check(lane_end[e.tid] <= e.ts_ns, absl::StrCat(where, ": overlap")));
            lane_end[e.tid] = e.ts_ns + e.dur_ns;
          }
          FS_RETURN_IF_ERROR(Check(events[0].StringArg("op") == "sum" &&
                                       events[0].StringArg("dtype") == "f32" &&
                                       events[0].IntArg("count") == 5,
                                   "all_reduce op/dtype/count args"));
          FS_RETURN_IF_ERROR(Check(events[3].IntArg("root", -1) == n - 1, "broadcast root arg"));
          return absl::OkStatus();
        },
        absl::Seconds(60));
    for (int r = 0; r < n; ++r) EXPECT_THAT(statuses[r], IsOk()) << "world " << n << " rank " << r;
  }
}

TEST(TracingCommunicator, ConcurrentOperationsLandOnSeparateLanes) {
  std::vector<absl::Status> statuses = comm::testing::RunThreads(
      2,
      [](int rank) -> absl::Status {
        FS_ASSIGN_OR_RETURN(std::shared_ptr<comm::Communicator> inner, MakeInproc("lanes"));
        auto recorder = std::make_shared<Recorder>(rank);
        TracingCommunicator traced(inner, recorder);
        std::vector<float> a(64, 1.0f), b(64, 2.0f), c(64, 3.0f);
        // Three in flight at once (issued before any is waited for).
        comm::Work works[] = {
            traced.AllReduce(comm::MakeConstBuffer(a.data(), 64), comm::MakeBuffer(a.data(), 64),
                             comm::ReduceOp::kSum),
            traced.AllReduce(comm::MakeConstBuffer(b.data(), 64), comm::MakeBuffer(b.data(), 64),
                             comm::ReduceOp::kSum),
            traced.AllReduce(comm::MakeConstBuffer(c.data(), 64), comm::MakeBuffer(c.data(), 64),
                             comm::ReduceOp::kSum)};
        FS_RETURN_IF_ERROR(comm::WaitAll(works, 3));
        FS_RETURN_IF_ERROR(Check(a[0] == 2.0f && b[0] == 4.0f && c[63] == 6.0f, "sums"));
        const std::vector<Event> events = CommEvents(*recorder);
        FS_RETURN_IF_ERROR(Check(events.size() == 3, "three events"));
        std::map<int, std::vector<const Event*>> lanes;
        for (const Event& e : events) lanes[e.tid].push_back(&e);
        for (const auto& [tid, spans] : lanes) {
          for (size_t i = 1; i < spans.size(); ++i) {
            FS_RETURN_IF_ERROR(Check(spans[i - 1]->ts_ns + spans[i - 1]->dur_ns <= spans[i]->ts_ns,
                                     absl::StrCat("overlapping spans on lane ", tid)));
          }
        }
        return absl::OkStatus();
      },
      absl::Seconds(60));
  for (int r = 0; r < 2; ++r) EXPECT_THAT(statuses[r], IsOk()) << "rank " << r;
}

TEST(TracingCommunicator, SplitReturnsATracingChildAndDisabledRecordsNothing) {
  std::vector<absl::Status> statuses = comm::testing::RunThreads(
      4,
      [](int rank) -> absl::Status {
        FS_ASSIGN_OR_RETURN(std::shared_ptr<comm::Communicator> inner, MakeInproc("split"));
        auto recorder = std::make_shared<Recorder>(rank);
        TracingCommunicator traced(inner, recorder);
        FS_ASSIGN_OR_RETURN(std::shared_ptr<comm::Communicator> child,
                            traced.Split(rank % 2, rank));
        auto* tracing_child = dynamic_cast<TracingCommunicator*>(child.get());
        FS_RETURN_IF_ERROR(Check(tracing_child != nullptr, "Split did not return a tracer"));
        FS_RETURN_IF_ERROR(Check(tracing_child->recorder() == recorder, "child's recorder"));
        FS_RETURN_IF_ERROR(Check(child->size() == 2 && child->rank() == rank / 2, "child group"));
        int64_t v = rank, sum = 0;
        FS_RETURN_IF_ERROR(child->AllReduce(comm::MakeConstBuffer(&v, 1), comm::MakeBuffer(&sum, 1),
                                            comm::ReduceOp::kSum)
                               .Wait());
        FS_RETURN_IF_ERROR(Check(sum == (rank % 2 == 0 ? 0 + 2 : 1 + 3), "child all_reduce"));
        std::vector<Event> events = CommEvents(*recorder);
        FS_RETURN_IF_ERROR(Check(events.size() == 2 && events[0].name == "split" &&
                                     events[1].name == "all_reduce" &&
                                     events[1].StringArg("group") ==
                                         absl::StrCat(rank / 2, "/2") &&
                                     events[1].pid == rank,
                                 "split + child all_reduce events"));
        // kNoColor: nullptr passes through.
        FS_ASSIGN_OR_RETURN(std::shared_ptr<comm::Communicator> none,
                            traced.Split(rank == 0 ? comm::kNoColor : 0, rank));
        FS_RETURN_IF_ERROR(Check((none == nullptr) == (rank == 0), "kNoColor child"));

        recorder->set_enabled(false);
        recorder->Clear();
        FS_RETURN_IF_ERROR(traced.Barrier().Wait());
        FS_RETURN_IF_ERROR(Check(CommEvents(*recorder).empty(), "disabled recorder recorded"));
        return absl::OkStatus();
      },
      absl::Seconds(60));
  for (int r = 0; r < 4; ++r) EXPECT_THAT(statuses[r], IsOk()) << "rank " << r;
}

TEST(TracingCommunicator, ErrorsPassThroughAndAreRecorded) {
  std::vector<absl::Status> statuses = comm::testing::RunThreads(
      1,
      [](int rank) -> absl::Status {
        FS_ASSIGN_OR_RETURN(std::shared_ptr<comm::Communicator> inner, MakeInproc("errors"));
        auto recorder = std::make_shared<Recorder>(rank);
        TracingCommunicator traced(inner, recorder);
        float x = 1.0f;
        // Argument errors: rejected by the front, named like the backend's, not recorded.
        absl::Status bad = traced.Broadcast(comm::MakeBuffer(&x, 1), /*root=*/3).Wait();
        FS_RETURN_IF_ERROR(Check(bad.code() == absl::StatusCode::kInvalidArgument &&
                                     absl::StrContains(bad.message(), "broadcast #1 rank 0/1 [inproc]"),
                                 bad.ToString()));
        FS_RETURN_IF_ERROR(Check(CommEvents(*recorder).empty(), "rejected op recorded"));
        // Abort is forwarded; the failing op is recorded with its error.
        traced.Abort(absl::CancelledError("stop"));
        FS_RETURN_IF_ERROR(Check(!inner->status().ok() && !traced.status().ok(), "abort forwarded"));
        absl::Status failed = traced.Barrier().Wait();
        FS_RETURN_IF_ERROR(Check(!failed.ok(), "barrier after abort succeeded"));
        std::vector<Event> events = CommEvents(*recorder);
        FS_RETURN_IF_ERROR(Check(events.size() == 1 && !events[0].StringArg("error").empty(),
                                 "failed op not recorded with its error"));
        return absl::OkStatus();
      },
      absl::Seconds(60));
  EXPECT_THAT(statuses[0], IsOk());
}

TEST(TracingCommunicator, AlignClocksSharesRankZerosClock) {
  std::vector<absl::Status> statuses = comm::testing::RunThreads(
      3,
      [](int rank) -> absl::Status {
        FS_ASSIGN_OR_RETURN(std::shared_ptr<comm::Communicator> inner, MakeInproc("align"));
        Recorder recorder(rank);
        // Threads of one process share CLOCK_MONOTONIC: the offset is the barrier-exit skew,
        // and rank 0's is exactly 0.
        FS_ASSIGN_OR_RETURN(int64_t offset, AlignClocks(*inner, recorder));
        FS_RETURN_IF_ERROR(Check(recorder.clock_offset_ns() == offset, "offset not set"));
        if (rank == 0) FS_RETURN_IF_ERROR(Check(offset == 0, "rank 0 offset"));
        return absl::OkStatus();
      },
      absl::Seconds(60));
  for (int r = 0; r < 3; ++r) EXPECT_THAT(statuses[r], IsOk()) << "rank " << r;
}

TEST(TracingCommunicator, BlockingWaitsAreRecordedOnTheWaitingThread) {
  absl::Notification rank1_waited;
  std::vector<absl::Status> statuses = comm::testing::RunThreads(
      2,
      [&rank1_waited](int rank) -> absl::Status {
        FS_ASSIGN_OR_RETURN(std::shared_ptr<comm::Communicator> inner, MakeInproc("waits"));
        auto recorder = std::make_shared<Recorder>(rank);
        TracingCommunicator traced(inner, recorder);
        int32_t value = 0;
        if (rank == 0) {
          // Send only once rank 1 has given up one wait on its recv: that wait surely blocked.
          if (!rank1_waited.WaitForNotificationWithTimeout(absl::Seconds(30))) {
            return absl::DeadlineExceededError("rank 1 never waited");
          }
          value = 42;
          return traced.Send(comm::MakeConstBuffer(&value, 1), 1).Wait();
        }
        comm::Work recv = traced.Recv(comm::MakeBuffer(&value, 1), 0);
        absl::Status early = recv.Wait(absl::ZeroDuration());
        rank1_waited.Notify();
        FS_RETURN_IF_ERROR(Check(early.code() == absl::StatusCode::kDeadlineExceeded,
                                 absl::StrCat("early wait: ", early.ToString())));
        FS_RETURN_IF_ERROR(recv.Wait());
        FS_RETURN_IF_ERROR(Check(value == 42, "received value"));
        std::vector<const Event*> waits;
        const std::vector<Event> events = recorder->Events();
        for (const Event& e : events) {
          if (e.phase == Phase::kComplete && e.category == kCategoryWait) waits.push_back(&e);
        }
        // The early wait, and the second one if the message had not arrived by then.
        FS_RETURN_IF_ERROR(Check(!waits.empty() && waits.size() <= 2, "wait events"));
        FS_RETURN_IF_ERROR(Check(
            waits[0]->name == "wait recv" && waits[0]->IntArg("seq") == 1 &&
                waits[0]->tid == Recorder::CurrentThreadId() &&
                absl::StrContains(waits[0]->StringArg("error"), "DEADLINE_EXCEEDED"),
            "first wait event: name/seq/tid/error"));
        return absl::OkStatus();
      },
      absl::Seconds(60));
  for (int r = 0; r < 2; ++r) EXPECT_THAT(statuses[r], IsOk()) << "rank " << r;
}

}  // namespace
}  // namespace fairscale::trace
