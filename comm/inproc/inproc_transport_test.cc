// InprocTransport on its own: matching order, mismatch and deadline errors, Cancel, Shutdown.
#include "comm/inproc/inproc_transport.h"

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "base/status_matchers.h"
#include "comm/store/hash_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::comm {
namespace {

using ::fairscale::base::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::vector<std::unique_ptr<Transport>> MakeTransports(int n) {
  auto store = std::make_shared<HashStore>();
  std::vector<std::unique_ptr<Transport>> ts;
  // Rank 0 publishes the domain without waiting, so creating the ranks in order is enough.
  for (int r = 0; r < n; ++r) {
    auto t = CreateInprocTransport(store, r, n, absl::Seconds(5));
    EXPECT_TRUE(t.ok()) << t.status();
    ts.push_back(std::move(t).value());
  }
  return ts;
}

absl::Time Soon() { return absl::Now() + absl::Seconds(10); }
const uint64_t kTag = MakeTag(OpType::kAllReduce, 3);

TEST(InprocTransport, MessagesArriveInOrderAndZeroByteMessagesCount) {
  auto ts = MakeTransports(2);
  std::vector<int> a = {1, 2, 3}, b = {4, 5};
  std::vector<int> ra(3), rb(2);
  std::thread sender([&] {
    const Transport::Request reqs[] = {ts[0]->Isend(1, kTag, a.data(), 12),
                                       ts[0]->Isend(1, kTag, nullptr, 0),
                                       ts[0]->Isend(1, kTag, b.data(), 8)};
    EXPECT_OK(ts[0]->Wait(reqs, Soon()));
  });
  const Transport::Request r1 = ts[1]->Irecv(0, kTag, ra.data(), 12);
  const Transport::Request r2 = ts[1]->Irecv(0, kTag, nullptr, 0);
  const Transport::Request r3 = ts[1]->Irecv(0, kTag, rb.data(), 8);
  EXPECT_OK(ts[1]->Wait({r1, r2, r3}, Soon()));
  sender.join();
  EXPECT_EQ(ra, a);
  EXPECT_EQ(rb, b);
}

TEST(InprocTransport, TagMismatchNamesPeerTagsAndSizes) {
  auto ts = MakeTransports(2);
  int x = 0;
  const Transport::Request s = ts[0]->Isend(1, kTag, &x, 4);
  const Transport::Request r = ts[1]->Irecv(0, MakeTag(OpType::kBarrier, 3), nullptr, 0);
  EXPECT_THAT(ts[1]->Wait({r}, Soon()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("peer 0"), HasSubstr("expected barrier #3 with 0 bytes"),
                             HasSubstr("got all_reduce #3 with 4 bytes"))));
  EXPECT_THAT(ts[0]->Wait({s}, Soon()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("peer 1")));
  // Errors are final.
  EXPECT_THAT(ts[1]->Poll(), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(InprocTransport, SizeMismatchFailsBothSides) {
  auto ts = MakeTransports(2);
  std::vector<char> buf(8);
  const Transport::Request s = ts[0]->Isend(1, kTag, buf.data(), 8);
  const Transport::Request r = ts[1]->Irecv(0, kTag, buf.data(), 4);
  EXPECT_THAT(ts[1]->Wait({r}, Soon()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("with 4 bytes"), HasSubstr("with 8 bytes"))));
  EXPECT_THAT(ts[0]->Wait({s}, Soon()), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(InprocTransport, DeadlineNamesWhatIsPending) {
  auto ts = MakeTransports(3);
  int x;
  const Transport::Request r = ts[0]->Irecv(2, kTag, &x, 4);
  const absl::Time start = absl::Now();
  EXPECT_THAT(ts[0]->Wait({r}, absl::Now() + absl::Milliseconds(100)),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr("recv from peer 2 (all_reduce #3, 4 bytes)")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

TEST(InprocTransport, CancelWakesAWaitPromptly) {
  auto ts = MakeTransports(2);
  int x;
  const Transport::Request r = ts[0]->Irecv(1, kTag, &x, 4);
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(50));
    ts[0]->Cancel(absl::AbortedError("stop now"));
  });
  const absl::Time start = absl::Now();
  EXPECT_THAT(ts[0]->Wait({r}, Soon()), StatusIs(absl::StatusCode::kAborted, "stop now"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  canceller.join();
}

TEST(InprocTransport, ShutdownFailsPeersFast) {
  auto ts = MakeTransports(3);
  int x;
  const Transport::Request r = ts[0]->Irecv(1, kTag, &x, 4);
  std::thread killer([&] {
    absl::SleepFor(absl::Milliseconds(50));
    ts[1]->Shutdown(absl::DeadlineExceededError("rank 1 timed out"));
  });
  EXPECT_THAT(ts[0]->Wait({r}, Soon()),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("peer 1 shut down"), HasSubstr("rank 1 timed out"))));
  killer.join();
  // A rank that was not talking to rank 1 notices while idle.
  EXPECT_THAT(ts[2]->Poll(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("peer 1")));
}

TEST(InprocTransport, NormalShutdownOnlyFailsWhoStillNeedsThePeer) {
  auto ts = MakeTransports(3);
  ts[1]->Shutdown(absl::OkStatus());
  EXPECT_OK(ts[0]->Poll());
  int x;
  const Transport::Request r = ts[0]->Irecv(1, kTag, &x, 4);
  EXPECT_THAT(ts[0]->Wait({r}, Soon()),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("peer 1 shut down")));
}

TEST(InprocTransport, RendezvousErrors) {
  auto store = std::make_shared<HashStore>();
  EXPECT_THAT(CreateInprocTransport(store, 1, 2, absl::Milliseconds(50)).status(),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("rank 0")));
  auto t0 = CreateInprocTransport(store, 0, 2, absl::Seconds(1));
  ASSERT_OK(t0.status());
  EXPECT_THAT(CreateInprocTransport(store, 1, 3, absl::Seconds(1)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("size")));
  auto t1 = CreateInprocTransport(store, 1, 2, absl::Seconds(1));
  ASSERT_OK(t1.status());
  EXPECT_THAT(CreateInprocTransport(store, 1, 2, absl::Seconds(1)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("twice")));
}

}  // namespace
}  // namespace fairscale::comm
