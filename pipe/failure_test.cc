// Failures: a stage that throws (in forward, in backward, in the loss) or gets a bad batch makes
// every rank's train_step raise a c10::Error naming that stage, never a hang; the pipe stays
// failed afterwards (also with interleaved 1F1B, naming the virtual stage); bad configurations
// raise INVALID_ARGUMENT from Create.
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipe/pipe.h"
#include "pipe/test_util.h"
#include "testing/c10_error.h"

namespace fairscale::pipe {
namespace {

using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::Not;

enum class Boom { kNone, kForward, kBackward };

// Identity that throws in forward, or registers a hook that throws in backward.
class BoomLayerImpl : public torch::nn::Module {
 public:
  explicit BoomLayerImpl(Boom boom) : boom_(boom) {}
  at::Tensor forward(const at::Tensor& x) {
    TORCH_CHECK(boom_ != Boom::kForward, "boom in forward");
    at::Tensor y = x * 1.0;
    if (boom_ == Boom::kBackward && y.requires_grad()) {
      y.register_hook([](const at::Tensor& g) -> at::Tensor {
        TORCH_CHECK(false, "boom in backward");
        return g;
      });
    }
    return y;
  }

 private:
  Boom boom_;
};
TORCH_MODULE(BoomLayer);

// Linear, Tanh | Boom, Linear | Linear with balance {2, 2, 1}: the Boom layer is on stage 1.
torch::nn::Sequential MakeModel(Boom boom) {
  torch::nn::Sequential m(torch::nn::Linear(4, 6), torch::nn::Tanh(), BoomLayer(boom),
                          torch::nn::Linear(6, 6), torch::nn::Linear(6, 3));
  testing::InitDeterministic(*m);
  return m;
}

struct Case {
  std::string name;
  Boom boom = Boom::kNone;
  bool loss_throws = false;
  int64_t input_rows = 12;
  int failing_stage = 1;
  std::string what;  // in the failing stage's message
};

// Runs case `c` on `world` ranks with `options` (timeout 20 s): every rank's train_step must
// raise "pipe::Pipe::train_step: ..." (or, on a rank still in Create's closing barrier when the
// failing stage aborts, Create must) naming "pipe stage <failing_stage>/<world>" and c.what
// (what error() then returns), and a second train_step must then say the pipe failed earlier
// (FAILED_PRECONDITION).
void ExpectEveryRankNamesTheFailure(const Case& c, int world, const PipeOptions& options,
                                    const std::string& at) {
  const std::string stage_name = absl::StrCat("pipe stage ", c.failing_stage, "/", world);
  std::vector<absl::Status> statuses = testing::RunInproc(
      world,
      [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        // A stage that fails before it communicates (the short batch) aborts the communicator
        // while other ranks may still be finishing Create's closing barrier: they report the
        // same failure from Create (a peer's abort breaks every pending operation at once).
        std::unique_ptr<Pipe> pipe;
        const absl::Status created = fairscale::testing::CatchErrors([&] {
          pipe = Pipe::Create(MakeModel(c.boom), comm,
                              PipeOptions(options).timeout(absl::Seconds(20)));
          return absl::OkStatus();
        });
        if (!created.ok()) return created;
        LossFn loss = [&](const at::Tensor& out, const at::Tensor& y) {
          TORCH_CHECK(!c.loss_throws, "bad loss");
          return testing::Mse(out, y);
        };
        // The c10::Errors train_step raises, as Statuses carrying their messages.
        const absl::Status first = fairscale::testing::CatchErrors([&] {
          pipe->train_step(testing::Inputs(c.input_rows, 1), testing::Targets(12, 2), loss);
          return absl::InternalError("train_step succeeded");
        });
        if (!pipe->failed() ||
            first.message() != absl::StrCat("pipe::Pipe::train_step: ", pipe->error())) {
          return absl::InternalError(absl::StrCat("first train_step raised '", first.message(),
                                                  "', error() is '", pipe->error(), "'"));
        }
        // A failed pipe stays failed.
        const absl::Status again = fairscale::testing::CatchErrors([&] {
          pipe->train_step(testing::Inputs(12, 1), testing::Targets(12, 2), testing::Mse);
          return absl::OkStatus();
        });
        if (!absl::StrContains(again.message(), "pipe::Pipe::train_step: FAILED_PRECONDITION: ") ||
            !absl::StrContains(again.message(), "the pipe failed earlier")) {
          return absl::InternalError(absl::StrCat("second train_step: ", again.ToString()));
        }
        return first;
      },
      absl::Seconds(20));
  for (int r = 0; r < world; ++r) {
    EXPECT_FALSE(statuses[r].ok()) << at << " rank " << r;
    EXPECT_THAT(std::string(statuses[r].message()),
                AnyOf(HasSubstr("pipe::Pipe::train_step: "),
                      HasSubstr(absl::StrCat("pipe::Pipe::Create (rank ", r, "/", world,
                                             "): UNAVAILABLE: waiting for the other stages: "))))
        << at << " rank " << r;
    EXPECT_THAT(std::string(statuses[r].message()), HasSubstr(stage_name)) << at << " rank " << r;
    EXPECT_THAT(std::string(statuses[r].message()), HasSubstr(c.what)) << at << " rank " << r;
    EXPECT_THAT(statuses[r].message(), Not(HasSubstr("train_step succeeded"))) << at;
  }
}

TEST(FailureTest, EveryRankNamesTheFailingStage) {
  const std::vector<Case> cases = {
      {"forward", Boom::kForward, false, 12, 1, "boom in forward"},
      {"backward", Boom::kBackward, false, 12, 1, "boom in backward"},
      {"loss", Boom::kNone, true, 12, 2, "bad loss"},
      {"batch", Boom::kNone, false, 2, 0, "fewer than chunks = 3"},
  };
  for (const Case& c : cases) {
    for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B}) {
      ExpectEveryRankNamesTheFailure(
          c, 3, PipeOptions().balance({2, 2, 1}).chunks(3).schedule(schedule),
          absl::StrCat(c.name, " ", ScheduleName(schedule)));
    }
  }
}

// Interleaved 1F1B at 2 ranks x 2 virtual stages, balance {1, 1, 2, 1}: the Boom layer is in
// virtual stage 2 (rank 0's chunk 1, fed by the wrap-around link from rank 1); the loss runs in
// virtual stage 3 on rank 1. Every rank names the failing rank and virtual stage.
TEST(FailureTest, InterleavedEveryRankNamesTheFailingStage) {
  const std::vector<Case> cases = {
      {"forward", Boom::kForward, false, 12, 0, "forward of micro-batch 0 on virtual stage 2"},
      {"backward", Boom::kBackward, false, 12, 0, "boom in backward"},
      {"loss", Boom::kNone, true, 12, 1, "bad loss"},
      {"batch", Boom::kNone, false, 2, 0, "fewer than chunks = 4"},
  };
  for (const Case& c : cases) {
    for (int64_t chunks : {2, 4}) {
      if (c.name == "batch" && chunks == 2) continue;
      ExpectEveryRankNamesTheFailure(c, 2,
                                     PipeOptions()
                                         .balance({1, 1, 2, 1})
                                         .chunks(chunks)
                                         .schedule(Schedule::kInterleaved1F1B)
                                         .virtual_stages(2),
                                     absl::StrCat(c.name, " interleaved, chunks ", chunks));
    }
  }
}

// Create raises INVALID_ARGUMENT naming the function and the rank, on every rank.
TEST(FailureTest, BadConfigurationIsInvalidArgument) {
  struct Config {
    int world;
    std::vector<int64_t> balance;
    int64_t chunks;
    std::string message;
  };
  const std::vector<Config> configs = {
      {2, {2, 2}, 1, "sums to 4 but the model has 5 layers"},
      {2, {5, 0}, 1, "balance[1] = 0"},
      {2, {2, 2, 1}, 1, "has 3 entries but the communicator has 2 ranks"},
      {6, {}, 1, "6 stages (one per rank) but the model has only 5 layers"},
      {2, {3, 2}, 0, "chunks must be >= 1"},
  };
  for (const Config& config : configs) {
    std::vector<absl::Status> statuses = testing::RunInproc(
        config.world, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
          Pipe::Create(MakeModel(Boom::kNone), comm,
                       PipeOptions().balance(config.balance).chunks(config.chunks));
          return absl::OkStatus();
        });
    for (int r = 0; r < config.world; ++r) {
      EXPECT_FALSE(statuses[r].ok()) << config.message << " rank " << r;
      EXPECT_THAT(std::string(statuses[r].message()),
                  AllOf(HasSubstr(absl::StrCat("pipe::Pipe::Create (rank ", r, "/", config.world,
                                               "): INVALID_ARGUMENT: ")),
                        HasSubstr(config.message)))
          << config.message << " rank " << r;
    }
  }
}

}  // namespace
}  // namespace fairscale::pipe
