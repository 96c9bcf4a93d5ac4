// End to end through the registry: CreateCommunicator("tcp", ...) with 2 and 3 ranks as threads
// sharing a HashStore, then collectives checked against values computed here. (The exhaustive
// multi-process suite is //comm/testing's conformance test instantiated for "tcp".)
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/communicator.h"
#include "comm/config.h"
#include "comm/registry.h"
#include "comm/store/hash_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::comm {
namespace {

using ::fairscale::base::testing::StatusIs;
using ::testing::HasSubstr;

constexpr absl::Duration kTimeout = absl::Seconds(20);

// Runs fn(rank, communicator) on one thread per rank; returns each rank's status.
std::vector<absl::Status> RunTcp(
    int n, const std::function<absl::Status(int, Communicator&)>& fn) {
  auto store = std::make_shared<HashStore>();
  std::vector<absl::Status> status(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      CommConfig config;
      config.rank = r;
      config.size = n;
      config.store = store;
      config.timeout = kTimeout;
      auto comm = CreateCommunicator("tcp", config);
      status[r] = comm.ok() ? fn(r, **comm) : comm.status();
    });
  }
  for (auto& t : threads) t.join();
  return status;
}

class TcpCommunicator : public ::testing::TestWithParam<int> {};

TEST_P(TcpCommunicator, AllReduceSumsEveryRanksInput) {
  const int n = GetParam();
  for (size_t count : {size_t{0}, size_t{1}, size_t{1000}, size_t{3} << 20}) {
    auto statuses = RunTcp(n, [&](int rank, Communicator& comm) -> absl::Status {
      if (comm.backend() != "tcp") return absl::InternalError("wrong backend");
      std::vector<float> in(count), out(count, -1.f);
      for (size_t i = 0; i < count; ++i) in[i] = static_cast<float>((i % 97) + rank);
      FS_RETURN_IF_ERROR(
          comm.AllReduce(ConstBuffer{in.data(), count, DataType::kF32},
                         Buffer{out.data(), count, DataType::kF32}, ReduceOp::kSum)
              .Wait(kTimeout));
      for (size_t i = 0; i < count; ++i) {
        const float want = static_cast<float>(n * (i % 97) + n * (n - 1) / 2);
        if (out[i] != want) {
          return absl::DataLossError(absl::StrCat("count ", count, " element ", i, ": ",
                                                  out[i], " != ", want));
        }
      }
      return absl::OkStatus();
    });
    for (int r = 0; r < n; ++r) EXPECT_OK(statuses[r]) << "rank " << r << " count " << count;
  }
}

TEST_P(TcpCommunicator, SendRecvAndBarrier) {
  const int n = GetParam();
  auto statuses = RunTcp(n, [&](int rank, Communicator& comm) -> absl::Status {
    std::vector<int32_t> out(257, rank), in(257, -1);
    const int next = (rank + 1) % n, prev = (rank + n - 1) % n;
    Work s = comm.Send(ConstBuffer{out.data(), out.size(), DataType::kI32}, next);
    Work r = comm.Recv(Buffer{in.data(), in.size(), DataType::kI32}, prev);
    FS_RETURN_IF_ERROR(s.Wait(kTimeout));
    FS_RETURN_IF_ERROR(r.Wait(kTimeout));
    if (in != std::vector<int32_t>(257, prev)) return absl::DataLossError("recv");
    return comm.Barrier().Wait(kTimeout);
  });
  for (int r = 0; r < n; ++r) EXPECT_OK(statuses[r]) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Ranks, TcpCommunicator, ::testing::Values(2, 3),
                         [](const auto& info) { return absl::StrCat(info.param, "ranks"); });

TEST(TcpBackend, UnknownOptionIsInvalidArgument) {
  CommConfig config;
  config.store = std::make_shared<HashStore>();
  config.options["tcp.turbo"] = "1";
  EXPECT_THAT(CreateCommunicator("tcp", config).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tcp.turbo")));
}

}  // namespace
}  // namespace fairscale::comm
