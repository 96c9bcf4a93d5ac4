// Test helpers for //comm/algorithms: a group of inproc communicators whose ranks are threads
// sharing one HashStore, and typed access to raw buffers of any dtype.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "comm/algorithms/half.h"
#include "comm/communicator.h"
#include "comm/config.h"
#include "comm/registry.h"
#include "comm/store/hash_store.h"
#include "gtest/gtest.h"

namespace fairscale::comm::testing {

using Options = absl::flat_hash_map<std::string, std::string>;
using Comms = std::vector<std::shared_ptr<Communicator>>;

// Runs body(rank) on n threads and joins them.
inline void OnRanks(int n, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(body, r);
  for (auto& t : threads) t.join();
}

// n inproc communicators created concurrently (as real ranks would), on `store` (a fresh
// HashStore when null).
inline Comms MakeGroup(int n, const Options& options = {},
                       absl::Duration timeout = absl::Seconds(20),
                       std::shared_ptr<Store> store = nullptr, const std::string& name = "") {
  if (store == nullptr) store = std::make_shared<HashStore>();
  Comms comms(n);
  std::vector<absl::Status> errors(n);
  OnRanks(n, [&](int r) {
    CommConfig config;
    config.rank = r;
    config.size = n;
    config.store = store;
    config.timeout = timeout;
    config.options = options;
    config.name = name;
    auto comm = CreateCommunicator("inproc", config);
    if (comm.ok()) {
      comms[r] = *comm;
    } else {
      errors[r] = comm.status();
    }
  });
  for (const absl::Status& s : errors) EXPECT_TRUE(s.ok()) << s;
  return comms;
}

// Values are exchanged as doubles: every test value is a small integer or a float that the
// dtype holds exactly.
inline void StoreValue(DataType dtype, void* base, size_t i, double v) {
  switch (dtype) {
    case DataType::kF32: static_cast<float*>(base)[i] = static_cast<float>(v); return;
    case DataType::kF64: static_cast<double*>(base)[i] = v; return;
    case DataType::kF16: static_cast<uint16_t*>(base)[i] = F32ToF16(static_cast<float>(v)); return;
    case DataType::kBF16:
      static_cast<uint16_t*>(base)[i] = F32ToBF16(static_cast<float>(v));
      return;
    case DataType::kI8: static_cast<int8_t*>(base)[i] = static_cast<int8_t>(v); return;
    case DataType::kU8: static_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(v); return;
    case DataType::kI32: static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v); return;
    case DataType::kI64: static_cast<int64_t*>(base)[i] = static_cast<int64_t>(v); return;
  }
}

inline double LoadValue(DataType dtype, const void* base, size_t i) {
  switch (dtype) {
    case DataType::kF32: return static_cast<const float*>(base)[i];
    case DataType::kF64: return static_cast<const double*>(base)[i];
    case DataType::kF16: return F16ToF32(static_cast<const uint16_t*>(base)[i]);
    case DataType::kBF16: return BF16ToF32(static_cast<const uint16_t*>(base)[i]);
    case DataType::kI8: return static_cast<const int8_t*>(base)[i];
    case DataType::kU8: return static_cast<const uint8_t*>(base)[i];
    case DataType::kI32: return static_cast<const int32_t*>(base)[i];
    case DataType::kI64: return static_cast<double>(static_cast<const int64_t*>(base)[i]);
  }
  return 0;
}

// A host buffer of `count` elements of `dtype`.
struct Data {
  Data(DataType t, size_t n) : dtype(t), count(n), bytes(n * SizeOf(t) + 1) {}
  Buffer buffer() { return {bytes.data(), count, dtype, Device::Cpu()}; }
  Buffer slice(size_t offset, size_t n) { return buffer().Slice(offset, n); }
  double at(size_t i) const { return LoadValue(dtype, bytes.data(), i); }
  void set(size_t i, double v) { StoreValue(dtype, bytes.data(), i, v); }

  DataType dtype;
  size_t count;
  std::vector<char> bytes;  // one spare byte so that count 0 still has a valid pointer
};

}  // namespace fairscale::comm::testing
