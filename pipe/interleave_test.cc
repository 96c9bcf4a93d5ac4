// Interleaved 1F1B (PipeOptions::virtual_stages > 1): parity with the same model run
// un-pipelined in one process (the loss of every step and the accumulated gradient of every
// parameter within 1e-5, f32) for 2, 3, 4 ranks x 2 virtual stages and 2 ranks x 3 (and one rank
// with 2 and 3 chunks, handed over without a communicator) x chunks m = p, 2p x the three
// checkpoint modes; explicit balances per virtual stage; CreateForStage; eval_step; bad
// configurations (also wrap_stage with virtual stages) rejected naming the values.
#include <ATen/ops/scalar_tensor.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipe/pipe.h"
#include "pipe/test_util.h"

namespace fairscale::pipe {
namespace {

using base::testing::IsOk;
using ::testing::AllOf;
using ::testing::HasSubstr;

// Balances over MakeDeepMlp's 13 layers, one entry per virtual stage ({} = the even split).
std::vector<int64_t> BalanceFor(int ranks, int64_t v) {
  if (ranks == 2 && v == 2) return {3, 4, 3, 3};
  if (ranks == 2 && v == 3) return {2, 2, 2, 3, 2, 2};
  if (ranks == 1 && v == 2) return {6, 7};
  return {};
}

class InterleaveParityTest
    : public ::testing::TestWithParam<std::tuple<std::pair<int, int64_t>, CheckpointMode>> {};

TEST_P(InterleaveParityTest, LossAndGradientsMatchOneProcess) {
  const auto [shape, mode] = GetParam();
  const auto [ranks, v] = shape;
  const std::vector<at::Tensor> inputs = {testing::Inputs(24, 1), testing::Inputs(48, 2)};
  const std::vector<at::Tensor> targets = {testing::Targets(24, 3), testing::Targets(48, 4)};
  for (int64_t chunks : {int64_t{ranks}, int64_t{2} * ranks}) {
    const testing::Reference ref =
        testing::RunReference(testing::MakeDeepMlp, inputs, targets, chunks, testing::Mse);
    const std::string what = absl::StrCat(ranks, " ranks x ", v, " virtual stages, ",
                                          CheckpointModeName(mode), ", chunks ", chunks);
    const PipeOptions options = PipeOptions()
                                    .balance(BalanceFor(ranks, v))
                                    .chunks(chunks)
                                    .schedule(Schedule::kInterleaved1F1B)
                                    .virtual_stages(v)
                                    .checkpoint(mode);
    std::vector<absl::Status> statuses = testing::RunParity(ranks, testing::MakeDeepMlp, options, inputs, targets, ref, what);
    for (int r = 0; r < ranks; ++r) EXPECT_THAT(statuses[r], IsOk()) << what << " rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, InterleaveParityTest,
    ::testing::Combine(::testing::Values(std::make_pair(2, int64_t{2}), std::make_pair(3, int64_t{2}),
                                         std::make_pair(4, int64_t{2}), std::make_pair(2, int64_t{3}),
                                         std::make_pair(1, int64_t{2}), std::make_pair(1, int64_t{3})),
                       ::testing::Values(CheckpointMode::kAlways, CheckpointMode::kExceptLast,
                                         CheckpointMode::kNever)),
    [](const ::testing::TestParamInfo<InterleaveParityTest::ParamType>& info) {
      return absl::StrCat(std::get<0>(info.param).first, "ranks_x", std::get<0>(info.param).second,
                          "_", CheckpointModeName(std::get<1>(info.param)));
    });

// kInterleaved1F1B with one virtual stage is 1F1B: same order, same results.
TEST(InterleaveTest, OneVirtualStageIsOneFOneB) {
  const std::vector<at::Tensor> inputs = {testing::Inputs(12, 5)};
  const std::vector<at::Tensor> targets = {testing::Targets(12, 6)};
  const testing::Reference ref =
      testing::RunReference(testing::MakeDeepMlp, inputs, targets, 3, testing::Mse);
  std::vector<absl::Status> statuses =
      testing::RunParity(3, testing::MakeDeepMlp,
                         PipeOptions().chunks(3).schedule(Schedule::kInterleaved1F1B), inputs,
                         targets, ref, "v = 1");
  for (int r = 0; r < 3; ++r) EXPECT_THAT(statuses[r], IsOk()) << "rank " << r;
}

// Each rank holds its chunks' layers under their global names; CreateForStage with the same
// balance gives the same pipe; eval_step returns the reference loss and runs forwards only.
TEST(InterleaveTest, CreateForStageAndEvalStep) {
  const std::vector<at::Tensor> inputs = {testing::Inputs(16, 7)};
  const std::vector<at::Tensor> targets = {testing::Targets(16, 8)};
  const testing::Reference ref =
      testing::RunReference(testing::MakeDeepMlp, inputs, targets, 4, testing::Mse);
  const std::vector<int64_t> balance = {3, 4, 3, 3};  // rank 0: layers 0-2, 7-9
  const PipeOptions options = PipeOptions()
                                  .balance(balance)
                                  .chunks(4)
                                  .schedule(Schedule::kInterleaved1F1B)
                                  .virtual_stages(2);
  std::vector<absl::Status> statuses = testing::RunInproc(
      2, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        torch::nn::Sequential full = testing::MakeDeepMlp();
        torch::nn::Sequential mine;
        const std::vector<std::pair<int64_t, int64_t>> ranges =
            rank == 0 ? std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {7, 10}}
                      : std::vector<std::pair<int64_t, int64_t>>{{3, 7}, {10, 13}};
        for (const auto& [begin, end] : ranges) {
          for (int64_t l = begin; l < end; ++l) mine->push_back(*(full->begin() + l));
        }
        std::unique_ptr<Pipe> pipe = Pipe::CreateForStage(mine, comm, options);
        for (int64_t j = 0; j < 2; ++j) {
          if (pipe->chunk_first_layer(j) != ranges[j].first ||
              static_cast<int64_t>(pipe->chunk_module(j)->size()) !=
                  ranges[j].second - ranges[j].first) {
            return absl::InternalError(absl::StrCat("chunk ", j, " layers"));
          }
        }
        if (pipe->first_layer() != ranges[0].first || pipe->num_layers() != 6 + rank) {
          return absl::InternalError("first_layer / num_layers");
        }
        at::Tensor eval = pipe->eval_step(inputs[0], targets[0], testing::Mse);
        absl::Status s = testing::ExpectClose("eval loss", eval,
                                              at::scalar_tensor(ref.losses[0], at::kDouble), 1e-5);
        if (!s.ok()) return s;
        if (pipe->trace().size() != 8) return absl::InternalError("eval trace size");
        for (const at::Tensor& p : pipe->parameters()) {
          if (p.grad().defined()) return absl::InternalError("eval_step left a gradient");
        }
        at::Tensor loss = pipe->train_step(inputs[0], targets[0], testing::Mse);
        s = testing::ExpectClose("loss", loss, at::scalar_tensor(ref.losses[0], at::kDouble), 1e-5);
        if (!s.ok()) return s;
        return testing::CheckStageGrads(*pipe, ref.grads, 1e-5, absl::StrCat("rank ", rank));
      });
  for (int r = 0; r < 2; ++r) EXPECT_THAT(statuses[r], IsOk()) << "rank " << r;
}

TEST(InterleaveTest, BadConfigurationIsInvalidArgument) {
  struct Config {
    int world;
    PipeOptions options;
    std::string message;
  };
  const PipeOptions interleaved =
      PipeOptions().schedule(Schedule::kInterleaved1F1B).virtual_stages(2);
  const std::vector<Config> configs = {
      {2, PipeOptions(interleaved).chunks(3),
       "multiple of the 2 pipeline stages, got chunks = 3"},
      {4, PipeOptions(interleaved).chunks(6), "multiple of the 4 pipeline stages, got chunks = 6"},
      {2, PipeOptions(interleaved).chunks(4).schedule(Schedule::k1F1B),
       "virtual stages = 2 needs the schedule \"interleaved\", not \"1f1b\""},
      {2, PipeOptions(interleaved).chunks(4).virtual_stages(0), "virtual stages must be >= 1"},
      {2, PipeOptions(interleaved).chunks(4).balance({6, 7}),
       "has 2 entries but the communicator has 2 ranks (2 virtual stages per rank)"},
      {4, PipeOptions(interleaved).chunks(4).virtual_stages(4),
       "16 virtual stages (4 ranks x 4) but the model has only 13 layers"},
      {2, PipeOptions(interleaved).chunks(4).wrap_stage([](Stage stage) {
         return WrappedStage{stage.ptr(), [stage](std::vector<at::Tensor> xs, bool list) mutable {
                               return stage->forward(std::move(xs), list);
                             }};
       }),
       "wrap_stage wraps one stage per rank; with virtual_stages = 2"},
  };
  for (const Config& config : configs) {
    std::vector<absl::Status> statuses = testing::RunInproc(
        config.world, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
          Pipe::Create(testing::MakeDeepMlp(), comm, config.options);
          return absl::OkStatus();
        });
    for (int r = 0; r < config.world; ++r) {
      // The c10::Error's message (RunInproc returns it as a Status).
      EXPECT_FALSE(statuses[r].ok()) << config.message << " rank " << r;
      EXPECT_THAT(std::string(statuses[r].message()),
                  AllOf(HasSubstr("pipe::Pipe::Create (rank "), HasSubstr("INVALID_ARGUMENT: "),
                        HasSubstr(config.message)))
          << config.message << " rank " << r;
    }
  }
  // CreateForStage needs a balance to cut its layers into chunks.
  std::vector<absl::Status> statuses = testing::RunInproc(
      2, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        Pipe::CreateForStage(testing::MakeDeepMlp(), comm, PipeOptions(interleaved).chunks(2));
        return absl::OkStatus();
      });
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(statuses[r].ok()) << "rank " << r;
    EXPECT_THAT(
        std::string(statuses[r].message()),
        HasSubstr(absl::StrCat("pipe::Pipe::CreateForStage (rank ", r,
                               "/2): INVALID_ARGUMENT: virtual stages = 2 needs a balance")));
  }
}

}  // namespace
}  // namespace fairscale::pipe
