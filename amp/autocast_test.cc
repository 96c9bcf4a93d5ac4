// Autocast guard: a Linear runs in bf16 under a CPU guard (and its weight gradient stays f32),
// the previous autocast state comes back after the scope, nested guards restore correctly, the
// CUDA guard sets the CUDA state (checked without a GPU: the state is thread-local flags), and
// unsupported device/dtype pairs are refused.
#include "amp/autocast.h"

#include <ATen/autocast_mode.h>
#include <ATen/ops/ones.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <functional>
#include <string>

#include "testing/c10_error.h"

namespace fairscale::amp {
namespace {

using ::fairscale::testing::ErrorOf;
using ::testing::HasSubstr;

TEST(AutocastTest, CpuLinearRunsInBFloat16AndStateIsRestored) {
  torch::nn::Linear linear(4, 3);
  const at::Tensor x = at::ones({2, 4});
  ASSERT_FALSE(at::autocast::is_cpu_enabled());
  {
    Autocast guard(at::kCPU, at::kBFloat16);
    EXPECT_TRUE(at::autocast::is_cpu_enabled());
    EXPECT_EQ(at::autocast::get_autocast_cpu_dtype(), at::kBFloat16);
    at::Tensor y = linear(x);
    EXPECT_EQ(y.scalar_type(), at::kBFloat16);
    y.to(at::kFloat).sum().backward();
  }
  EXPECT_EQ(linear->weight.grad().scalar_type(), at::kFloat);  // f32 master weights
  EXPECT_FALSE(at::autocast::is_cpu_enabled());
  EXPECT_EQ(linear(x).scalar_type(), at::kFloat);
}

TEST(AutocastTest, NestedGuardsRestoreTheOuterState) {
  torch::nn::Linear linear(4, 3);
  const at::Tensor x = at::ones({2, 4});
  {
    Autocast outer(at::kCPU, at::kBFloat16);
    {
      Autocast inner(at::kCPU, at::kBFloat16, /*enabled=*/false, /*cache_enabled=*/false);
      EXPECT_FALSE(at::autocast::is_cpu_enabled());
      EXPECT_FALSE(at::autocast::is_autocast_cache_enabled());
      EXPECT_EQ(linear(x).scalar_type(), at::kFloat);
      {
        Autocast innermost(at::kCPU, at::kBFloat16);
        EXPECT_EQ(linear(x).scalar_type(), at::kBFloat16);
      }
      EXPECT_FALSE(at::autocast::is_cpu_enabled());
    }
    EXPECT_TRUE(at::autocast::is_cpu_enabled());
    EXPECT_TRUE(at::autocast::is_autocast_cache_enabled());
    EXPECT_EQ(linear(x).scalar_type(), at::kBFloat16);
  }
  EXPECT_FALSE(at::autocast::is_cpu_enabled());
  EXPECT_TRUE(at::autocast::is_autocast_cache_enabled());
  EXPECT_EQ(linear(x).scalar_type(), at::kFloat);
}

TEST(AutocastTest, CudaGuardSetsAndRestoresTheCudaState) {
  const at::ScalarType before = at::autocast::get_autocast_gpu_dtype();
  ASSERT_FALSE(at::autocast::is_enabled());
  {
    Autocast guard(at::kCUDA, at::kBFloat16);
    EXPECT_TRUE(at::autocast::is_enabled());
    EXPECT_EQ(at::autocast::get_autocast_gpu_dtype(), at::kBFloat16);
    EXPECT_FALSE(at::autocast::is_cpu_enabled());  // CPU untouched
    {
      Autocast inner(at::kCUDA, at::kHalf);
      EXPECT_EQ(at::autocast::get_autocast_gpu_dtype(), at::kHalf);
    }
    EXPECT_EQ(at::autocast::get_autocast_gpu_dtype(), at::kBFloat16);
  }
  EXPECT_FALSE(at::autocast::is_enabled());
  EXPECT_EQ(at::autocast::get_autocast_gpu_dtype(), before);
}

TEST(AutocastTest, RejectsUnsupportedDeviceOrDtype) {
  EXPECT_THAT(ErrorOf([] { Autocast g(at::kCPU, at::kHalf); }), HasSubstr("BFloat16"));
  EXPECT_THAT(ErrorOf([] { Autocast g(at::kCUDA, at::kFloat); }), HasSubstr("Half and BFloat16"));
  EXPECT_THAT(ErrorOf([] { Autocast g(at::kMeta, at::kBFloat16); }), HasSubstr("CPU or CUDA"));
  // A refused guard changed nothing.
  EXPECT_FALSE(at::autocast::is_cpu_enabled());
  EXPECT_FALSE(at::autocast::is_enabled());
}

}  // namespace
}  // namespace fairscale::amp
