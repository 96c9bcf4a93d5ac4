// Reduction kernel throughput (//comm/bench:reduce_bench): ReduceInto(sum) per dtype at 1 MiB
// and 16 MiB of output, against memcpy of the same bytes in the same run (the ceiling: a reduce
// reads two buffers and writes one).
//
//   OMP_NUM_THREADS=1 ./bazelw run -c opt //comm/bench:reduce_bench
#include <cstring>
#include <vector>

#include "benchmark/benchmark.h"
#include "comm/algorithms/reduce.h"
#include "comm/types.h"

namespace fairscale::comm {
namespace {

void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = state.range(0);
  std::vector<char> a(bytes, 1), b(bytes, 2);
  for (auto _ : state) {
    std::memcpy(a.data(), b.data(), bytes);
    benchmark::DoNotOptimize(a.data());
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}

void BM_ReduceSum(benchmark::State& state) {
  const auto dtype = static_cast<DataType>(state.range(1));
  const size_t bytes = state.range(0);
  const size_t count = bytes / SizeOf(dtype);
  // Small values (0x3c00 is 1.0 in f16; 0x3f80 is 1.0 in bf16's top half) keep floats finite.
  std::vector<uint16_t> a(bytes / 2, dtype == DataType::kF16 ? 0x3c00 : 0x3f80);
  std::vector<uint16_t> b(a);
  if (!IsFloatingPoint(dtype) || dtype == DataType::kF32 || dtype == DataType::kF64) {
    std::memset(a.data(), 0, bytes);
    std::memset(b.data(), 0, bytes);
  }
  for (auto _ : state) {
    ReduceInto(ReduceOp::kSum, dtype, a.data(), b.data(), count);
    benchmark::DoNotOptimize(a.data());
  }
  state.SetBytesProcessed(state.iterations() * bytes);
  state.SetLabel(std::string(DataTypeName(dtype)));
}

BENCHMARK(BM_Memcpy)->Arg(1 << 20)->Arg(16 << 20);
BENCHMARK(BM_ReduceSum)
    ->ArgsProduct({{1 << 20, 16 << 20},
                   {static_cast<int>(DataType::kF32), static_cast<int>(DataType::kF16),
                    static_cast<int>(DataType::kBF16), static_cast<int>(DataType::kI32),
                    static_cast<int>(DataType::kF64)}});

}  // namespace
}  // namespace fairscale::comm

BENCHMARK_MAIN();
