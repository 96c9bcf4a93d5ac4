// Argument validation of the Communicator base class, exercised through a backend stub that
// records what reached it.
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/status_matchers.h"
#include "comm/communicator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::comm {
namespace {

using ::fairscale::base::testing::IsOk;
using ::fairscale::base::testing::StatusIs;
using ::testing::HasSubstr;

class StubComm : public Communicator {
 public:
  StubComm(int rank, int size) : Communicator(rank, size, "stub", absl::Seconds(5)) {}
  void Abort(absl::Status) override {}
  absl::Status status() const override { return absl::OkStatus(); }
  std::vector<OpContext> seen;

 protected:
  Work Record(const OpContext& ctx) {
    seen.push_back(ctx);
    return Work();
  }
  Work DoAllReduce(const OpContext& c, ConstBuffer, Buffer, ReduceOp) override { return Record(c); }
  Work DoReduceScatter(const OpContext& c, ConstBuffer, Buffer, ReduceOp) override {
    return Record(c);
  }
  Work DoAllGather(const OpContext& c, ConstBuffer, Buffer) override { return Record(c); }
  Work DoBroadcast(const OpContext& c, Buffer, int) override { return Record(c); }
  Work DoReduce(const OpContext& c, ConstBuffer, Buffer, ReduceOp, int) override {
    return Record(c);
  }
  Work DoAllToAll(const OpContext& c, ConstBuffer, Buffer) override { return Record(c); }
  Work DoSend(const OpContext& c, ConstBuffer, int) override { return Record(c); }
  Work DoRecv(const OpContext& c, Buffer, int) override { return Record(c); }
  Work DoBarrier(const OpContext& c) override { return Record(c); }
  Work DoBatchP2P(const OpContext& c, std::vector<P2PItem> items) override {
    for (const P2PItem& item : items) {
      OpContext one = c;
      one.seq = item.seq;
      seen.push_back(one);
    }
    return Work();
  }
  absl::StatusOr<std::shared_ptr<Communicator>> DoSplit(const OpContext& c, int, int) override {
    seen.push_back(c);
    return std::shared_ptr<Communicator>();
  }
};

TEST(Communicator, SequenceNumbersCountCollectivesAndPerPeerP2p) {
  StubComm c(1, 4);
  std::vector<float> a(8), b(8);
  ASSERT_OK(c.AllReduce(MakeConstBuffer(a.data(), 8), MakeBuffer(b.data(), 8), ReduceOp::kSum).Wait());
  ASSERT_OK(c.Barrier().Wait());
  ASSERT_OK(c.Send(MakeConstBuffer(a.data(), 8), 2).Wait());
  ASSERT_OK(c.Send(MakeConstBuffer(a.data(), 8), 2).Wait());
  ASSERT_OK(c.Recv(MakeBuffer(b.data(), 8), 2).Wait());
  ASSERT_EQ(c.seen.size(), 5u);
  EXPECT_EQ(c.seen[0].seq, 1u);
  EXPECT_EQ(c.seen[1].seq, 2u);
  EXPECT_EQ(c.seen[2].seq, 1u);
  EXPECT_EQ(c.seen[3].seq, 2u);
  EXPECT_EQ(c.seen[4].seq, 1u);
  EXPECT_EQ(c.seen[1].Label(), "barrier #2 rank 1/4 [stub]");
  EXPECT_EQ(c.seen[0].timeout, absl::Seconds(5));
}

TEST(Communicator, RejectsBadArgumentsWithoutQueueing) {
  StubComm c(1, 4);
  std::vector<float> a(8), b(8);
  std::vector<int32_t> ints(8);
  auto in = MakeConstBuffer(a.data(), 8);
  EXPECT_THAT(c.AllReduce(in, MakeBuffer(b.data(), 7), ReduceOp::kSum).Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("all_reduce #1 rank 1/4 [stub]: send count 8 != recv count 7")));
  EXPECT_THAT(c.AllReduce(in, MakeBuffer(ints.data(), 8), ReduceOp::kSum).Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dtype")));
  EXPECT_THAT(c.AllReduce(MakeConstBuffer(ints.data(), 8), MakeBuffer(ints.data(), 8),
                          ReduceOp::kAvg).Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("avg")));
  EXPECT_THAT(c.AllReduce(in, MakeBuffer(a.data() + 1, 7), ReduceOp::kSum).Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument));  // count, then overlap
  EXPECT_THAT(c.AllReduce(MakeConstBuffer(a.data(), 4), MakeBuffer(a.data() + 2, 4),
                          ReduceOp::kSum).Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("partially overlap")));
  EXPECT_THAT(c.AllReduce(ConstBuffer(nullptr, 3, DataType::kF32), MakeBuffer(b.data(), 3),
                          ReduceOp::kSum).Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null")));
  EXPECT_THAT(c.Broadcast(MakeBuffer(b.data(), 8), 4).Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("root 4")));
  EXPECT_THAT(c.Send(in, 1).Wait(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(c.Recv(MakeBuffer(b.data(), 8), -1).Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(c.ReduceScatter(in, MakeBuffer(b.data(), 3), ReduceOp::kSum).Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("size 4")));
  EXPECT_THAT(c.AllGather(MakeConstBuffer(a.data(), 3), MakeBuffer(b.data(), 8)).Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(c.AllToAll(MakeConstBuffer(a.data(), 6), MakeBuffer(b.data(), 6)).Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("divisible")));
  EXPECT_THAT(c.AllToAll(in, MakeBuffer(a.data(), 8)).Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("in place")));
  Buffer cuda = MakeBuffer(b.data(), 8);
  cuda.device = Device::Cuda(0);
  EXPECT_THAT(c.Broadcast(cuda, 0).Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cuda:0")));
  EXPECT_TRUE(c.seen.empty());
}

TEST(Communicator, InPlaceLayoutsAreAccepted) {
  StubComm c(2, 4);
  std::vector<float> big(16), small(4);
  // reduce_scatter in place: recv is block 2 of send.
  EXPECT_OK(c.ReduceScatter(MakeConstBuffer(big.data(), 16), MakeBuffer(big.data() + 8, 4),
                            ReduceOp::kSum).Wait());
  // all_gather in place: send is block 2 of recv.
  EXPECT_OK(c.AllGather(MakeConstBuffer(big.data() + 8, 4), MakeBuffer(big.data(), 16)).Wait());
  EXPECT_THAT(c.AllGather(MakeConstBuffer(big.data() + 4, 4), MakeBuffer(big.data(), 16)).Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("in-place layout")));
  // zero-count with null pointers.
  EXPECT_OK(c.AllReduce(ConstBuffer(nullptr, 0, DataType::kF16), Buffer{nullptr, 0, DataType::kF16},
                        ReduceOp::kMax).Wait());
  // Reduce: recv ignored off the root.
  EXPECT_OK(c.Reduce(MakeConstBuffer(small.data(), 4), Buffer{}, ReduceOp::kSum, 0).Wait());
  EXPECT_EQ(c.seen.size(), 4u);
}

TEST(Work, WaitTimesOutAndCompletesOnce) {
  auto [work, completer] = Work::Pending("all_reduce #3 rank 0/2 [stub]");
  EXPECT_FALSE(work.IsDone());
  EXPECT_THAT(work.Wait(absl::Milliseconds(10)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("all_reduce #3")));
  completer.Complete(absl::UnavailableError("first"));
  completer.Complete(absl::OkStatus());
  EXPECT_TRUE(work.IsDone());
  EXPECT_THAT(work.Wait(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("first")));
  Work done;
  EXPECT_OK(done.Wait(absl::ZeroDuration()));
}

TEST(Work, OnDoneRunsOnceWithTheFirstStatus) {
  auto [work, completer] = Work::Pending("all_gather #1 rank 0/2 [stub]");
  std::vector<std::string> calls;
  work.OnDone([&calls](const absl::Status& s) { calls.push_back("a:" + s.ToString()); });
  work.OnDone([&calls](const absl::Status& s) { calls.push_back("b:" + s.ToString()); });
  EXPECT_TRUE(calls.empty());
  completer.Complete(absl::AbortedError("stop"));
  completer.Complete(absl::OkStatus());
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0], "a:ABORTED: stop");  // in the order added
  EXPECT_EQ(calls[1], "b:ABORTED: stop");
  // Added after completion: runs at once on this thread, with the stored status.
  work.OnDone([&calls](const absl::Status& s) { calls.push_back("c:" + s.ToString()); });
  ASSERT_EQ(calls.size(), 3u);
  EXPECT_EQ(calls[2], "c:ABORTED: stop");
  // Already-done Works (argument errors, the default OK Work) run it at once too.
  absl::Status seen = absl::UnknownError("unset");
  Work::Done(absl::InvalidArgumentError("bad")).OnDone([&seen](const absl::Status& s) { seen = s; });
  EXPECT_THAT(seen, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bad")));
  Work().OnDone([&seen](const absl::Status& s) { seen = s; });
  EXPECT_OK(seen);
}

TEST(Work, OnDoneCallbacksRunBeforeTheWorkCountsAsDone) {
  // Waiters are released only after the callbacks: inside one the Work is not done yet, and a
  // second Complete() racing with them is ignored.
  auto [work, completer] = Work::Pending("barrier #1 rank 0/1 [stub]");
  bool done_inside = true;
  absl::Status wait_inside;
  Work copy = work;
  WorkCompleter again = completer;
  work.OnDone([copy, again, &done_inside, &wait_inside](const absl::Status&) {
    done_inside = copy.IsDone();
    wait_inside = copy.Wait(absl::ZeroDuration());
    again.Complete(absl::InternalError("late"));
  });
  completer.Complete(absl::OkStatus());
  EXPECT_FALSE(done_inside);
  EXPECT_THAT(wait_inside, StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_TRUE(work.IsDone());
  EXPECT_OK(work.Wait());
}

TEST(Work, OnWaitReportsBlockingWaitsOnly) {
  auto [work, completer] = Work::Pending("reduce_scatter #2 rank 1/2 [stub]");
  std::vector<absl::Status> seen;
  std::vector<absl::Duration> waited;
  work.OnWait([&](absl::Duration d, const absl::Status& s) {
    waited.push_back(d);
    seen.push_back(s);
  });
  // A wait that gives up is reported with its kDeadlineExceeded.
  EXPECT_THAT(work.Wait(absl::ZeroDuration()), StatusIs(absl::StatusCode::kDeadlineExceeded));
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_THAT(seen[0], StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_GE(waited[0], absl::ZeroDuration());
  // A wait released by the completion (from another thread) is reported with the op's status.
  std::thread completer_thread([c = completer] { c.Complete(absl::DataLossError("x")); });
  EXPECT_THAT(work.Wait(), StatusIs(absl::StatusCode::kDataLoss));
  completer_thread.join();
  // Either the wait blocked (reported) or the op was already done when Wait was called (not).
  ASSERT_LE(seen.size(), 2u);
  if (seen.size() == 2) {
    EXPECT_THAT(seen[1], StatusIs(absl::StatusCode::kDataLoss));
  }
  // Waits on a done Work are not reported.
  const size_t before = seen.size();
  EXPECT_THAT(work.Wait(), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_EQ(seen.size(), before);
}

TEST(Types, Names) {
  EXPECT_EQ(SizeOf(DataType::kBF16), 2u);
  EXPECT_EQ(DataTypeName(DataType::kI64), "i64");
  EXPECT_EQ(ReduceOpName(ReduceOp::kAvg), "avg");
  EXPECT_EQ(OpTypeName(OpType::kReduceScatter), "reduce_scatter");
}

}  // namespace
}  // namespace fairscale::comm
