// What crosses a stage boundary: tensor lists (std::vector<at::Tensor>) of several dtypes (f64,
// bool, bf16, i64) and non-f32 activations, a list input on stage 0, and the layout encoding.
// Parity against the same model in one process.
#include <ATen/ops/cat.h>
#include <ATen/ops/tanh.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_matchers.h"
#include "gtest/gtest.h"
#include "pipe/internal/wire.h"
#include "pipe/pipe.h"
#include "pipe/test_util.h"

namespace fairscale::pipe {
namespace {

using base::testing::IsOk;
using base::testing::IsOkAndHolds;
using base::testing::StatusIs;

// One tensor in, a list of four dtypes out.
class FanOutImpl : public torch::nn::Module {
 public:
  std::vector<at::Tensor> forward(const at::Tensor& x) {
    return {x.to(at::kDouble) * 1.5, x > 0, x.to(at::kBFloat16), x.argmax(1)};
  }
};
TORCH_MODULE(FanOut);

// The list back to one f32 tensor.
class FanInImpl : public torch::nn::Module {
 public:
  at::Tensor forward(const std::vector<at::Tensor>& v) {
    return at::tanh(v.at(0).to(at::kFloat)) * v.at(1).to(at::kFloat) + v.at(2).to(at::kFloat) +
           v.at(3).to(at::kFloat).unsqueeze(1) * 0.1;
  }
};
TORCH_MODULE(FanIn);

// A list input: concatenates its tensors along the features.
class ConcatImpl : public torch::nn::Module {
 public:
  at::Tensor forward(const std::vector<at::Tensor>& v) { return at::cat(v, 1); }
};
TORCH_MODULE(Concat);

// Casts to f64 (an f64 boundary after it).
class ToDoubleImpl : public torch::nn::Module {
 public:
  at::Tensor forward(const at::Tensor& x) { return x.to(at::kDouble); }
};
TORCH_MODULE(ToDouble);

torch::nn::Sequential MakeMixed() {
  torch::nn::Sequential m(torch::nn::Linear(4, 6), FanOut(), FanIn(), ToDouble(),
                          torch::nn::Linear(torch::nn::LinearOptions(6, 3)));
  // The last Linear runs in f64.
  m[4]->to(at::kDouble);
  testing::InitDeterministic(*m);
  return m;
}

at::Tensor MseF32(const at::Tensor& out, const at::Tensor& target) {
  return testing::Mse(out.to(at::kFloat), target);
}

TEST(BoundaryTest, ListsAndDtypesBetweenStages) {
  const std::vector<at::Tensor> inputs = {testing::Inputs(12, 1)};
  const std::vector<at::Tensor> targets = {testing::Targets(12, 2)};
  // Boundaries: 2 stages {2, 3}: the list; 3 stages {1, 2, 2}: f32 then f64...; 4 stages
  // {1, 1, 2, 1}: f32, the list, f64.
  const std::vector<std::vector<int64_t>> balances = {{2, 3}, {1, 2, 2}, {1, 1, 2, 1}};
  for (const std::vector<int64_t>& balance : balances) {
    for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B}) {
      const testing::Reference ref = testing::RunReference(MakeMixed, inputs, targets, 3, MseF32);
      const int stages = static_cast<int>(balance.size());
      const std::string what = absl::StrCat(stages, " stages ", ScheduleName(schedule));
      std::vector<absl::Status> statuses = testing::RunInproc(
          stages, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
            std::unique_ptr<Pipe> pipe = Pipe::Create(
                MakeMixed(), comm, PipeOptions().balance(balance).chunks(3).schedule(schedule));
            at::Tensor loss = pipe->train_step(inputs[0], targets[0], MseF32);
            absl::Status s = testing::ExpectClose(
                what + " loss", loss, at::scalar_tensor(ref.losses[0], at::kDouble), 1e-5);
            if (!s.ok()) return s;
            return testing::CheckStageGrads(*pipe, ref.grads, 1e-5,
                                            absl::StrCat(what, " rank ", rank));
          });
      for (int r = 0; r < stages; ++r) EXPECT_THAT(statuses[r], IsOk()) << what << " rank " << r;
    }
  }
}

TEST(BoundaryTest, ListInputOnStageZero) {
  auto make = [] {
    torch::nn::Sequential m(Concat(), torch::nn::Linear(5, 6), torch::nn::Linear(6, 3));
    testing::InitDeterministic(*m);
    return m;
  };
  const at::Tensor a = testing::Inputs(6, 3);
  const at::Tensor b = testing::Inputs(6, 4).narrow(1, 0, 1).contiguous();
  const at::Tensor y = testing::Targets(6, 5);
  // The reference: the same model on the concatenated input (Concat has no parameters).
  torch::nn::Sequential ref_model = make();
  std::vector<at::Tensor> pieces = {a, b};
  double ref_loss = 0;
  for (int64_t i = 0; i < 2; ++i) {
    std::vector<at::Tensor> rows = {a.narrow(0, 3 * i, 3), b.narrow(0, 3 * i, 3)};
    at::Tensor loss = testing::Mse(ref_model->forward(rows), y.narrow(0, 3 * i, 3));
    ref_loss += loss.item<double>() / 2;
    (loss / 2.0).backward();
  }
  std::map<std::string, at::Tensor> grads;
  for (const auto& item : ref_model->named_parameters()) grads[item.key()] = item.value().grad();
  std::vector<absl::Status> statuses = testing::RunInproc(
      2, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        std::unique_ptr<Pipe> pipe =
            Pipe::Create(make(), comm, PipeOptions().balance({2, 1}).chunks(2));
        at::Tensor loss = pipe->train_step(pieces, y, testing::Mse);
        absl::Status s = testing::ExpectClose("loss", loss, at::scalar_tensor(ref_loss), 1e-5);
        if (!s.ok()) return s;
        return testing::CheckStageGrads(*pipe, grads, 1e-5, absl::StrCat("rank ", rank));
      });
  for (int r = 0; r < 2; ++r) EXPECT_THAT(statuses[r], IsOk()) << "rank " << r;
}

TEST(BoundaryTest, LayoutEncodingRoundTripsAndRejectsGarbage) {
  internal::BoundaryLayout layout;
  layout.is_list = true;
  layout.tensors = {{at::kFloat, true, {3, 4}}, {at::kBool, false, {3}}, {at::kLong, false, {}}};
  absl::StatusOr<internal::BoundaryLayout> back =
      internal::DecodeLayout(internal::EncodeLayout(layout));
  ASSERT_THAT(back.status(), IsOk());
  EXPECT_TRUE(*back == layout);
  EXPECT_EQ(internal::DescribeLayout(layout),
            "list(Float[3, 4] requires_grad, Bool[3], Long[])");
  std::vector<int64_t> encoded = internal::EncodeLayout(layout);
  encoded.pop_back();
  encoded.pop_back();
  EXPECT_THAT(internal::DecodeLayout(encoded).status(), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(internal::DecodeLayout({7, 0, 1}).status(), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(internal::DecodeLayout({1, 0, 2}).status(), StatusIs(absl::StatusCode::kDataLoss));
  // Skip tensors (skip.h) after a single tensor: the count travels in the layout.
  internal::BoundaryLayout with_skips;
  with_skips.skips = 2;
  with_skips.tensors = {{at::kFloat, true, {3, 4}}, {at::kFloat, true, {3, 6}}, {at::kLong, false, {3}}};
  back = internal::DecodeLayout(internal::EncodeLayout(with_skips));
  ASSERT_THAT(back.status(), IsOk());
  EXPECT_TRUE(*back == with_skips);
  EXPECT_EQ(internal::DescribeLayout(with_skips),
            "Float[3, 4] requires_grad + 2 skips (Float[3, 6] requires_grad, Long[3])");
  // A single tensor needs 1 + skips tensors; skips must be >= 0.
  EXPECT_THAT(internal::DecodeLayout({2, 0, 2, 0, 6, 0, 0, 6, 0, 0}).status(),
              StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(internal::DecodeLayout({2, 1, 0, -1}).status(), StatusIs(absl::StatusCode::kDataLoss));
  // Found writing //pipe/fuzz: flags other than 0 and 1 (they re-encoded differently), dtypes that do
  // not cross a boundary (at::empty or the comm layer refused them only after allocating), more
  // than kMaxDims dimensions, sizes whose bytes overflow int64, counts beyond the words left.
  EXPECT_THAT(internal::DecodeLayout({2, 0, 1, 0, 6, 0, 1, 4}).status(), IsOk());
  for (const std::vector<int64_t>& bad : std::vector<std::vector<int64_t>>{
           {2, 2, 1, 0, 6, 0, 1, 4},
           {2, 0, 1, 0, 6, 5, 1, 4},
           {2, 0, 1, 0, static_cast<int64_t>(at::kQInt8), 0, 1, 4},
           {2, 0, 1, 0, static_cast<int64_t>(at::kComplexFloat), 0, 1, 4},
           {2, 0, 1, 0, 6, 0, int64_t{1} << 40, 4},
           {2, 0, 1, 0, 6, 0, 3, int64_t{1} << 32, int64_t{1} << 32, 4},
           {2, 1, int64_t{1} << 60, 0}}) {
    EXPECT_THAT(internal::DecodeLayout(bad).status(), StatusIs(absl::StatusCode::kDataLoss));
  }
  std::vector<int64_t> deep = {2, 0, 1, 0, 6, 0, internal::kMaxDims + 1};
  deep.resize(deep.size() + internal::kMaxDims + 1, 1);
  EXPECT_THAT(internal::DecodeLayout(deep).status(), StatusIs(absl::StatusCode::kDataLoss));
  // The sender refuses what the receiver would.
  internal::BoundaryLayout complex;
  complex.tensors = {{at::kComplexFloat, false, {2}}};
  EXPECT_THAT(internal::CheckLayout(complex), StatusIs(absl::StatusCode::kInvalidArgument));
}

// The 24-byte header: a bad magic or a layout length outside [0, kMaxLayoutWords] is corruption
// (kDataLoss, before anything is allocated for the layout); another message id is a schedule
// bug (kInternal).
TEST(BoundaryTest, HeaderIsCheckedBeforeTheLayoutIsAllocated) {
  EXPECT_THAT(internal::CheckHeader(internal::EncodeHeader(4, 12), 4), IsOkAndHolds(12));
  EXPECT_THAT(internal::CheckHeader(internal::EncodeHeader(4, 0), 4), IsOkAndHolds(0));
  EXPECT_THAT(internal::CheckHeader(internal::EncodeHeader(4, 12), 5).status(),
              StatusIs(absl::StatusCode::kInternal));
  EXPECT_THAT(internal::CheckHeader({0x50495046, 4, 12}, 4).status(),
              StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(internal::CheckHeader(internal::EncodeHeader(4, -1), 4).status(),
              StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(internal::CheckHeader(internal::EncodeHeader(4, int64_t{1} << 60), 4).status(),
              StatusIs(absl::StatusCode::kDataLoss));
}

}  // namespace
}  // namespace fairscale::pipe
