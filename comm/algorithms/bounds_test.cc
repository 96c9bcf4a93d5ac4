// The algorithms called directly over recording inproc transports: messages never exceed
// algo.chunk_bytes, scratch stays at a few segments however large the message, the message
// counts are those of the documented algorithms, and a schedule that breaks the rules is
// reported as kInternal instead of deadlocking.
#include <algorithm>
#include <memory>
#include <vector>

#include "absl/time/clock.h"
#include "base/status_matchers.h"
#include "comm/algorithms/algorithms.h"
#include "comm/algorithms/test_group.h"
#include "comm/inproc/inproc_transport.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::comm::testing {
namespace {

using ::fairscale::base::testing::StatusIs;

// Forwards to an inproc transport and records what is sent.
class RecordingTransport : public Transport {
 public:
  explicit RecordingTransport(std::unique_ptr<Transport> t) : t_(std::move(t)) {}
  int rank() const override { return t_->rank(); }
  int size() const override { return t_->size(); }
  Request Isend(int peer, uint64_t tag, const void* data, size_t bytes) override {
    ++sends;
    max_bytes = std::max(max_bytes, bytes);
    return t_->Isend(peer, tag, data, bytes);
  }
  Request Irecv(int peer, uint64_t tag, void* data, size_t bytes) override {
    return t_->Irecv(peer, tag, data, bytes);
  }
  absl::Status Wait(absl::Span<const Request> r, absl::Time d) override { return t_->Wait(r, d); }
  absl::Status Poll() override { return t_->Poll(); }
  void Cancel(const absl::Status& s) override { t_->Cancel(s); }
  void Shutdown(const absl::Status& s) override { t_->Shutdown(s); }

  size_t sends = 0;
  size_t max_bytes = 0;

 private:
  std::unique_ptr<Transport> t_;
};

struct Rank {
  std::unique_ptr<RecordingTransport> transport;
  algo::Scratch scratch;
  algo::Context ctx;
};

std::vector<Rank> MakeRanks(int n, size_t chunk_bytes, size_t small_bytes) {
  auto store = std::make_shared<HashStore>();
  std::vector<Rank> ranks(n);
  for (int r = 0; r < n; ++r) {
    auto t = CreateInprocTransport(store, r, n, absl::Seconds(5));
    EXPECT_TRUE(t.ok()) << t.status();
    ranks[r].transport = std::make_unique<RecordingTransport>(std::move(t).value());
    ranks[r].ctx.transport = ranks[r].transport.get();
    ranks[r].ctx.tag = MakeTag(OpType::kAllReduce, 1);
    ranks[r].ctx.deadline = absl::Now() + absl::Seconds(20);
    ranks[r].ctx.options.chunk_bytes = chunk_bytes;
    ranks[r].ctx.options.small_bytes = small_bytes;
    ranks[r].ctx.scratch = &ranks[r].scratch;
  }
  return ranks;
}

TEST(Bounds, RingAllReduceUsesBoundedScratchAndChunkSizedMessages) {
  const int n = 4;
  const size_t chunk = 4096;
  const size_t count = 1 << 18;  // 1 MiB of f32: 64 segments per block
  std::vector<Rank> ranks = MakeRanks(n, chunk, 0);
  std::vector<std::vector<float>> data(n, std::vector<float>(count, 1.0f));
  OnRanks(n, [&](int r) {
    Buffer b = MakeBuffer(data[r].data(), count);
    EXPECT_OK(algo::AllReduce(ranks[r].ctx, b, b, ReduceOp::kSum));
  });
  const size_t segments_per_block = count / n * sizeof(float) / chunk;
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(data[r][r * 1000], 4.0f);
    EXPECT_LE(ranks[r].transport->max_bytes, chunk);
    EXPECT_LE(ranks[r].scratch.capacity(), 4 * chunk);  // never O(message)
    // Reduce-scatter and all-gather each send n-1 blocks.
    EXPECT_EQ(ranks[r].transport->sends, 2 * (n - 1) * segments_per_block);
  }
}

TEST(Bounds, RingReduceScatterInPlaceUsesBoundedScratch) {
  const int n = 3;
  const size_t chunk = 1024;
  const size_t block = 10000;
  std::vector<Rank> ranks = MakeRanks(n, chunk, 0);
  std::vector<std::vector<int32_t>> data(n, std::vector<int32_t>(n * block));
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < n * block; ++i) data[r][i] = static_cast<int32_t>(r + i);
  }
  OnRanks(n, [&](int r) {
    Buffer all = MakeBuffer(data[r].data(), n * block);
    EXPECT_OK(algo::ReduceScatter(ranks[r].ctx, all, all.Slice(r * block, block), ReduceOp::kSum));
  });
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < block; i += 97) {
      const size_t at = r * block + i;
      ASSERT_EQ(data[r][at], static_cast<int32_t>(3 * at + 3)) << r << " " << i;  // 0+1+2 + 3*at
    }
    EXPECT_LE(ranks[r].transport->max_bytes, chunk);
    EXPECT_LE(ranks[r].scratch.capacity(), 4 * chunk);
  }
}

TEST(Bounds, TreeReduceSendsOneMessagePerEdgeAndSegment) {
  const int n = 4;
  const size_t chunk = 512;
  const size_t count = 5000;  // 40 segments of f32
  std::vector<Rank> ranks = MakeRanks(n, chunk, 0);
  std::vector<std::vector<float>> data(n, std::vector<float>(count, 1.0f));
  std::vector<float> result(count);
  OnRanks(n, [&](int r) {
    Buffer in = MakeBuffer(data[r].data(), count);
    EXPECT_OK(algo::Reduce(ranks[r].ctx, in, r == 2 ? MakeBuffer(result.data(), count) : Buffer{},
                           ReduceOp::kSum, /*root=*/2));
  });
  EXPECT_EQ(result, std::vector<float>(count, 4.0f));
  const size_t segments = (count * sizeof(float) + chunk - 1) / chunk;
  size_t total_sends = 0;
  for (int r = 0; r < n; ++r) {
    EXPECT_LE(ranks[r].transport->max_bytes, chunk);
    EXPECT_LE(ranks[r].scratch.capacity(), 4 * chunk);
    total_sends += ranks[r].transport->sends;
  }
  EXPECT_EQ(total_sends, (n - 1) * segments);  // one message per tree edge and segment
}

TEST(Bounds, DirectAllReduceSendsOneMessagePerPeer) {
  const int n = 3;
  std::vector<Rank> ranks = MakeRanks(n, 4096, 1 << 20);
  std::vector<std::vector<double>> data(n, std::vector<double>(10000, 0.5));
  OnRanks(n, [&](int r) {
    Buffer b = MakeBuffer(data[r].data(), data[r].size());
    EXPECT_OK(algo::AllReduce(ranks[r].ctx, b, b, ReduceOp::kAvg));
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(ranks[r].transport->sends, static_cast<size_t>(n - 1));
    EXPECT_EQ(data[r], std::vector<double>(10000, 0.5));
  }
}

// Size 1 is pure local copies: a transport that fails the test on any call proves it.
class UntouchableTransport : public Transport {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Request Isend(int, uint64_t, const void*, size_t) override { return Fail(); }
  Request Irecv(int, uint64_t, void*, size_t) override { return Fail(); }
  absl::Status Wait(absl::Span<const Request>, absl::Time) override {
    Fail();
    return absl::OkStatus();
  }
  absl::Status Poll() override {
    Fail();
    return absl::OkStatus();
  }
  void Cancel(const absl::Status&) override { Fail(); }
  void Shutdown(const absl::Status&) override { Fail(); }

 private:
  static Request Fail() {
    ADD_FAILURE() << "size 1 touched the transport";
    return 1;
  }
};

TEST(Bounds, SizeOneMakesNoTransportCalls) {
  UntouchableTransport t;
  algo::Scratch scratch;
  algo::Context ctx;
  ctx.transport = &t;
  ctx.scratch = &scratch;
  for (size_t small : {size_t{0}, size_t{1} << 20}) {
    ctx.options.small_bytes = small;
    std::vector<float> a = {1, 2, 3, 4}, b(4);
    EXPECT_OK(algo::AllReduce(ctx, MakeConstBuffer(a.data(), 4), MakeBuffer(b.data(), 4),
                              ReduceOp::kAvg));
    EXPECT_EQ(b, a);
    b.assign(4, 0);
    EXPECT_OK(algo::ReduceScatter(ctx, MakeConstBuffer(a.data(), 4), MakeBuffer(b.data(), 4),
                                  ReduceOp::kSum));
    EXPECT_EQ(b, a);
    b.assign(4, 0);
    EXPECT_OK(algo::AllGather(ctx, MakeConstBuffer(a.data(), 4), MakeBuffer(b.data(), 4)));
    EXPECT_EQ(b, a);
    b.assign(4, 0);
    EXPECT_OK(algo::AllToAll(ctx, MakeConstBuffer(a.data(), 4), MakeBuffer(b.data(), 4)));
    EXPECT_EQ(b, a);
    b.assign(4, 0);
    EXPECT_OK(algo::Reduce(ctx, MakeConstBuffer(a.data(), 4), MakeBuffer(b.data(), 4),
                           ReduceOp::kMax, 0));
    EXPECT_EQ(b, a);
    EXPECT_OK(algo::Broadcast(ctx, MakeBuffer(a.data(), 4), 0));
    EXPECT_OK(algo::Barrier(ctx));
  }
}

}  // namespace
}  // namespace fairscale::comm::testing
