#include "comm/torch/tensor_buffer.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>

#include "base/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::comm {
namespace {

using ::fairscale::base::testing::StatusIs;
using ::testing::HasSubstr;

TEST(TensorBuffer, ViewsContiguousTensors) {
  at::Tensor t = at::arange(12, at::kFloat).reshape({3, 4});
  ASSERT_OK_AND_ASSIGN(Buffer b, ToBuffer(t));
  EXPECT_EQ(b.data, t.data_ptr());
  EXPECT_EQ(b.count, 12u);
  EXPECT_EQ(b.dtype, DataType::kF32);
  EXPECT_EQ(b.device, Device::Cpu());
  ASSERT_OK_AND_ASSIGN(ConstBuffer c, ToConstBuffer(at::ones({2}, at::kBFloat16)));
  EXPECT_EQ(c.dtype, DataType::kBF16);
  ASSERT_OK_AND_ASSIGN(Buffer empty, ToBuffer(at::zeros({0}, at::kLong)));
  EXPECT_EQ(empty.count, 0u);
  EXPECT_EQ(empty.data, nullptr);
}

TEST(TensorBuffer, RejectsWhatCannotBeSent) {
  at::Tensor t = at::arange(12, at::kFloat).reshape({3, 4});
  EXPECT_THAT(ToBuffer(t.t()), StatusIs(absl::StatusCode::kInvalidArgument,
                                        HasSubstr("not contiguous")));
  EXPECT_THAT(ToBuffer(at::ones({2}, at::kBool)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("Bool")));
  EXPECT_THAT(ToBuffer(at::Tensor()), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(TensorBuffer, DataTypesRoundTrip) {
  for (int i = 0; i < kNumDataTypes; ++i) {
    auto d = static_cast<DataType>(i);
    ASSERT_OK_AND_ASSIGN(DataType back, ToDataType(ToScalarType(d)));
    EXPECT_EQ(back, d);
  }
}

}  // namespace
}  // namespace fairscale::comm
