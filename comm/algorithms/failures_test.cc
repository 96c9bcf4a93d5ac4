// TransportCommunicator beyond the happy path (through the inproc backend): mismatched
// arguments, Abort, timeouts, destruction with work in flight, Split, option validation and
// store namespaces. Every wait is bounded; a hang fails the test instead of blocking it.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_matchers.h"
#include "comm/algorithms/test_group.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::comm::testing {
namespace {

using ::fairscale::base::testing::IsOk;
using ::fairscale::base::testing::StatusIs;
using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::Not;

const absl::Duration kWait = absl::Seconds(20);

// One rank passes a different count: every rank fails (none hangs), well before the timeout.
TEST(Failures, MismatchedCountFailsEveryRank) {
  struct Case {
    const char* name;
    Options options;
    size_t count;
    size_t bad_count;
  };
  const Case cases[] = {
      {"direct", {}, 8, 9},
      {"direct, zero vs one", {}, 1, 0},
      {"direct vs ring", {}, 4096, 4097},  // 16 KiB is the default threshold
      {"ring", {{"algo.small_bytes", "0"}, {"algo.chunk_bytes", "4096"}}, 20000, 20001},
  };
  for (const Case& c : cases) {
    for (int n : {2, 4}) {
      const absl::Duration timeout = absl::Seconds(10);
      Comms comms = MakeGroup(n, c.options, timeout);
      std::vector<absl::Status> results(n);
      const absl::Time start = absl::Now();
      OnRanks(n, [&](int r) {
        std::vector<float> v(r == 1 ? c.bad_count : c.count, 1.0f);
        Buffer b = MakeBuffer(v.data(), v.size());
        results[r] = comms[r]->AllReduce(b, b, ReduceOp::kSum).Wait(kWait);
      });
      EXPECT_LT(absl::Now() - start, timeout / 2) << c.name;
      bool named_mismatch = false;
      for (int r = 0; r < n; ++r) {
        EXPECT_THAT(results[r], Not(IsOk())) << c.name << " n=" << n << " rank " << r;
        EXPECT_THAT(results[r].message(),
                    AllOf(HasSubstr(absl::StrCat("all_reduce #1 rank ", r, "/", n, " [inproc]")),
                          HasSubstr("peer")));
        if (results[r].code() == absl::StatusCode::kInvalidArgument &&
            absl::StrContains(results[r].message(), "bytes")) {
          named_mismatch = true;
        }
        EXPECT_EQ(comms[r]->status(), results[r]) << "the first error breaks the communicator";
      }
      EXPECT_TRUE(named_mismatch) << c.name << ": no rank reported the size mismatch";
    }
  }
}

TEST(Failures, DifferentCollectivesFailWithBothTags) {
  Comms comms = MakeGroup(2);
  std::vector<absl::Status> results(2);
  OnRanks(2, [&](int r) {
    float x = 1;
    results[r] = r == 0 ? comms[r]->Broadcast(MakeBuffer(&x, 1), 0).Wait(kWait)
                        : comms[r]->AllReduce(MakeConstBuffer(&x, 1), MakeBuffer(&x, 1),
                                              ReduceOp::kSum)
                              .Wait(kWait);
  });
  EXPECT_THAT(results[1], StatusIs(absl::StatusCode::kInvalidArgument,
                                   AllOf(HasSubstr("all_reduce #1 rank 1/2 [inproc]: "),
                                         HasSubstr("peer 0"), HasSubstr("expected all_reduce #1"),
                                         HasSubstr("got broadcast #1"))));
  EXPECT_THAT(results[0], Not(IsOk()));
}

// Same sizes, different dtype / reduce op / root: the signature in the tag catches each. (Two
// ranks that both believe they are the broadcast root only send, so nobody receives a message
// to compare: that case ends at the timeout, and the message names the root each rank used.)
TEST(Failures, DisagreementOnDtypeOpOrRootIsAnError) {
  struct Case {
    const char* name;
    std::function<Work(Communicator&, int r, void* data)> issue;
    const char* expect;
  };
  const Case cases[] = {
      {"dtype",
       [](Communicator& c, int r, void* d) {
         Buffer b{d, 4, r == 0 ? DataType::kF32 : DataType::kI32, {}};
         return c.AllReduce(b, b, ReduceOp::kSum);
       },
       "(f32 sum)"},
      {"op",
       [](Communicator& c, int r, void* d) {
         Buffer b{d, 4, DataType::kF32, {}};
         return c.AllReduce(b, b, r == 0 ? ReduceOp::kSum : ReduceOp::kMax);
       },
       "(f32 max)"},
      {"root",
       [](Communicator& c, int r, void* d) {
         return c.Broadcast(Buffer{d, 4, DataType::kF32, {}}, r == 0 ? 0 : 1);
       },
       "root "},  // whichever rank times out first names the root it used
      {"send/recv dtype",
       [](Communicator& c, int r, void* d) {
         return r == 0 ? c.Send(ConstBuffer(d, 4, DataType::kF32), 1)
                       : c.Recv(Buffer{d, 4, DataType::kI32, {}}, 0);
       },
       "(i32)"},
  };
  for (const Case& c : cases) {
    Comms comms = MakeGroup(2, {}, absl::Seconds(1));
    std::vector<absl::Status> results(2);
    OnRanks(2, [&](int r) {
      std::vector<int32_t> data(4, 1);
      results[r] = c.issue(*comms[r], r, data.data()).Wait(kWait);
    });
    bool named = false;
    for (int r = 0; r < 2; ++r) {
      EXPECT_THAT(results[r], Not(IsOk())) << c.name << " rank " << r;
      named |= absl::StrContains(results[r].message(), c.expect);
    }
    EXPECT_TRUE(named) << c.name << ": " << results[0] << " | " << results[1];
  }
}

TEST(Failures, BrokenCommunicatorFailsLaterOps) {
  Comms comms = MakeGroup(2);
  comms[0]->Abort(absl::AbortedError("stop"));
  // A later op fails at once with the communicator's error, naming itself.
  EXPECT_THAT(comms[0]->Barrier().Wait(kWait),
              StatusIs(absl::StatusCode::kAborted,
                       AllOf(HasSubstr("barrier #1 rank 0/2"), HasSubstr(": stop"))));
  EXPECT_THAT(comms[0]->status(), StatusIs(absl::StatusCode::kAborted, "stop"));
  // The peer hears about it while idle (Poll) and fails fast too.
  const absl::Time start = absl::Now();
  EXPECT_THAT(comms[1]->Barrier().Wait(kWait),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("peer 0 shut down")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(Failures, AbortFromAnotherThreadUnblocksAWaitingOp) {
  Comms comms = MakeGroup(2, {}, absl::Seconds(60));
  std::vector<float> v(16);
  Work w =
      comms[0]->AllReduce(MakeConstBuffer(v.data(), 16), MakeBuffer(v.data(), 16), ReduceOp::kSum);
  // Queued behind it: fails with the same reason.
  Work queued = comms[0]->Barrier();
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(w.IsDone());
  const absl::Time start = absl::Now();
  std::thread watchdog([&] { comms[0]->Abort(absl::AbortedError("watchdog fired")); });
  EXPECT_THAT(w.Wait(absl::Seconds(5)), StatusIs(absl::StatusCode::kAborted,
                                                 AllOf(HasSubstr("all_reduce #1 rank 0/2 [inproc]"),
                                                       HasSubstr("watchdog fired"))));
  EXPECT_THAT(queued.Wait(absl::Seconds(5)), StatusIs(absl::StatusCode::kAborted));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  watchdog.join();
  comms[0]->Abort(absl::OkStatus());  // idempotent
  EXPECT_THAT(comms[0]->status(), StatusIs(absl::StatusCode::kAborted, "watchdog fired"));
  // Rank 1, which never joined the all_reduce, learns through the transport.
  for (int i = 0; i < 100 && comms[1]->status().ok(); ++i) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_THAT(comms[1]->status(), StatusIs(absl::StatusCode::kUnavailable,
                                           AllOf(HasSubstr("peer 0"), HasSubstr("watchdog"))));
}

TEST(Failures, TimeoutWhenOneRankNeverCalls) {
  const int n = 3;
  const absl::Duration timeout = absl::Milliseconds(300);
  Comms comms = MakeGroup(n, {}, timeout);
  std::vector<absl::Status> results(2);
  const absl::Time start = absl::Now();
  OnRanks(2, [&](int r) {  // rank 2 never calls
    std::vector<float> v(1000);
    results[r] = comms[r]
                     ->AllReduce(MakeConstBuffer(v.data(), v.size()),
                                 MakeBuffer(v.data(), v.size()), ReduceOp::kSum)
                     .Wait(kWait);
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  bool timed_out = false;
  for (const absl::Status& s : results) {
    EXPECT_THAT(s, AnyOf(StatusIs(absl::StatusCode::kDeadlineExceeded),
                         StatusIs(absl::StatusCode::kUnavailable)));
    if (s.code() == absl::StatusCode::kDeadlineExceeded) {
      timed_out = true;
      EXPECT_THAT(s.message(), AllOf(HasSubstr("all_reduce #1"), HasSubstr("peer"),
                                     HasSubstr("(timeout 300ms)")));
    }
  }
  EXPECT_TRUE(timed_out);
  // The idle rank finds out too, without issuing anything.
  for (int i = 0; i < 100 && comms[2]->status().ok(); ++i) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_THAT(comms[2]->status(), StatusIs(absl::StatusCode::kUnavailable));
}

TEST(Failures, PerOpTimeoutOverridesTheDefault) {
  Comms comms = MakeGroup(2, {}, absl::Seconds(60));
  OpOptions opts;
  opts.timeout = absl::Milliseconds(100);
  EXPECT_THAT(comms[0]->Barrier(opts).Wait(kWait),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("timeout 100ms")));
}

TEST(Failures, DestroyingACommunicatorCancelsItsWork) {
  Comms comms = MakeGroup(2, {}, absl::Seconds(60));
  Work w = comms[0]->Barrier();
  absl::SleepFor(absl::Milliseconds(50));
  const absl::Time start = absl::Now();
  comms[0].reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_THAT(w.Wait(absl::Seconds(1)), StatusIs(absl::StatusCode::kCancelled));
}

TEST(Split, GroupsByColorOrderedByKey) {
  const int n = 4;
  Comms comms = MakeGroup(n);
  Comms children(n);
  OnRanks(n, [&](int r) {
    // Rank 3 leaves; ranks 0 and 2 form color 0 with rank 2 first (smaller key); rank 1 is
    // alone in color 1.
    const int color = r == 3 ? kNoColor : r % 2;
    auto child = comms[r]->Split(color, /*key=*/-r);
    ASSERT_OK(child.status());
    children[r] = *child;
  });
  EXPECT_EQ(children[3], nullptr);
  ASSERT_NE(children[0], nullptr);
  ASSERT_NE(children[1], nullptr);
  ASSERT_NE(children[2], nullptr);
  EXPECT_EQ(children[2]->rank(), 0);
  EXPECT_EQ(children[0]->rank(), 1);
  EXPECT_EQ(children[0]->size(), 2);
  EXPECT_EQ(children[1]->rank(), 0);
  EXPECT_EQ(children[1]->size(), 1);
  // The children work independently of each other and of the parent.
  std::vector<int> got(n, 0);
  OnRanks(n, [&](int r) {
    if (children[r] == nullptr) return;
    std::vector<int32_t> v = {r + 1};
    ASSERT_OK(children[r]
                  ->AllReduce(MakeConstBuffer(v.data(), 1), MakeBuffer(v.data(), 1), ReduceOp::kSum)
                  .Wait(kWait));
    got[r] = v[0];
  });
  EXPECT_EQ(got, (std::vector<int>{4, 2, 4, 0}));
  OnRanks(n, [&](int r) { EXPECT_OK(comms[r]->Barrier().Wait(kWait)); });
  // A child splits again.
  OnRanks(n, [&](int r) {
    if (r != 0 && r != 2) return;
    auto grandchild = children[r]->Split(0, 0);
    ASSERT_OK(grandchild.status());
    EXPECT_EQ((*grandchild)->size(), 2);
    EXPECT_OK((*grandchild)->Barrier().Wait(kWait));
  });
}

TEST(Options, AlgoKeysAreValidated) {
  auto store = std::make_shared<HashStore>();
  CommConfig config;
  config.store = store;
  config.options = {{"algo.chunk_byte", "4096"}};
  EXPECT_THAT(CreateCommunicator("inproc", config).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("[inproc]"), HasSubstr("algo.chunk_byte"))));
  for (const char* bad : {"", "abc", "-1", "0", "12 ", "99999999999999999999"}) {
    config.options = {{"algo.chunk_bytes", bad}};
    EXPECT_THAT(CreateCommunicator("inproc", config).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("algo.chunk_bytes")))
        << "'" << bad << "'";
  }
  config.options = {{"tcp.nodelay", "1"}};
  EXPECT_THAT(CreateCommunicator("inproc", config).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tcp.nodelay")));
  config.options = {{"algo.small_bytes", "0"}, {"algo.chunk_bytes", "1"}};
  EXPECT_OK(CreateCommunicator("inproc", config).status());
}

TEST(Stores, CommunicatorsSharingAStoreDoNotCollide) {
  auto store = std::make_shared<HashStore>();
  Comms a = MakeGroup(3, {}, kWait, store);
  Comms b = MakeGroup(3, {}, kWait, store);
  Comms named = MakeGroup(3, {}, kWait, store, "experts");
  OnRanks(3, [&](int r) {
    int32_t x = r, y = 10 * r, z = 100 * r;
    Work wa = a[r]->AllReduce(MakeConstBuffer(&x, 1), MakeBuffer(&x, 1), ReduceOp::kSum);
    Work wb = b[r]->AllReduce(MakeConstBuffer(&y, 1), MakeBuffer(&y, 1), ReduceOp::kSum);
    Work wn = named[r]->AllReduce(MakeConstBuffer(&z, 1), MakeBuffer(&z, 1), ReduceOp::kSum);
    EXPECT_OK(wa.Wait(kWait));
    EXPECT_OK(wb.Wait(kWait));
    EXPECT_OK(wn.Wait(kWait));
    EXPECT_EQ(x, 3);
    EXPECT_EQ(y, 30);
    EXPECT_EQ(z, 300);
  });
}

TEST(Stores, SizeOneNeedsNoStore) {
  CommConfig config;
  auto comm = CreateCommunicator("inproc", config);
  ASSERT_OK(comm.status());
  float x = 2;
  EXPECT_OK((*comm)->AllReduce(MakeConstBuffer(&x, 1), MakeBuffer(&x, 1), ReduceOp::kAvg).Wait());
  EXPECT_EQ(x, 2);
}

}  // namespace
}  // namespace fairscale::comm::testing
