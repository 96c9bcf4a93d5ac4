// Deterministic mode of //pipe (PipeOptions::deterministic) against an independent
// single-process reference: the whole model on one thread, one backward per micro-batch, the
// gradients summed over the canonical micro-batch tree by a recursive function written here
// (not deterministic/tree.cc), divided by M, Adam. Ten steps; every step's loss and every final
// parameter must be BITWISE equal (raw bytes) for every schedule at 1-4 stages, and for
// (replicas x stages) grids 1x1 ... 4x1. A negative control shows that the default mode differs
// between shapes, so the comparison can fail. Bad input: a batch that does not split into equal
// micro-batches, wrap_stage, ranks mixing modes, threads, a missing reduction.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "comm/communicator.h"
#include "pipe/grid.h"
#include "pipe/pipe.h"
#include "pipe/test_util.h"
#include "testing/bitwise.h"
#include "testing/c10_error.h"

namespace fairscale::pipe {
namespace {

using ::fairscale::testing::Bitwise;
using ::testing::HasSubstr;

constexpr int64_t kMicroBatches = 12;  // M: not a power of two, divisible by 1, 2, 3, 4, 6
constexpr int64_t kRows = 2;           // rows per micro-batch
constexpr int kSteps = 10;

// Linear(4, 8), 3 x (Tanh, Linear(8, 8)), Tanh, Linear(8, 3): 9 layers (4 x 2 virtual stages
// fit). Weights set explicitly: inproc ranks are threads sharing torch's global RNG.
torch::nn::Sequential MakeModel() {
  torch::nn::Sequential m(torch::nn::Linear(4, 8));
  for (int k = 0; k < 3; ++k) {
    m->push_back(torch::nn::Tanh());
    m->push_back(torch::nn::Linear(8, 8));
  }
  m->push_back(torch::nn::Tanh());
  m->push_back(torch::nn::Linear(8, 3));
  c10::NoGradGuard no_grad;
  int k = 0;
  for (at::Tensor& p : m->parameters()) {
    const int64_t n = p.numel();
    p.copy_((at::sin(at::arange(n, at::kDouble) * 0.731 + 1.3 * ++k) * 0.6).view(p.sizes()));
  }
  return m;
}

// Values over several magnitudes, so that another summation order changes the last bits.
at::Tensor Data(int64_t rows, int64_t cols, uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  return at::randn({rows, cols}, gen, at::kFloat) *
         at::pow(3.0, at::randint(-2, 3, {rows, cols}, gen, at::kFloat));
}

struct Batches {
  std::vector<at::Tensor> x, y;
};
Batches MakeBatches() {
  Batches b;
  for (int s = 0; s < kSteps; ++s) {
    b.x.push_back(Data(kMicroBatches * kRows, 4, 100 + s));
    b.y.push_back(Data(kMicroBatches * kRows, 3, 200 + s));
  }
  return b;
}

// The canonical tree by its definition (deterministic/tree.h): node [b, b + 2^l) = left half +
// right half; the total folds M's binary digits, largest block first.
template <typename T, typename Add>
T RefNode(const std::vector<T>& leaves, int64_t begin, int64_t size, const Add& add) {
  if (size == 1) return leaves[begin];
  return add(RefNode(leaves, begin, size / 2, add), RefNode(leaves, begin + size / 2, size / 2, add));
}
template <typename T, typename Add>
T RefTotal(const std::vector<T>& leaves, const Add& add) {
  const int64_t n = static_cast<int64_t>(leaves.size());
  T total{};
  bool first = true;
  int64_t begin = 0;
  for (int bit = 62; bit >= 0; --bit) {
    const int64_t size = int64_t{1} << bit;
    if ((n & size) == 0) continue;
    T node = RefNode(leaves, begin, size, add);
    total = first ? node : add(total, node);
    first = false;
    begin += size;
  }
  return total;
}

struct Outcome {
  std::vector<at::Tensor> losses;               // per step, the loss's dtype
  std::map<std::string, at::Tensor> params;     // final
};

Outcome Reference(const Batches& b) {
  torch::nn::Sequential model = MakeModel();
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  Outcome run;
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    std::vector<double> losses;
    std::vector<std::vector<at::Tensor>> grads;  // [micro-batch][parameter]
    for (int64_t j = 0; j < kMicroBatches; ++j) {
      for (at::Tensor& p : model->parameters()) p.mutable_grad() = at::Tensor();
      at::Tensor loss = testing::Mse(model->forward(b.x[s].narrow(0, j * kRows, kRows)),
                                     b.y[s].narrow(0, j * kRows, kRows));
      losses.push_back(loss.item<double>());
      loss.backward();
      std::vector<at::Tensor> g;
      for (at::Tensor& p : model->parameters()) g.push_back(p.grad().clone());
      grads.push_back(g);
    }
    const std::vector<at::Tensor> params = model->parameters();
    for (size_t k = 0; k < params.size(); ++k) {
      std::vector<at::Tensor> leaves;
      for (const auto& g : grads) leaves.push_back(g[k]);
      at::Tensor total =
          RefTotal(leaves, [](const at::Tensor& l, const at::Tensor& r) { return l + r; });
      const_cast<at::Tensor&>(params[k]).mutable_grad() = total / static_cast<double>(kMicroBatches);
    }
    const double mean = RefTotal(losses, [](double l, double r) { return l + r; }) /
                        static_cast<double>(kMicroBatches);
    run.losses.push_back(at::scalar_tensor(mean, at::kFloat));
    opt.step();
  }
  for (const auto& item : model->named_parameters()) run.params[item.key()] = item.value().clone();
  return run;
}

struct Shape {
  int replicas = 1;
  int stages = 1;
  Schedule schedule = Schedule::k1F1B;
  int64_t virtual_stages = 1;
  std::string Name() const {
    return absl::StrCat(replicas, "x", stages, " ", ScheduleName(schedule),
                        virtual_stages > 1 ? absl::StrCat(" v=", virtual_stages) : "");
  }
};

// One run of `shape` on replicas * stages inproc ranks: every rank's losses (deterministic
// mode: train_step's, or all_reduce_gradients' global loss on a grid) and the parameters of
// replica 0 (and, in deterministic mode, a check that every replica holds the same bits).
absl::Status RunShape(const Shape& shape, bool det, const Batches& b, Outcome* out) {
  const int world = shape.replicas * shape.stages;
  const int64_t chunks = kMicroBatches / shape.replicas;
  const int64_t rows = chunks * kRows;  // per replica
  std::mutex mu;
  std::vector<std::vector<at::Tensor>> losses(world);
  std::vector<std::map<std::string, at::Tensor>> params(world);
  std::vector<absl::Status> statuses = testing::RunInproc(
      world, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        const PipeGrid grid = MakePipeGrid(comm, shape.stages);
        PipeOptions options = PipeOptions()
                                  .chunks(chunks)
                                  .schedule(shape.schedule)
                                  .virtual_stages(shape.virtual_stages)
                                  .deterministic(det)
                                  .replica(grid.replica)
                                  .replicas(grid.replicas);
        std::unique_ptr<Pipe> pipe = Pipe::Create(MakeModel(), grid.pipe, options);
        torch::optim::Adam opt(pipe->parameters(), torch::optim::AdamOptions(1e-2));
        std::vector<at::Tensor> mine;
        for (int s = 0; s < kSteps; ++s) {
          opt.zero_grad();
          const at::Tensor x =
              grid.stage == 0 ? b.x[s].narrow(0, grid.replica * rows, rows) : at::Tensor();
          const at::Tensor y = grid.stage + 1 == shape.stages
                                   ? b.y[s].narrow(0, grid.replica * rows, rows)
                                   : at::Tensor();
          at::Tensor loss = pipe->train_step(x, y, testing::Mse);
          if (det && shape.replicas > 1) {
            loss = all_reduce_gradients(*pipe, *grid.data);
          } else if (shape.replicas > 1) {
            all_reduce_gradients(pipe->parameters(), *grid.data);
          }
          mine.push_back(loss);
          opt.step();
        }
        std::lock_guard<std::mutex> lock(mu);
        losses[rank] = mine;
        for (const auto& item : pipe->stage_module()->named_parameters()) {
          params[rank][item.key()] = item.value().clone();
        }
        return absl::OkStatus();
      });
  for (int r = 0; r < world; ++r) {
    if (!statuses[r].ok()) {
      return absl::Status(statuses[r].code(),
                          absl::StrCat(shape.Name(), " rank ", r, ": ", statuses[r].message()));
    }
  }
  *out = Outcome();
  out->losses = losses[0];
  for (int r = 0; r < world; ++r) {
    for (auto& [name, p] : params[r]) {
      auto it = out->params.find(name);
      if (it == out->params.end()) {
        out->params[name] = p;
      } else if (det && !Bitwise(it->second, p)) {
        return absl::InternalError(
            absl::StrCat(shape.Name(), ": replicas differ in ", name, " (rank ", r, ")"));
      }
    }
    for (int s = 0; det && s < kSteps; ++s) {
      if (!Bitwise(losses[r][s], losses[0][s])) {
        return absl::InternalError(
            absl::StrCat(shape.Name(), ": rank ", r, " step ", s, " loss differs from rank 0's"));
      }
    }
  }
  return absl::OkStatus();
}

// "" if `run` equals `ref` bitwise, else the first difference.
std::string Difference(const Outcome& run, const Outcome& ref) {
  for (int s = 0; s < kSteps; ++s) {
    if (!Bitwise(run.losses.at(s), ref.losses.at(s))) {
      return absl::StrCat("step ", s, " loss ", run.losses[s].item<double>(), " vs ",
                          ref.losses[s].item<double>());
    }
  }
  if (run.params.size() != ref.params.size()) return "parameter count";
  for (const auto& [name, p] : ref.params) {
    auto it = run.params.find(name);
    if (it == run.params.end()) return absl::StrCat("no ", name);
    if (!Bitwise(it->second, p)) {
      return absl::StrCat(name, " max |diff| ", (it->second - p).abs().max().item<double>());
    }
  }
  return "";
}

class DeterministicPipeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    threads_ = at::get_num_threads();
    at::set_num_threads(1);
  }
  void TearDown() override { at::set_num_threads(threads_); }
  int threads_ = 1;
};

TEST_F(DeterministicPipeTest, EverySchedulePipelineIsBitwiseTheReference) {
  const Batches b = MakeBatches();
  const Outcome ref = Reference(b);
  for (int stages = 1; stages <= 4; ++stages) {
    for (Shape shape : {Shape{1, stages, Schedule::kGPipe}, Shape{1, stages, Schedule::k1F1B},
                        Shape{1, stages, Schedule::kInterleaved1F1B, 1},
                        Shape{1, stages, Schedule::kInterleaved1F1B, 2}}) {
      Outcome run;
      const absl::Status status = RunShape(shape, true, b, &run);
      ASSERT_TRUE(status.ok()) << status;
      EXPECT_EQ(Difference(run, ref), "") << shape.Name();
    }
  }
}

TEST_F(DeterministicPipeTest, GridsAreBitwiseTheReference) {
  const Batches b = MakeBatches();
  const Outcome ref = Reference(b);
  for (Shape shape : {Shape{1, 1}, Shape{1, 2}, Shape{2, 1}, Shape{2, 2}, Shape{3, 1},
                      Shape{1, 4}, Shape{4, 1}, Shape{2, 3}, Shape{2, 2, Schedule::kGPipe},
                      Shape{2, 2, Schedule::kInterleaved1F1B, 2}}) {
    Outcome run;
    const absl::Status status = RunShape(shape, true, b, &run);
    ASSERT_TRUE(status.ok()) << status;
    EXPECT_EQ(Difference(run, ref), "") << shape.Name();
  }
}

// Without deterministic mode the shapes disagree somewhere (the grid's all-reduce averages in
// another order than one rank's accumulation), so the bitwise comparisons above can fail.
TEST_F(DeterministicPipeTest, DefaultModeDiffersAcrossShapes) {
  const Batches b = MakeBatches();
  Outcome one;
  ASSERT_TRUE(RunShape(Shape{1, 1}, false, b, &one).ok());
  std::vector<std::string> differing;
  for (Shape shape : {Shape{1, 2}, Shape{1, 3}, Shape{2, 2}, Shape{3, 1}, Shape{4, 1}}) {
    Outcome run;
    const absl::Status status = RunShape(shape, false, b, &run);
    ASSERT_TRUE(status.ok()) << status;
    // Losses of a default-mode grid are each replica's own; compare the parameters only.
    run.losses = one.losses;
    const std::string diff = Difference(run, one);
    if (!diff.empty()) differing.push_back(absl::StrCat(shape.Name(), ": ", diff));
  }
  EXPECT_FALSE(differing.empty()) << "the default mode was bitwise equal at every shape";
  for (const std::string& d : differing) std::cout << "default mode vs 1x1: " << d << "\n";
}

TEST_F(DeterministicPipeTest, BatchMustSplitIntoEqualMicroBatches) {
  std::vector<absl::Status> statuses = testing::RunInproc(
      2, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        std::unique_ptr<Pipe> pipe =
            Pipe::Create(MakeModel(), comm, PipeOptions().chunks(4).deterministic(true));
        const at::Tensor x = rank == 0 ? Data(10, 4, 1) : at::Tensor();
        const at::Tensor y = rank == 1 ? Data(10, 3, 2) : at::Tensor();
        pipe->train_step(x, y, testing::Mse);
        return absl::OkStatus();
      });
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(std::string(statuses[r].message()),
                HasSubstr("deterministic mode needs equal micro-batches, but "))
        << "rank " << r;
  }
  EXPECT_THAT(std::string(statuses[0].message()),
              HasSubstr("the input has 10 rows, not a multiple of chunks = 4"));
}

TEST_F(DeterministicPipeTest, WrapStageIsNotSupported) {
  std::vector<absl::Status> statuses = testing::RunInproc(
      2, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        WrapStageFn wrap = [](Stage stage) {
          return WrappedStage{stage.ptr(), [stage](std::vector<at::Tensor> xs, bool list) mutable {
                                return stage->forward(std::move(xs), list);
                              }};
        };
        Pipe::Create(MakeModel(), comm, PipeOptions().deterministic(true).wrap_stage(wrap));
        return absl::OkStatus();
      });
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(std::string(statuses[r].message()),
                HasSubstr(absl::StrCat("pipe::Pipe::Create (rank ", r, "/2): INVALID_ARGUMENT: "
                                       "deterministic mode with wrap_stage (e.g. fsdp_stage, FSDP "
                                       "inside a stage) is not supported yet")));
  }
}

TEST_F(DeterministicPipeTest, RanksMixingModesFailAtConstruction) {
  std::vector<absl::Status> statuses = testing::RunInproc(
      3, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        Pipe::Create(MakeModel(), comm, PipeOptions().chunks(3).deterministic(rank != 1));
        return absl::OkStatus();
      });
  for (int r = 0; r < 3; ++r) {
    EXPECT_THAT(std::string(statuses[r].message()), HasSubstr("ranks disagree on deterministic mode"))
        << "rank " << r;
  }
  EXPECT_THAT(std::string(statuses[0].message()),
              HasSubstr("rank 1 runs the default (non-deterministic) mode"));
}

TEST_F(DeterministicPipeTest, NeedsOneThread) {
  at::set_num_threads(2);
  std::vector<absl::Status> statuses = testing::RunInproc(
      1, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        Pipe::Create(MakeModel(), comm, PipeOptions().deterministic(true));
        return absl::OkStatus();
      });
  at::set_num_threads(1);
  EXPECT_THAT(std::string(statuses[0].message()), HasSubstr("at::set_num_threads(1)"));
}

TEST_F(DeterministicPipeTest, GridNeedsTheReductionAfterEveryStep) {
  const Batches b = MakeBatches();
  std::vector<absl::Status> statuses = testing::RunInproc(
      2, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        const PipeGrid grid = MakePipeGrid(comm, 1);
        std::unique_ptr<Pipe> pipe = Pipe::Create(
            MakeModel(), grid.pipe,
            PipeOptions().chunks(6).deterministic(true).replica(grid.replica).replicas(2));
        const at::Tensor x = b.x[0].narrow(0, 12 * grid.replica, 12);
        const at::Tensor y = b.y[0].narrow(0, 12 * grid.replica, 12);
        pipe->train_step(x, y, testing::Mse);
        pipe->train_step(x, y, testing::Mse);  // no all_reduce_gradients in between
        return absl::OkStatus();
      });
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(std::string(statuses[r].message()),
                HasSubstr("deterministic mode with replicas = 2: the last step's gradients were "
                          "not reduced"))
        << "rank " << r;
    EXPECT_THAT(std::string(statuses[r].message()), HasSubstr("FAILED_PRECONDITION"));
  }
}

TEST_F(DeterministicPipeTest, DeterministicReductionNeedsADeterministicPipe) {
  std::vector<absl::Status> statuses = testing::RunInproc(
      2, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        const PipeGrid grid = MakePipeGrid(comm, 1);
        std::unique_ptr<Pipe> pipe = Pipe::Create(MakeModel(), grid.pipe, PipeOptions());
        all_reduce_gradients(*pipe, *grid.data);
        return absl::OkStatus();
      });
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(std::string(statuses[r].message()), HasSubstr("the pipe runs the default mode"));
  }
}

}  // namespace
}  // namespace fairscale::pipe
