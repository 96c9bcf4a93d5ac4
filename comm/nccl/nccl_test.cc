// The "nccl" backend on device buffers: every op, every dtype and reduce op, counts 0, 1, odd and
// large, in-place, Split, Abort, timeout, a killed peer and host buffers rejected. Ranks are threads of this
// process, one CUDA device each (NCCL refuses two ranks of one communicator on one device), so a
// world size above the device count is skipped, unless FS_NCCL_TEST_SHARED_GPU=1: then such
// world sizes (up to 4) run as processes that share the devices, each told by NCCL_HOSTID that
// it is a host of its own, so NCCL connects them over sockets on 127.0.0.1 (a one-GPU machine
// checks the multi-rank paths that way; not a performance setup). Expected values come from
// //comm/testing:reference (computed here, never by a backend). Without a GPU every case
// GTEST_SKIPs with the reason, except CreateWithoutDeviceFails, which checks that very error.
//
// On a GPU machine: ./bazelw test --config=cuda //comm/nccl/...  (see README.md)
#include <cuda_runtime_api.h>
#include <signal.h>
#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/communicator.h"
#include "comm/config.h"
#include "comm/registry.h"
#include "comm/store/hash_store.h"
#include "comm/testing/rank_runner.h"
#include "comm/testing/reference.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::comm {
namespace {

using ::fairscale::base::testing::StatusIs;
using ::fairscale::comm::testing::Check;
using ::fairscale::comm::testing::DecodeValue;
using ::fairscale::comm::testing::EncodeValue;
using ::fairscale::comm::testing::MovementKey;
using ::fairscale::comm::testing::MovementValue;
using ::fairscale::comm::testing::RankBody;
using ::fairscale::comm::testing::RankConfig;
using ::fairscale::comm::testing::ReductionInput;
using ::fairscale::comm::testing::ReferenceReduction;
using ::fairscale::comm::testing::RunThreads;
using ::testing::HasSubstr;

constexpr const auto& kDataTypes = ::fairscale::comm::testing::kAllDataTypes;
constexpr const auto& kReduceOps = ::fairscale::comm::testing::kAllReduceOps;
constexpr size_t kCounts[] = {0, 1, 7, 4097, size_t{1} << 20};
constexpr absl::Duration kRunTimeout = absl::Minutes(4);

int DeviceCount(std::string* why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    *why = absl::StrCat("no CUDA device: cudaGetDeviceCount returned ", cudaGetErrorName(e), " (",
                        cudaGetErrorString(e), ")");
    return 0;
  }
  if (n == 0) *why = "no CUDA device: cudaGetDeviceCount returned 0 devices";
  return n;
}

// FS_NCCL_TEST_SHARED_GPU=1: ranks beyond the device count run as processes sharing devices.
bool SharedGpu() {
  const char* v = getenv("FS_NCCL_TEST_SHARED_GPU");
  return v != nullptr && absl::string_view(v) == "1";
}

// Why a test needing `ranks` devices cannot run here, or nothing.
std::optional<std::string> SkipReason(int ranks) {
  std::string why;
  const int have = DeviceCount(&why);
  if (have == 0) return why;
  if (have < ranks && !SharedGpu()) {
    return absl::StrCat("needs ", ranks, " CUDA devices (one per rank), found ", have,
                        "; FS_NCCL_TEST_SHARED_GPU=1 runs the ranks as processes sharing them");
  }
  return std::nullopt;
}

// World sizes this machine can run: 1 .. min(devices, 4), or 1 .. 4 when sharing devices.
std::vector<int> WorldSizes() {
  std::string why;
  const int have = DeviceCount(&why);
  std::vector<int> sizes;
  for (int n = 1; n <= std::min(SharedGpu() && have > 0 ? 4 : have, 4); ++n) sizes.push_back(n);
  return sizes;
}

// The device of `rank`: its own, or shared round-robin (the backend's default is the same).
int DeviceOf(int rank) {
  std::string why;
  const int have = DeviceCount(&why);
  return have > 0 ? rank % have : 0;
}

// In a rank process sharing a device: NCCL takes this process for host `rank` of its own (its
// duplicate-device check compares host and bus id) and connects over sockets on lo.
void PretendOwnHost(int rank) {
  setenv("NCCL_HOSTID", absl::StrCat("fs-nccl-test-host-", rank).c_str(), 1);
  setenv("NCCL_SOCKET_IFNAME", "lo", 1);
  setenv("NCCL_P2P_DISABLE", "1", 1);
  setenv("NCCL_SHM_DISABLE", "1", 1);
  setenv("NCCL_IB_DISABLE", "1", 1);
}

// Runs the n ranks as threads with a device each, or (more ranks than devices, sharing allowed)
// as processes that NCCL takes for separate hosts (PretendOwnHost).
// In a rank process, the thread runs that precede its RunProcesses call are not repeated.
std::vector<absl::Status> RunRanksHere(int n, RankBody body) {
  std::string why;
  if (n <= DeviceCount(&why)) {
    if (testing::IsRankProcess()) return std::vector<absl::Status>(n);
    return RunThreads(n, std::move(body), kRunTimeout);
  }
  return testing::RunProcesses(n, [body](int r) -> absl::Status {
    PretendOwnHost(r);
    return body(r);
  }, kRunTimeout);
}

// Device memory of one rank, with host copies in and out.
class DeviceArray {
 public:
  // `rank`'s device (DeviceOf).
  DeviceArray(int rank, size_t count, DataType dtype)
      : device_(DeviceOf(rank)), count_(count), dtype_(dtype) {
    cudaSetDevice(device_);
    status_ = cudaMalloc(&data_, std::max<size_t>(1, count * SizeOf(dtype)));
  }
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  Buffer buffer() const { return {data_, count_, dtype_, Device::Cuda(device_)}; }
  Buffer slice(size_t offset, size_t n) const { return buffer().Slice(offset, n); }

  // Element i = value(i).
  template <typename F>
  absl::Status Fill(F value) {
    if (status_ != cudaSuccess) return Error("cudaMalloc", status_);
    std::vector<char> host(count_ * SizeOf(dtype_));
    for (size_t i = 0; i < count_; ++i) EncodeValue(dtype_, value(i), &host[i * SizeOf(dtype_)]);
    cudaError_t e = cudaMemcpy(data_, host.data(), host.size(), cudaMemcpyHostToDevice);
    return e == cudaSuccess ? absl::OkStatus() : Error("cudaMemcpy to device", e);
  }

  absl::StatusOr<std::vector<long double>> Read() const {
    std::vector<char> host(count_ * SizeOf(dtype_));
    cudaError_t e = cudaMemcpy(host.data(), data_, host.size(), cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) return Error("cudaMemcpy to host", e);
    std::vector<long double> out(count_);
    for (size_t i = 0; i < count_; ++i) out[i] = DecodeValue(dtype_, &host[i * SizeOf(dtype_)]);
    return out;
  }

 private:
  static absl::Status Error(absl::string_view what, cudaError_t e) {
    return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
  }
  int device_;
  size_t count_;
  DataType dtype_;
  void* data_ = nullptr;
  cudaError_t status_ = cudaSuccess;
};

// Element `index` of a reduction over n ranks: exact for every op but kAvg. NCCL computes a
// floating-point average as the sum of the inputs each premultiplied by 1/n (ncclDevPreMulSum),
// so its rounding error scales with the inputs, not with the result (which may cancel): the
// tolerance is relative to the largest input.
absl::Status CheckReduced(DataType dtype, ReduceOp op, int n, size_t index, long double got,
                          const std::string& what) {
  const long double want = ReferenceReduction(dtype, op, n, index);
  bool ok = got == want;
  if (op == ReduceOp::kAvg) {
    long double scale = 1;
    for (int r = 0; r < n; ++r) {
      scale = std::max(scale, std::fabs(ReductionInput(dtype, op, r, index)));
    }
    ok = std::fabs(static_cast<double>(got - want)) <=
         testing::AvgTolerance(dtype) * static_cast<double>(scale);
  }
  if (ok) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("wrong result: ", what, ": got ",
                                          static_cast<double>(got), ", want ",
                                          static_cast<double>(want)));
}

std::string Case(absl::string_view op, DataType dtype, ReduceOp rop, size_t count, int n) {
  return absl::StrCat(op, " ", DataTypeName(dtype), " ", ReduceOpName(rop), " count ", count,
                      " at ", n, " ranks");
}

bool Valid(DataType dtype, ReduceOp op) {
  return op != ReduceOp::kAvg || IsFloatingPoint(dtype);
}

absl::StatusOr<std::shared_ptr<Communicator>> Create(absl::string_view name,
                                                     absl::Duration timeout = absl::Seconds(60)) {
  CommConfig config = RankConfig(timeout);
  config.name = std::string(name);
  return CreateCommunicator("nccl", config);
}

// ---------------------------------------------------------------------------------------------

TEST(NcclBackend, CreateWithoutDeviceFails) {
  std::string why;
  if (DeviceCount(&why) > 0) GTEST_SKIP() << "a CUDA device is present";
  CommConfig config;
  config.store = std::make_shared<HashStore>();
  EXPECT_THAT(CreateCommunicator("nccl", config),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("[nccl] rank 0/1: no CUDA device: cudaGetDeviceCount returned")));
}

TEST(NcclBackend, RejectsHostBuffersNamingTheOp) {
  if (auto why = SkipReason(1)) GTEST_SKIP() << *why;
  std::vector<absl::Status> results = RunThreads(1, [](int rank) -> absl::Status {
    FS_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm, Create("host"));
    std::vector<float> x(4), y(4);
    absl::Status s = comm->AllReduce(MakeConstBuffer(x.data(), 4), MakeBuffer(y.data(), 4),
                                     ReduceOp::kSum)
                         .Wait(absl::Seconds(30));
    FS_RETURN_IF_ERROR(Check(absl::IsInvalidArgument(s) &&
                                 absl::StrContains(s.message(), "all_reduce #1 rank 0/1 [nccl]") &&
                                 absl::StrContains(s.message(), "cpu"),
                             absl::StrCat("host all_reduce: ", s.ToString())));
    s = comm->Broadcast(MakeBuffer(y.data(), 4), 0).Wait(absl::Seconds(30));
    return Check(absl::IsInvalidArgument(s) && absl::StrContains(s.message(), "broadcast"),
                 absl::StrCat("host broadcast: ", s.ToString()));
  }, kRunTimeout);
  EXPECT_OK(results[0]);
}

absl::Status ReductionsAt(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  int case_index = 0;
  for (DataType dtype : kDataTypes) {
    for (ReduceOp op : kReduceOps) {
      if (!Valid(dtype, op)) continue;
      for (size_t count : kCounts) {
        // all_reduce, out of place and in place.
        for (bool in_place : {false, true}) {
          DeviceArray send(r, count, dtype), recv(r, count, dtype);
          FS_RETURN_IF_ERROR(send.Fill([&](size_t i) { return ReductionInput(dtype, op, r, i); }));
          Buffer out = in_place ? send.buffer() : recv.buffer();
          FS_RETURN_IF_ERROR(comm.AllReduce(send.buffer(), out, op).Wait(absl::Seconds(60)));
          FS_ASSIGN_OR_RETURN(std::vector<long double> got,
                              (in_place ? send : recv).Read());
          for (size_t i = 0; i < count; ++i) {
            FS_RETURN_IF_ERROR(CheckReduced(
                dtype, op, n, i, got[i],
                absl::StrCat(Case("all_reduce", dtype, op, count, n), " index ", i,
                             in_place ? " in place" : "")));
          }
        }
        // reduce_scatter: block r of the reduction (in place: recv is block r of send).
        for (bool in_place : {false, true}) {
          DeviceArray send(r, n * count, dtype), recv(r, count, dtype);
          FS_RETURN_IF_ERROR(send.Fill([&](size_t i) { return ReductionInput(dtype, op, r, i); }));
          Buffer out = in_place ? send.slice(r * count, count) : recv.buffer();
          FS_RETURN_IF_ERROR(comm.ReduceScatter(send.buffer(), out, op).Wait(absl::Seconds(60)));
          FS_ASSIGN_OR_RETURN(std::vector<long double> got, (in_place ? send : recv).Read());
          const size_t base = in_place ? r * count : 0;
          for (size_t i = 0; i < count; ++i) {
            FS_RETURN_IF_ERROR(CheckReduced(
                dtype, op, n, r * count + i, got[base + i],
                absl::StrCat(Case("reduce_scatter", dtype, op, count, n), " index ", i,
                             in_place ? " in place" : "")));
          }
        }
        // reduce to a rotating root (in place every other case); other ranks pass no recv.
        {
          const int root = case_index % n;
          const bool in_place = (case_index++ / n) % 2 == 1;
          DeviceArray send(r, count, dtype), recv(r, count, dtype);
          FS_RETURN_IF_ERROR(send.Fill([&](size_t i) { return ReductionInput(dtype, op, r, i); }));
          Buffer out = r != root ? Buffer{} : in_place ? send.buffer() : recv.buffer();
          FS_RETURN_IF_ERROR(comm.Reduce(send.buffer(), out, op, root).Wait(absl::Seconds(60)));
          if (r == root) {
            FS_ASSIGN_OR_RETURN(std::vector<long double> got, (in_place ? send : recv).Read());
            for (size_t i = 0; i < count; ++i) {
              FS_RETURN_IF_ERROR(CheckReduced(
                  dtype, op, n, i, got[i],
                  absl::StrCat(Case("reduce", dtype, op, count, n), " root ", root, " index ", i)));
            }
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status MovementAt(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  int salt = 0;
  for (DataType dtype : kDataTypes) {
    for (size_t count : kCounts) {
      ++salt;
      // all_gather: block j of recv is rank j's send (out of place and in place).
      for (bool in_place : {false, true}) {
        DeviceArray send(r, count, dtype), recv(r, n * count, dtype);
        Buffer in = in_place ? recv.slice(r * count, count) : send.buffer();
        if (in_place) {
          FS_RETURN_IF_ERROR(recv.Fill([&](size_t i) {
            return i / count == static_cast<size_t>(r)
                       ? MovementValue(dtype, MovementKey(r, i % count, salt))
                       : 0;
          }));
        } else {
          FS_RETURN_IF_ERROR(
              send.Fill([&](size_t i) { return MovementValue(dtype, MovementKey(r, i, salt)); }));
        }
        FS_RETURN_IF_ERROR(comm.AllGather(in, recv.buffer()).Wait(absl::Seconds(60)));
        FS_ASSIGN_OR_RETURN(std::vector<long double> got, recv.Read());
        for (size_t i = 0; i < n * count; ++i) {
          FS_RETURN_IF_ERROR(
              Check(got[i] == MovementValue(dtype, MovementKey(i / count, i % count, salt)),
                    absl::StrCat(Case("all_gather", dtype, ReduceOp::kSum, count, n), " index ", i,
                                 ": got ", static_cast<double>(got[i]))));
        }
      }
      // broadcast from a rotating root.
      {
        const int root = salt % n;
        DeviceArray buf(r, count, dtype);
        FS_RETURN_IF_ERROR(buf.Fill([&](size_t i) {
          return r == root ? MovementValue(dtype, MovementKey(root, i, salt)) : 0;
        }));
        FS_RETURN_IF_ERROR(comm.Broadcast(buf.buffer(), root).Wait(absl::Seconds(60)));
        FS_ASSIGN_OR_RETURN(std::vector<long double> got, buf.Read());
        for (size_t i = 0; i < count; ++i) {
          FS_RETURN_IF_ERROR(Check(
              got[i] == MovementValue(dtype, MovementKey(root, i, salt)),
              absl::StrCat(Case("broadcast", dtype, ReduceOp::kSum, count, n), " index ", i)));
        }
      }
      // all_to_all: block j of send goes to rank j.
      {
        DeviceArray send(r, n * count, dtype), recv(r, n * count, dtype);
        FS_RETURN_IF_ERROR(send.Fill([&](size_t i) {
          return MovementValue(dtype, MovementKey(r * 64 + i / count, i % count, salt));
        }));
        FS_RETURN_IF_ERROR(comm.AllToAll(send.buffer(), recv.buffer()).Wait(absl::Seconds(60)));
        FS_ASSIGN_OR_RETURN(std::vector<long double> got, recv.Read());
        for (size_t i = 0; i < n * count; ++i) {
          const size_t from = i / count;
          FS_RETURN_IF_ERROR(
              Check(got[i] == MovementValue(dtype, MovementKey(from * 64 + r, i % count, salt)),
                    absl::StrCat(Case("all_to_all", dtype, ReduceOp::kSum, count, n), " index ", i,
                                 ": got ", static_cast<double>(got[i]))));
        }
      }
      // send/recv: a ring as one BatchP2P, then rank 0 -> rank 1 as plain Send/Recv.
      if (n > 1) {
        DeviceArray send(r, count, dtype), recv(r, count, dtype);
        FS_RETURN_IF_ERROR(
            send.Fill([&](size_t i) { return MovementValue(dtype, MovementKey(r, i, salt)); }));
        const int next = (r + 1) % n, prev = (r + n - 1) % n;
        FS_RETURN_IF_ERROR(comm.BatchP2P({P2POp::Send(send.buffer(), next),
                                          P2POp::Recv(recv.buffer(), prev)})
                               .Wait(absl::Seconds(60)));
        FS_ASSIGN_OR_RETURN(std::vector<long double> got, recv.Read());
        for (size_t i = 0; i < count; ++i) {
          FS_RETURN_IF_ERROR(Check(
              got[i] == MovementValue(dtype, MovementKey(prev, i, salt)),
              absl::StrCat("batch_p2p ", DataTypeName(dtype), " count ", count, " index ", i)));
        }
        if (r == 0) {
          FS_RETURN_IF_ERROR(comm.Send(send.buffer(), 1).Wait(absl::Seconds(60)));
        } else if (r == 1) {
          FS_RETURN_IF_ERROR(comm.Recv(recv.buffer(), 0).Wait(absl::Seconds(60)));
          FS_ASSIGN_OR_RETURN(got, recv.Read());
          for (size_t i = 0; i < count; ++i) {
            FS_RETURN_IF_ERROR(
                Check(got[i] == MovementValue(dtype, MovementKey(0, i, salt)),
                      absl::StrCat("recv ", DataTypeName(dtype), " count ", count, " index ", i)));
          }
        }
      }
    }
  }
  return comm.Barrier().Wait(absl::Seconds(60));
}

TEST(NcclBackend, ReductionsEveryDtypeOpAndCount) {
  if (auto why = SkipReason(1)) GTEST_SKIP() << *why;
  for (int n : WorldSizes()) {
    std::vector<absl::Status> results = RunRanksHere(n, [](int rank) -> absl::Status {
      FS_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm, Create("reductions"));
      return ReductionsAt(*comm);
    });
    for (int r = 0; r < n; ++r) EXPECT_OK(results[r]) << "rank " << r << " of " << n;
  }
}

TEST(NcclBackend, DataMovementEveryDtypeAndCount) {
  if (auto why = SkipReason(1)) GTEST_SKIP() << *why;
  for (int n : WorldSizes()) {
    std::vector<absl::Status> results = RunRanksHere(n, [](int rank) -> absl::Status {
      FS_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm, Create("movement"));
      return MovementAt(*comm);
    });
    for (int r = 0; r < n; ++r) EXPECT_OK(results[r]) << "rank " << r << " of " << n;
  }
}

TEST(NcclBackend, SplitOrdersByKeyAndNoColorGetsNothing) {
  if (auto why = SkipReason(1)) GTEST_SKIP() << *why;
  for (int n : WorldSizes()) {
    std::vector<absl::Status> results = RunRanksHere(n, [n](int r) -> absl::Status {
      FS_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm, Create("split"));
      // Halves by parity, reverse rank order (key = -rank).
      FS_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> half, comm->Split(r % 2, -r));
      FS_RETURN_IF_ERROR(Check(half != nullptr, "split returned no child"));
      std::vector<int> members;
      for (int i = r % 2; i < n; i += 2) members.push_back(i);
      std::reverse(members.begin(), members.end());
      const int want_rank = std::find(members.begin(), members.end(), r) - members.begin();
      FS_RETURN_IF_ERROR(
          Check(half->size() == static_cast<int>(members.size()) && half->rank() == want_rank,
                absl::StrCat("child is rank ", half->rank(), "/", half->size())));
      DeviceArray x(r, 3, DataType::kI64);
      FS_RETURN_IF_ERROR(x.Fill([&](size_t i) { return r + i; }));
      FS_RETURN_IF_ERROR(
          half->AllReduce(x.buffer(), x.buffer(), ReduceOp::kSum).Wait(absl::Seconds(60)));
      FS_ASSIGN_OR_RETURN(std::vector<long double> got, x.Read());
      long double sum = 0;
      for (int m : members) sum += m;
      for (size_t i = 0; i < 3; ++i) {
        FS_RETURN_IF_ERROR(Check(got[i] == sum + members.size() * i, "split all_reduce"));
      }
      // Rank 0 opts out; the rest form one group.
      FS_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> rest,
                          comm->Split(r == 0 ? kNoColor : 0, r));
      FS_RETURN_IF_ERROR(Check((rest == nullptr) == (r == 0), "kNoColor split"));
      if (rest != nullptr) {
        FS_RETURN_IF_ERROR(Check(rest->size() == n - 1 && rest->rank() == r - 1, "rest ranks"));
        FS_RETURN_IF_ERROR(rest->Barrier().Wait(absl::Seconds(60)));
      }
      // The parent still works after its children.
      return comm->Barrier().Wait(absl::Seconds(60));
    });
    for (int r = 0; r < n; ++r) EXPECT_OK(results[r]) << "rank " << r << " of " << n;
  }
}

// An op reads its inputs after the caller's earlier work on the legacy default stream: a large
// cudaMemsetAsync there, then at once an all_reduce (whose NCCL stream is non-blocking), must
// see the memset complete. Without the backend's stream wait the reduction reads the buffer
// while the memset is still writing it.
TEST(NcclBackend, InputsOrderedAfterDefaultStreamWork) {
  if (auto why = SkipReason(1)) GTEST_SKIP() << *why;
  for (int n : WorldSizes()) {
    std::vector<absl::Status> results = RunRanksHere(n, [n](int r) -> absl::Status {
      FS_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm, Create("order"));
      constexpr size_t kBytes = size_t{256} << 20;
      DeviceArray send(r, kBytes, DataType::kU8), recv(r, kBytes, DataType::kU8);
      for (int round = 1; round <= 3; ++round) {
        const Buffer in = send.buffer();
        if (cudaMemsetAsync(in.data, round + r, kBytes, cudaStreamLegacy) != cudaSuccess) {
          return absl::InternalError("cudaMemsetAsync failed");
        }
        FS_RETURN_IF_ERROR(
            comm->AllReduce(in, recv.buffer(), ReduceOp::kSum).Wait(absl::Seconds(60)));
        std::vector<uint8_t> host(kBytes);
        if (cudaMemcpy(host.data(), recv.buffer().data, kBytes, cudaMemcpyDeviceToHost) !=
            cudaSuccess) {
          return absl::InternalError("cudaMemcpy to host failed");
        }
        const int want = n * round + n * (n - 1) / 2;
        for (size_t i = 0; i < kBytes; ++i) {
          if (host[i] != want) {
            return absl::InternalError(absl::StrCat("round ", round, " at ", n, " ranks: byte ",
                                                    i, " is ", host[i], ", want ", want));
          }
        }
      }
      return absl::OkStatus();
    });
    for (int r = 0; r < n; ++r) EXPECT_OK(results[r]) << "rank " << r << " of " << n;
  }
}

TEST(NcclBackend, AbortBreaksTheCommunicator) {
  if (auto why = SkipReason(1)) GTEST_SKIP() << *why;
  std::vector<absl::Status> results = RunThreads(1, [](int r) -> absl::Status {
    FS_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm, Create("abort1"));
    FS_RETURN_IF_ERROR(comm->Barrier().Wait(absl::Seconds(60)));
    comm->Abort(absl::Status());
    FS_RETURN_IF_ERROR(Check(absl::IsAborted(comm->status()), comm->status().ToString()));
    absl::Status s = comm->Barrier().Wait(absl::Seconds(30));
    return Check(absl::IsAborted(s) && absl::StrContains(s.message(), "barrier #2 rank 0/1"),
                 absl::StrCat("barrier after abort: ", s.ToString()));
  }, kRunTimeout);
  EXPECT_OK(results[0]);
}

// Rank 0 waits for a message rank 1 never sends: Abort (or the op's timeout) ends it.
void PendingRecvEndsWith(bool abort) {
  std::vector<absl::Status> results = RunRanksHere(2, [abort](int r) -> absl::Status {
    FS_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm,
                        Create(abort ? "abort2" : "timeout2"));
    std::shared_ptr<Store> store = testing::CurrentRank()->store;
    if (r == 1) {
      FS_RETURN_IF_ERROR(store->Get("rank0_done", absl::Seconds(120)).status());
      comm->Abort(absl::Status());
      return absl::OkStatus();
    }
    DeviceArray buf(r, 16, DataType::kF32);
    OpOptions opts;
    opts.timeout = absl::Seconds(abort ? 120 : 3);
    Work work = comm->Recv(buf.buffer(), 1, opts);
    if (abort) comm->Abort(absl::CancelledError("watchdog gave up"));
    absl::Status s = work.Wait(absl::Seconds(60));
    FS_RETURN_IF_ERROR(store->Set("rank0_done", "1"));
    if (abort) {
      return Check(absl::IsCancelled(s) && absl::StrContains(s.message(), "recv #1 rank 0/2") &&
                       absl::StrContains(s.message(), "watchdog gave up"),
                   absl::StrCat("aborted recv: ", s.ToString()));
    }
    FS_RETURN_IF_ERROR(Check(absl::IsDeadlineExceeded(s) &&
                                 absl::StrContains(s.message(), "recv #1 rank 0/2 [nccl]") &&
                                 absl::StrContains(s.message(), "timed out"),
                             absl::StrCat("timed-out recv: ", s.ToString())));
    return Check(absl::IsDeadlineExceeded(comm->status()), comm->status().ToString());
  });
  EXPECT_OK(results[0]);
  EXPECT_OK(results[1]);
}

TEST(NcclBackend, AbortFailsAPendingRecv) {
  if (auto why = SkipReason(2)) GTEST_SKIP() << *why;
  PendingRecvEndsWith(/*abort=*/true);
}

TEST(NcclBackend, TimeoutFailsAPendingRecvAndAborts) {
  if (auto why = SkipReason(2)) GTEST_SKIP() << *why;
  PendingRecvEndsWith(/*abort=*/false);
}

// A rank SIGKILLed after the first collective: the survivor's next all-reduce fails in time,
// naming itself; kUnavailable when NCCL notices the dead peer (ncclRemoteError/ncclSystemError),
// else kDeadlineExceeded at the op's timeout (peers on NVLink/P2P may never notice).
TEST(NcclBackend, KilledPeerFailsTheSurvivorInTime) {
  if (auto why = SkipReason(2)) GTEST_SKIP() << *why;
  std::vector<absl::Status> results = testing::RunProcesses(2, [](int r) -> absl::Status {
    std::string why;
    if (DeviceCount(&why) < 2) {  // sharing a device (SkipReason allowed it): see RunRanksHere
      PretendOwnHost(r);
    }
    FS_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm, Create("killed", absl::Seconds(20)));
    FS_RETURN_IF_ERROR(comm->Barrier().Wait(absl::Seconds(60)));
    if (r == 1) raise(SIGKILL);
    DeviceArray x(r, 1 << 20, DataType::kF32);
    FS_RETURN_IF_ERROR(x.Fill([](size_t i) { return 1; }));
    absl::Status s = comm->AllReduce(x.buffer(), x.buffer(), ReduceOp::kSum).Wait(absl::Seconds(90));
    return Check((absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s)) &&
                     absl::StrContains(s.message(), "all_reduce #2 rank 0/2 [nccl]") &&
                     !comm->status().ok(),
                 absl::StrCat("all_reduce with a dead peer: ", s.ToString()));
  }, kRunTimeout);
  EXPECT_OK(results[0]);
  EXPECT_THAT(results[1], StatusIs(absl::StatusCode::kInternal, HasSubstr("signal 9")));
}

}  // namespace
}  // namespace fairscale::comm
