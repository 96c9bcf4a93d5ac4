// Every collective of TransportCommunicator (through the inproc backend) against values computed
// in the test: world sizes 1-4, several dtypes and ops, counts 0, 1, 7, 4097 and 20000, in place
// and not, under three algorithm settings:
//   default  direct exchange up to 16 KiB, ring / tree with 512 KiB segments above
//   ring     always ring, 4 KiB segments (a 20000-element message takes many segments)
//   direct   always the direct exchange
#include <atomic>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_matchers.h"
#include "comm/algorithms/test_group.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::comm::testing {
namespace {

const absl::Duration kWait = absl::Seconds(20);

struct Config {
  const char* name;
  Options options;
  size_t max_count = SIZE_MAX;  // larger counts are skipped (they would take too many messages)
};
const std::vector<Config>& Configs() {
  static const auto* configs = new std::vector<Config>{
      {"default", {}},
      {"ring", {{"algo.small_bytes", "0"}, {"algo.chunk_bytes", "4096"}}},
      {"direct", {{"algo.small_bytes", "1073741824"}}},
      // One element per segment (6 bytes is not even a whole f64): the most messages, the most
      // interleaving, the smallest scratch slots.
      {"tiny", {{"algo.small_bytes", "0"}, {"algo.chunk_bytes", "6"}}, 100},
  };
  return *configs;
}

constexpr size_t kCounts[] = {0, 1, 7, 4097, 20000};
constexpr DataType kTypes[] = {DataType::kF32, DataType::kF64, DataType::kBF16,
                               DataType::kF16, DataType::kI32, DataType::kU8};

std::vector<ReduceOp> OpsFor(DataType dtype) {
  std::vector<ReduceOp> ops = {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax};
  if (IsFloatingPoint(dtype)) ops.push_back(ReduceOp::kAvg);
  return ops;
}

// Rank r's element i: small integers, so every dtype holds every partial result exactly and the
// result does not depend on the reduction order (products stay <= 3^4).
double Input(ReduceOp op, DataType dtype, int rank, size_t i) {
  if (op == ReduceOp::kProduct) return 1 + (rank + i) % 3;
  const double v = static_cast<double>((rank * 7 + i * 3) % 11);
  return dtype == DataType::kU8 ? v : v - 5;
}

// The reduction of Input over n ranks at index i, finished the way the kernels finish kAvg
// (divide in f64 for f64, else in f32).
double Expected(ReduceOp op, DataType dtype, int n, size_t i) {
  double acc = Input(op, dtype, 0, i);
  for (int r = 1; r < n; ++r) {
    const double v = Input(op, dtype, r, i);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg: acc += v; break;
      case ReduceOp::kProduct: acc *= v; break;
      case ReduceOp::kMin: acc = std::min(acc, v); break;
      case ReduceOp::kMax: acc = std::max(acc, v); break;
    }
  }
  if (op != ReduceOp::kAvg) return acc;
  if (dtype == DataType::kF64) return acc / n;
  return static_cast<float>(acc) / static_cast<float>(n);
}

// Compares the bytes of got[got_off + i] and want(i) for i < count; reports the first mismatch.
template <typename Want>
void ExpectElements(const Data& got, size_t got_off, size_t count, Want want,
                    const std::string& what) {
  Data w(got.dtype, count);
  for (size_t i = 0; i < count; ++i) w.set(i, want(i));
  const size_t es = SizeOf(got.dtype);
  for (size_t i = 0; i < count; ++i) {
    if (std::memcmp(&got.bytes[(got_off + i) * es], &w.bytes[i * es], es) != 0) {
      ADD_FAILURE() << what << ": element " << i << " is " << got.at(got_off + i) << ", expected "
                    << w.at(i);
      return;
    }
  }
}

std::string What(const char* op, const Config& cfg, int n, int r, DataType dtype, size_t count,
                 bool in_place, absl::string_view extra = "") {
  return absl::StrCat(op, " [", cfg.name, "] n=", n, " rank=", r, " ", DataTypeName(dtype),
                      " count=", count, in_place ? " in-place" : "", extra);
}

// Runs body(config, n, rank, comm) on every rank of a fresh group, for every config and n = 1..4.
void ForEachGroup(const std::function<void(const Config&, int, int, Communicator&)>& body,
                  int min_size = 1) {
  for (const Config& cfg : Configs()) {
    for (int n = min_size; n <= 4; ++n) {
      Comms comms = MakeGroup(n, cfg.options);
      if (static_cast<int>(comms.size()) != n || comms[0] == nullptr) return;
      OnRanks(n, [&](int r) { body(cfg, n, r, *comms[r]); });
    }
  }
}

TEST(Collectives, AllReduce) {
  ForEachGroup([](const Config& cfg, int n, int r, Communicator& comm) {
    for (DataType dtype : kTypes) {
      for (ReduceOp op : OpsFor(dtype)) {
        for (size_t count : kCounts) {
          if (count > cfg.max_count) continue;
          for (bool in_place : {false, true}) {
            const std::string what = What("all_reduce", cfg, n, r, dtype, count, in_place,
                                          absl::StrCat(" ", ReduceOpName(op)));
            Data in(dtype, count), out(dtype, count);
            for (size_t i = 0; i < count; ++i) in.set(i, Input(op, dtype, r, i));
            Data& result = in_place ? in : out;
            ASSERT_OK(comm.AllReduce(in.buffer(), result.buffer(), op).Wait(kWait)) << what;
            ExpectElements(
                result, 0, count, [&](size_t i) { return Expected(op, dtype, n, i); }, what);
          }
        }
      }
    }
  });
}

TEST(Collectives, ReduceScatter) {
  ForEachGroup([](const Config& cfg, int n, int r, Communicator& comm) {
    for (DataType dtype : {DataType::kF32, DataType::kBF16, DataType::kI32}) {
      for (ReduceOp op : OpsFor(dtype)) {
        for (size_t count : {0, 1, 7, 4097}) {
          if (count > cfg.max_count) continue;
          for (bool in_place : {false, true}) {
            const std::string what = What("reduce_scatter", cfg, n, r, dtype, count, in_place,
                                          absl::StrCat(" ", ReduceOpName(op)));
            Data in(dtype, n * count), out(dtype, count);
            for (size_t i = 0; i < n * count; ++i) in.set(i, Input(op, dtype, r, i));
            Buffer recv = in_place ? in.slice(r * count, count) : out.buffer();
            ASSERT_OK(comm.ReduceScatter(in.buffer(), recv, op).Wait(kWait)) << what;
            ExpectElements(
                in_place ? in : out, in_place ? r * count : 0, count,
                [&](size_t i) { return Expected(op, dtype, n, r * count + i); }, what);
          }
        }
      }
    }
  });
}

double GatherValue(int rank, size_t i) { return static_cast<double>((rank * 13 + i) % 17); }

TEST(Collectives, AllGather) {
  ForEachGroup([](const Config& cfg, int n, int r, Communicator& comm) {
    for (DataType dtype : {DataType::kF32, DataType::kF16, DataType::kU8, DataType::kF64}) {
      for (size_t count : kCounts) {
        if (count > cfg.max_count) continue;
        for (bool in_place : {false, true}) {
          const std::string what = What("all_gather", cfg, n, r, dtype, count, in_place);
          Data in(dtype, count), out(dtype, n * count);
          for (size_t i = 0; i < count; ++i) {
            in.set(i, GatherValue(r, i));
            out.set(r * count + i, GatherValue(r, i));
          }
          ConstBuffer send = in_place ? ConstBuffer(out.slice(r * count, count)) : in.buffer();
          ASSERT_OK(comm.AllGather(send, out.buffer()).Wait(kWait)) << what;
          ExpectElements(
              out, 0, n * count,
              [&](size_t i) {
                return GatherValue(i / std::max<size_t>(count, 1), i % std::max<size_t>(count, 1));
              },
              what);
        }
      }
    }
  });
}

TEST(Collectives, Broadcast) {
  ForEachGroup([](const Config& cfg, int n, int r, Communicator& comm) {
    for (int root = 0; root < n; ++root) {
      for (size_t count : kCounts) {
        if (count > cfg.max_count) continue;
        const std::string what = What("broadcast", cfg, n, r, DataType::kI32, count, false,
                                      absl::StrCat(" root=", root));
        Data buf(DataType::kI32, count);
        for (size_t i = 0; i < count; ++i) buf.set(i, r == root ? GatherValue(root, i) : -1);
        ASSERT_OK(comm.Broadcast(buf.buffer(), root).Wait(kWait)) << what;
        ExpectElements(
            buf, 0, count, [&](size_t i) { return GatherValue(root, i); }, what);
      }
    }
  });
}

TEST(Collectives, Reduce) {
  ForEachGroup([](const Config& cfg, int n, int r, Communicator& comm) {
    for (DataType dtype : {DataType::kF32, DataType::kBF16, DataType::kI32}) {
      for (ReduceOp op : OpsFor(dtype)) {
        for (int root = 0; root < n; ++root) {
          for (size_t count : kCounts) {
            if (count > cfg.max_count) continue;
            for (bool in_place : {false, true}) {
              const std::string what = What("reduce", cfg, n, r, dtype, count, in_place,
                                            absl::StrCat(" ", ReduceOpName(op), " root=", root));
              Data in(dtype, count), out(dtype, count);
              for (size_t i = 0; i < count; ++i) in.set(i, Input(op, dtype, r, i));
              Data& result = in_place ? in : out;
              Buffer recv = r == root ? result.buffer() : Buffer{};
              ASSERT_OK(comm.Reduce(in.buffer(), recv, op, root).Wait(kWait)) << what;
              if (r == root) {
                ExpectElements(
                    result, 0, count, [&](size_t i) { return Expected(op, dtype, n, i); }, what);
              }
            }
          }
        }
      }
    }
  });
}

double AllToAllValue(int from, int to, size_t k) {
  return static_cast<double>((from * 31 + to * 7 + k) % 23);
}

TEST(Collectives, AllToAll) {
  ForEachGroup([](const Config& cfg, int n, int r, Communicator& comm) {
    for (size_t block : {0, 1, 7, 1100}) {
      if (block > cfg.max_count) continue;
      const std::string what = What("all_to_all", cfg, n, r, DataType::kF32, block, false);
      Data in(DataType::kF32, n * block), out(DataType::kF32, n * block);
      for (int to = 0; to < n; ++to) {
        for (size_t k = 0; k < block; ++k) in.set(to * block + k, AllToAllValue(r, to, k));
      }
      ASSERT_OK(comm.AllToAll(in.buffer(), out.buffer()).Wait(kWait)) << what;
      ExpectElements(
          out, 0, n * block, [&](size_t i) { return AllToAllValue(i / block, r, i % block); },
          what);
    }
  });
}

// Every pair (a < b), in one global order: a sends then receives, b receives then sends. Each
// message is a two-part sequence (ordering per pair) with a 20000-element part (segmented).
TEST(Collectives, SendRecv) {
  ForEachGroup(
      [](const Config& cfg, int n, int r, Communicator& comm) {
        const size_t kSizes[] = {0, 7, cfg.max_count < 20000 ? size_t{50} : size_t{20000}};
        std::vector<std::unique_ptr<Data>> keep;
        std::vector<Work> works;
        std::vector<std::pair<Data*, double>> checks;  // received buffer, its sender's seed
        auto seed = [](int from, int to, size_t part) { return from * 100 + to * 10 + part; };
        auto message = [&](int from, int to, size_t part, bool fill) {
          keep.push_back(std::make_unique<Data>(DataType::kI32, kSizes[part]));
          Data* d = keep.back().get();
          for (size_t i = 0; i < d->count; ++i) {
            d->set(i, fill ? seed(from, to, part) + i % 7 : -1);
          }
          return d;
        };
        for (int a = 0; a < n; ++a) {
          for (int b = a + 1; b < n; ++b) {
            if (r != a && r != b) continue;
            const int peer = r == a ? b : a;
            for (bool a_sends : {true, false}) {
              const bool sending = (r == a) == a_sends;
              for (size_t part = 0; part < 3; ++part) {
                if (sending) {
                  works.push_back(comm.Send(message(r, peer, part, true)->buffer(), peer));
                } else {
                  Data* d = message(peer, r, part, false);
                  checks.emplace_back(d, seed(peer, r, part));
                  works.push_back(comm.Recv(d->buffer(), peer));
                }
              }
            }
          }
        }
        for (Work& w : works) ASSERT_OK(w.Wait(kWait)) << cfg.name << " n=" << n << " r=" << r;
        for (auto& [d, s] : checks) {
          ExpectElements(
              *d, 0, d->count, [&](size_t i) { return s + i % 7; },
              absl::StrCat("recv [", cfg.name, "] n=", n, " rank=", r));
        }
      },
      /*min_size=*/2);
}

// Every rank sends to r+1 and receives from r-1 at the same time: with plain Send then Recv this
// waits until the timeout on a rendezvous transport; a batch must not. Odd ranks use a batch,
// even ranks plain Send/Recv issued back to back (they match item for item), except n == 1.
TEST(Collectives, BatchP2PRingExchange) {
  ForEachGroup(
      [](const Config& cfg, int n, int r, Communicator& comm) {
        const size_t count = cfg.max_count < 100000 ? 33 : 100003;
        const int next = (r + 1) % n, prev = (r + n - 1) % n;
        std::vector<int32_t> out(count), in(count, -1), back(count, -1);
        for (size_t i = 0; i < count; ++i) out[i] = static_cast<int32_t>(r * 1000 + i % 97);
        // Round 1: everyone in one batch. Round 2: a batch with two items to/from the same peer
        // when n == 2 (ordering per peer), else the reverse direction.
        ASSERT_OK(comm.BatchP2P({P2POp::Recv(MakeBuffer(in.data(), count), prev),
                                 P2POp::Send(MakeConstBuffer(out.data(), count), next)})
                      .Wait(kWait))
            << cfg.name << " n=" << n << " r=" << r;
        for (size_t i = 0; i < count; ++i) {
          ASSERT_EQ(in[i], static_cast<int32_t>(prev * 1000 + i % 97)) << cfg.name << " i=" << i;
        }
        ASSERT_OK(comm.BatchP2P({P2POp::Send(MakeConstBuffer(in.data(), count), prev),
                                 P2POp::Recv(MakeBuffer(back.data(), count), next)})
                      .Wait(kWait));
        EXPECT_EQ(back, out) << cfg.name << " n=" << n << " r=" << r;
        // Empty batch.
        EXPECT_OK(comm.BatchP2P({}).Wait(kWait));
      },
      /*min_size=*/2);
}

TEST(Collectives, BatchP2PMatchesPlainSendRecv) {
  Comms comms = MakeGroup(2);
  ASSERT_EQ(comms.size(), 2u);
  std::vector<float> a(5000, 1.5f), b(5000, 0.f), c(7, 2.f), d(7, 0.f);
  OnRanks(2, [&](int r) {
    if (r == 0) {
      ASSERT_OK(comms[0]->BatchP2P({P2POp::Send(MakeConstBuffer(a.data(), a.size()), 1),
                                    P2POp::Recv(MakeBuffer(d.data(), d.size()), 1)})
                    .Wait(kWait));
    } else {
      Work got = comms[1]->Recv(MakeBuffer(b.data(), b.size()), 0);
      ASSERT_OK(got.Wait(kWait));
      ASSERT_OK(comms[1]->Send(MakeConstBuffer(c.data(), c.size()), 0).Wait(kWait));
    }
  });
  EXPECT_EQ(b, a);
  EXPECT_EQ(d, c);
}

TEST(Collectives, BatchP2PRejectsBadItems) {
  Comms comms = MakeGroup(2);
  ASSERT_EQ(comms.size(), 2u);
  std::vector<float> a(8);
  EXPECT_THAT(comms[0]->BatchP2P({P2POp::Send(MakeConstBuffer(a.data(), 8), 0)}).Wait(kWait),
              fairscale::base::testing::StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(comms[0]->BatchP2P({P2POp::Recv(MakeBuffer(a.data(), 8), 1),
                                  P2POp::Recv(MakeBuffer(a.data() + 4, 4), 1)})
                  .Wait(kWait),
              fairscale::base::testing::StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(Collectives, BarrierWaitsForEveryRank) {
  ForEachGroup([](const Config& cfg, int n, int r, Communicator& comm) {
    static std::atomic<int> entered[3];
    if (r == 0) {
      for (auto& e : entered) e = 0;
    }
    ASSERT_OK(comm.Barrier().Wait(kWait));  // nobody touches the counters before the reset
    for (int round = 0; round < 3; ++round) {
      absl::SleepFor(absl::Milliseconds(5 * ((r + round) % n)));
      ++entered[round];
      ASSERT_OK(comm.Barrier().Wait(kWait));
      EXPECT_EQ(entered[round].load(), n) << cfg.name << " n=" << n << " rank " << r;
    }
    ASSERT_OK(comm.Barrier().Wait(kWait));  // keep the counters until every rank has checked
  });
}

// Non-integer data: sums depend on the order of additions, so this checks that every rank ends
// with the same bits (each block is reduced once, then copied) and that the values are right.
TEST(Collectives, AllReduceIsBitIdenticalOnAllRanks) {
  for (const Config& cfg : Configs()) {
    for (int n : {3, 4}) {
      const size_t count = 20000;
      std::vector<Data> data;
      std::vector<double> want(count, 0.0);
      std::mt19937 rng(42);
      std::uniform_real_distribution<float> dist(-1, 1);
      for (int r = 0; r < n; ++r) {
        data.emplace_back(DataType::kF32, count);
        for (size_t i = 0; i < count; ++i) {
          data[r].set(i, dist(rng));
          want[i] += data[r].at(i);
        }
      }
      Comms comms = MakeGroup(n, cfg.options);
      OnRanks(n, [&](int r) {
        Buffer b = data[r].buffer();
        EXPECT_OK(comms[r]->AllReduce(b, b, ReduceOp::kSum).Wait(kWait));
      });
      for (int r = 1; r < n; ++r) {
        EXPECT_EQ(data[r].bytes, data[0].bytes) << cfg.name << " n=" << n << " rank " << r;
      }
      for (size_t i = 0; i < count; ++i) {
        ASSERT_NEAR(data[0].at(i), want[i], 1e-5) << cfg.name << " element " << i;
      }
    }
  }
}

TEST(Collectives, LargeAllReduceWithDefaultSegments) {
  const int n = 4;
  const size_t count = (size_t{3} << 20) + 5;  // 12 MiB of f32: several 512 KiB segments per block
  Comms comms = MakeGroup(n);
  OnRanks(n, [&](int r) {
    std::vector<float> v(count);
    for (size_t i = 0; i < count; ++i) v[i] = static_cast<float>((r + i) % 5);
    ASSERT_OK(comms[r]
                  ->AllReduce(MakeConstBuffer(v.data(), count), MakeBuffer(v.data(), count),
                              ReduceOp::kSum)
                  .Wait(kWait));
    for (size_t i = 0; i < count; ++i) {
      float want = 0;
      for (int q = 0; q < n; ++q) want += static_cast<float>((q + i) % 5);
      if (v[i] != want) {
        ADD_FAILURE() << "rank " << r << " element " << i << ": " << v[i] << " != " << want;
        return;
      }
    }
  });
}

}  // namespace
}  // namespace fairscale::comm::testing
