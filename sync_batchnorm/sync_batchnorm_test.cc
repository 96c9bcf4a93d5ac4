// SyncBatchNorm at world sizes 1-4 (ranks as threads over the inproc backend) against
// torch::nn::BatchNorm{1,2,3}d in one process on the concatenated batch: forward output and input
// gradient (this rank's rows), weight and bias gradients (summed over the ranks: the gradient of
// the full batch's loss sum(y * w)), running_mean / running_var / num_batches_tracked after 3
// training steps, and the eval output; f32 and f64, input dims 2-5, odd per-rank batch sizes and
// empty ranks, momentum nullopt, affine false, track_running_stats false, a Split
// sub-communicator (2 groups of 2). Exactly one all-reduce per forward and one per backward.
// convert_sync_batchnorm on a Sequential (nested) equals the original model in one process.
// Bad inputs raise clear errors. Inputs and weights are made in the main thread from private
// generators (the rank threads share torch's global RNG).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "comm/communicator.h"
#include "comm/testing/counting_communicator.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "sync_batchnorm/sync_batchnorm.h"
#include "testing/c10_error.h"
#include "testing/near.h"

namespace fairscale::sync_batchnorm {
namespace {

using comm::Communicator;
using comm::OpType;
using comm::testing::Check;
using comm::testing::CountingCommunicator;
using comm::testing::ExpectAllOk;
using comm::testing::RunInprocRanks;
using fairscale::testing::ExpectError;
using fairscale::testing::Shape;

constexpr int64_t kC = 3;

// The largest error seen per dtype (printed at the end of the run), relative to max(1, |want|).
std::map<at::ScalarType, double>& MaxErrors() {
  static auto* errors = new std::map<at::ScalarType, double>();
  return *errors;
}

// Measured: 7.4e-7 (f32), 3.2e-14 (f64).
double Tolerance(at::ScalarType dtype) { return dtype == at::kDouble ? 2e-13 : 2e-6; }

at::Tensor Randn(at::IntArrayRef shape, uint64_t seed, at::ScalarType dtype) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kDouble)).to(dtype);
}


// got == want within Tolerance(dtype) * max(1, max |want|); records the error.
void ExpectNear(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined() && want.defined()) << what << ": undefined";
  ASSERT_EQ(got.sizes(), want.sizes()) << what << ": got " << Shape(got) << ", want "
                                       << Shape(want);
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  if (got.numel() == 0) return;
  const at::Tensor g = got.to(at::kDouble), w = want.to(at::kDouble);
  const double scale = std::max(1.0, w.abs().max().item<double>());
  const double err = (g - w).abs().max().item<double>() / scale;
  double& max_err = MaxErrors()[want.scalar_type()];
  max_err = std::max(max_err, err);
  EXPECT_LE(err, Tolerance(want.scalar_type())) << what;
}

// [n, C, spatial...] for an input of `dim` dimensions.
std::vector<int64_t> InputShape(int64_t n, int64_t dim) {
  std::vector<int64_t> shape = {n, kC};
  if (dim == 3) shape.push_back(5);
  if (dim == 4) shape.insert(shape.end(), {3, 2});
  if (dim == 5) shape.insert(shape.end(), {2, 3, 2});
  return shape;
}

struct Case {
  std::string name;
  int world = 1;
  std::vector<int64_t> rows;  // per rank
  int groups = 1;             // Split into `groups` groups of consecutive ranks
  int64_t dim = 4;
  at::ScalarType dtype = at::kFloat;
  c10::optional<double> momentum = 0.1;
  bool affine = true;
  bool track_running_stats = true;
  int steps = 3;
  bool input_requires_grad = true;  // false: no input gradient, no backward all-reduce
};

torch::nn::BatchNormOptions BnOptions(const Case& c) {
  return torch::nn::BatchNormOptions(kC)
      .momentum(c.momentum)
      .affine(c.affine)
      .track_running_stats(c.track_running_stats);
}

// torch::nn::BatchNorm1d (dims 2, 3), 2d (4) or 3d (5).
torch::nn::AnyModule ReferenceBatchNorm(const Case& c) {
  if (c.dim <= 3) return torch::nn::AnyModule(torch::nn::BatchNorm1d(BnOptions(c)));
  if (c.dim == 4) return torch::nn::AnyModule(torch::nn::BatchNorm2d(BnOptions(c)));
  return torch::nn::AnyModule(torch::nn::BatchNorm3d(BnOptions(c)));
}

struct StepResult {
  at::Tensor y, dx, dw, db;
};

struct Result {
  std::vector<StepResult> steps;
  at::Tensor running_mean, running_var, num_batches_tracked, y_eval;
  int64_t forward_all_reduces = 0, backward_all_reduces = 0, eval_all_reduces = 0;
};

void RunCase(const Case& c) {
  SCOPED_TRACE(c.name);
  ASSERT_EQ(static_cast<int>(c.rows.size()), c.world);
  const int group_size = c.world / c.groups;
  // Inputs, loss weights (per step and rank) and the initial affine parameters.
  std::vector<std::vector<at::Tensor>> xs(c.steps), ws(c.steps);
  std::vector<at::Tensor> x_eval(c.world);
  for (int s = 0; s < c.steps; ++s) {
    for (int r = 0; r < c.world; ++r) {
      // Non-zero means and scales, so that the statistics matter.
      xs[s].push_back(Randn(InputShape(c.rows[r], c.dim), 1000 + 10 * s + r, c.dtype) * 1.5 +
                      0.7);
      ws[s].push_back(Randn(InputShape(c.rows[r], c.dim), 2000 + 10 * s + r, c.dtype));
    }
  }
  for (int r = 0; r < c.world; ++r) {
    x_eval[r] = Randn(InputShape(c.rows[r], c.dim), 3000 + r, c.dtype) * 1.5 + 0.7;
  }
  const at::Tensor weight0 = Randn({kC}, 7, c.dtype) * 0.5 + 1.0;
  const at::Tensor bias0 = Randn({kC}, 8, c.dtype) * 0.3;

  // The reference: one process per group, that group's ranks' rows concatenated.
  std::vector<Result> reference(c.groups);
  for (int g = 0; g < c.groups; ++g) {
    torch::nn::AnyModule bn = ReferenceBatchNorm(c);
    bn.ptr()->to(c.dtype);
    auto params = bn.ptr()->named_parameters(/*recurse=*/false);
    if (c.affine) {
      torch::NoGradGuard no_grad;
      params["weight"].copy_(weight0);
      params["bias"].copy_(bias0);
    }
    auto cat = [&](const std::vector<at::Tensor>& per_rank) {
      std::vector<at::Tensor> parts(per_rank.begin() + g * group_size,
                                    per_rank.begin() + (g + 1) * group_size);
      return at::cat(parts);
    };
    for (int s = 0; s < c.steps; ++s) {
      at::Tensor x = cat(xs[s]).requires_grad_(c.input_requires_grad);
      at::Tensor y = bn.forward(x);
      (y * cat(ws[s])).sum().backward();
      StepResult step{y.detach(), x.grad(), at::Tensor(), at::Tensor()};
      if (c.affine) {
        step.dw = params["weight"].grad().clone();
        step.db = params["bias"].grad().clone();
        params["weight"].mutable_grad().zero_();
        params["bias"].mutable_grad().zero_();
      }
      reference[g].steps.push_back(step);
    }
    if (c.track_running_stats) {
      auto buffers = bn.ptr()->named_buffers(/*recurse=*/false);
      reference[g].running_mean = buffers["running_mean"].clone();
      reference[g].running_var = buffers["running_var"].clone();
      reference[g].num_batches_tracked = buffers["num_batches_tracked"].clone();
    }
    bn.ptr()->eval();
    torch::NoGradGuard no_grad;
    reference[g].y_eval = bn.forward(cat(x_eval));
  }

  // The ranks.
  std::vector<Result> results(c.world);
  ExpectAllOk(
      RunInprocRanks(
          c.world,
          [&](int rank, int world, std::shared_ptr<Communicator> world_comm) -> absl::Status {
            std::shared_ptr<Communicator> group = world_comm;
            if (c.groups > 1) {
              FS_ASSIGN_OR_RETURN(group, world_comm->Split(rank / group_size, rank));
            }
            auto counting = std::make_shared<CountingCommunicator>(group);
            return fairscale::testing::CatchErrors([&]() -> absl::Status {
              SyncBatchNorm bn(SyncBatchNormOptions(kC)
                                   .momentum(c.momentum)
                                   .affine(c.affine)
                                   .track_running_stats(c.track_running_stats),
                               counting);
              bn->to(c.dtype);
              if (c.affine) {
                torch::NoGradGuard no_grad;
                bn->weight.copy_(weight0);
                bn->bias.copy_(bias0);
              }
              Result& result = results[rank];
              for (int s = 0; s < c.steps; ++s) {
                at::Tensor x = xs[s][rank].clone().requires_grad_(c.input_requires_grad);
                const int64_t before = counting->count(OpType::kAllReduce).ops;
                at::Tensor y = bn(x);
                const int64_t after_forward = counting->count(OpType::kAllReduce).ops;
                (y * ws[s][rank]).sum().backward();
                const int64_t after_backward = counting->count(OpType::kAllReduce).ops;
                result.forward_all_reduces = std::max(result.forward_all_reduces,
                                                      after_forward - before);
                result.backward_all_reduces = std::max(result.backward_all_reduces,
                                                       after_backward - after_forward);
                StepResult step{y.detach(), x.grad(), at::Tensor(), at::Tensor()};
                if (c.affine) {
                  step.dw = bn->weight.grad().clone();
                  step.db = bn->bias.grad().clone();
                  bn->weight.mutable_grad().zero_();
                  bn->bias.mutable_grad().zero_();
                }
                result.steps.push_back(step);
              }
              if (c.track_running_stats) {
                result.running_mean = bn->running_mean.clone();
                result.running_var = bn->running_var.clone();
                result.num_batches_tracked = bn->num_batches_tracked.clone();
              }
              bn->eval();
              torch::NoGradGuard no_grad;
              const int64_t before = counting->count(OpType::kAllReduce).ops;
              result.y_eval = bn(x_eval[rank]);
              result.eval_all_reduces = counting->count(OpType::kAllReduce).ops - before;
              return absl::OkStatus();
            });
          }),
      c.name);

  for (int r = 0; r < c.world; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r, "/", c.world));
    const int g = r / group_size;
    int64_t offset = 0;
    for (int q = g * group_size; q < r; ++q) offset += c.rows[q];
    const Result& got = results[r];
    const Result& want = reference[g];
    ASSERT_EQ(got.steps.size(), static_cast<size_t>(c.steps));
    for (int s = 0; s < c.steps; ++s) {
      const std::string step = absl::StrCat("step ", s, " ");
      ExpectNear(got.steps[s].y, want.steps[s].y.narrow(0, offset, c.rows[r]), step + "y");
      if (c.input_requires_grad) {
        ExpectNear(got.steps[s].dx, want.steps[s].dx.narrow(0, offset, c.rows[r]), step + "dx");
      } else {
        EXPECT_FALSE(got.steps[s].dx.defined());
      }
    }
    EXPECT_EQ(got.forward_all_reduces, 1);
    EXPECT_EQ(got.backward_all_reduces, c.input_requires_grad ? 1 : 0);
    EXPECT_EQ(got.eval_all_reduces, c.track_running_stats ? 0 : 1);
    if (c.track_running_stats) {
      ExpectNear(got.running_mean, want.running_mean, "running_mean");
      ExpectNear(got.running_var, want.running_var, "running_var");
      EXPECT_TRUE(got.num_batches_tracked.equal(want.num_batches_tracked));
    }
    ExpectNear(got.y_eval, want.y_eval.narrow(0, offset, c.rows[r]), "eval y");
  }
  // Weight and bias gradients: this rank's part; their sum over the group is the batch's.
  if (c.affine) {
    for (int g = 0; g < c.groups; ++g) {
      for (int s = 0; s < c.steps; ++s) {
        at::Tensor dw = at::zeros_like(weight0), db = at::zeros_like(bias0);
        for (int r = g * group_size; r < (g + 1) * group_size; ++r) {
          dw += results[r].steps[s].dw;
          db += results[r].steps[s].db;
        }
        ExpectNear(dw, reference[g].steps[s].dw, absl::StrCat("group ", g, " step ", s, " dw"));
        ExpectNear(db, reference[g].steps[s].db, absl::StrCat("group ", g, " step ", s, " db"));
      }
    }
  }
}

TEST(SyncBatchNormTest, OneRankEqualsBatchNorm) {
  for (int64_t dim = 2; dim <= 5; ++dim) {
    RunCase({.name = absl::StrCat("world 1 dim ", dim), .world = 1, .rows = {4}, .dim = dim});
  }
}

TEST(SyncBatchNormTest, OddBatchSizesAtWorlds2To4) {
  RunCase({.name = "world 2 rows 3,1", .world = 2, .rows = {3, 1}, .dim = 4});
  RunCase({.name = "world 3 rows 3,1,2 dim 3", .world = 3, .rows = {3, 1, 2}, .dim = 3});
  RunCase({.name = "world 4 rows 3,1,2,5 dim 5", .world = 4, .rows = {3, 1, 2, 5}, .dim = 5});
  RunCase({.name = "world 4 rows 3,1,2,5 dim 2", .world = 4, .rows = {3, 1, 2, 5}, .dim = 2});
}

TEST(SyncBatchNormTest, EmptyRanks) {
  RunCase({.name = "world 2 rows 0,3", .world = 2, .rows = {0, 3}, .dim = 4});
  RunCase({.name = "world 4 rows 3,0,2,0 dim 2", .world = 4, .rows = {3, 0, 2, 0}, .dim = 2});
  RunCase({.name = "world 3 rows 0,1,1 dim 2", .world = 3, .rows = {0, 1, 1}, .dim = 2});
}

TEST(SyncBatchNormTest, Float64) {
  RunCase({.name = "f64 world 1", .world = 1, .rows = {5}, .dtype = at::kDouble});
  RunCase({.name = "f64 world 4 rows 3,1,0,5",
           .world = 4,
           .rows = {3, 1, 0, 5},
           .dim = 3,
           .dtype = at::kDouble});
}

TEST(SyncBatchNormTest, Options) {
  RunCase({.name = "momentum nullopt",
           .world = 3,
           .rows = {2, 1, 4},
           .momentum = c10::nullopt});
  RunCase({.name = "affine false", .world = 2, .rows = {2, 3}, .dim = 3, .affine = false});
  RunCase({.name = "no running stats (eval uses the batch, synced)",
           .world = 3,
           .rows = {1, 0, 4},
           .track_running_stats = false});
  RunCase({.name = "f64 momentum 0.3 affine false",
           .world = 2,
           .rows = {1, 2},
           .dim = 5,
           .dtype = at::kDouble,
           .momentum = 0.3,
           .affine = false});
}

// The first layer of a network: only weight and bias need gradients, which are local.
TEST(SyncBatchNormTest, InputWithoutGradHasNoBackwardCollective) {
  RunCase({.name = "x without grad",
           .world = 3,
           .rows = {2, 0, 3},
           .dim = 3,
           .input_requires_grad = false});
}

TEST(SyncBatchNormTest, SubCommunicatorGroupsNormalizeSeparately) {
  RunCase({.name = "world 4 split 2x2 rows 3,1,2,5",
           .world = 4,
           .rows = {3, 1, 2, 5},
           .groups = 2,
           .dim = 4});
  RunCase({.name = "world 4 split 2x2 rows 0,3,2,0 f64",
           .world = 4,
           .rows = {0, 3, 2, 0},
           .groups = 2,
           .dim = 2,
           .dtype = at::kDouble});
}

TEST(SyncBatchNormTest, StateDictNamesMatchBatchNorm) {
  auto names_of = [](const torch::nn::Module& m) {
    std::vector<std::string> names;
    for (const auto& p : m.named_parameters()) names.push_back("p:" + p.key());
    for (const auto& b : m.named_buffers()) names.push_back("b:" + b.key());
    return names;
  };
  for (const bool affine : {true, false}) {
    for (const bool track : {true, false}) {
      ExpectAllOk(RunInprocRanks(1, [&](int, int, std::shared_ptr<Communicator> comm) {
        torch::nn::BatchNorm2d bn(
            torch::nn::BatchNorm2dOptions(4).affine(affine).track_running_stats(track));
        SyncBatchNorm sbn(SyncBatchNormOptions(4).affine(affine).track_running_stats(track),
                          comm);
        return Check(names_of(*bn) == names_of(*sbn),
                     absl::StrCat("affine ", affine, " track ", track, ": ",
                                  absl::StrJoin(names_of(*bn), ","), " vs ",
                                  absl::StrJoin(names_of(*sbn), ",")));
      }));
    }
  }
}

// A block whose forward calls a typed Sequential member: converted in place, so it runs the
// SyncBatchNorms afterwards.
struct HeadImpl : torch::nn::Cloneable<HeadImpl> {
  HeadImpl() { reset(); }
  void reset() override {
    seq = register_module(
        "seq",
        torch::nn::Sequential(
            torch::nn::Conv2d(torch::nn::Conv2dOptions(kC, 4, 1).bias(false)),
            torch::nn::BatchNorm2d(torch::nn::BatchNorm2dOptions(4).momentum(c10::nullopt))));
  }
  at::Tensor forward(const at::Tensor& x) { return seq->forward(x); }
  torch::nn::Sequential seq{nullptr};
};
TORCH_MODULE(Head);

// The model of the conversion test: BatchNorm2d in a Sequential and, with momentum nullopt, in
// the Sequential member of a block inside it. The convolutions have no bias, as usual before a
// BatchNorm: its gradient is exactly 0 in theory, so both sides would compare rounding noise.
torch::nn::Sequential MakeModel() {
  torch::manual_seed(5);  // main thread only
  return torch::nn::Sequential(
      torch::nn::Conv2d(torch::nn::Conv2dOptions(2, kC, 3).padding(1).bias(false)),
      torch::nn::BatchNorm2d(kC), torch::nn::ReLU(), Head());
}

TEST(SyncBatchNormTest, ConvertSyncBatchNormOnSequentialEqualsTheOriginal) {
  constexpr int kWorld = 3;
  const std::vector<int64_t> rows = {3, 0, 2};
  constexpr int kSteps = 2;
  torch::nn::Sequential original = MakeModel();
  // Everything made here, in the main thread.
  std::vector<torch::nn::Sequential> copies;
  for (int r = 0; r < kWorld; ++r) {
    copies.push_back(
        torch::nn::Sequential(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(
            original->clone())));
  }
  std::vector<std::vector<at::Tensor>> xs(kSteps), ws(kSteps);
  for (int s = 0; s < kSteps; ++s) {
    for (int r = 0; r < kWorld; ++r) {
      xs[s].push_back(Randn({rows[r], 2, 4, 3}, 100 + 10 * s + r, at::kFloat) + 0.5);
      ws[s].push_back(Randn({rows[r], 4, 4, 3}, 200 + 10 * s + r, at::kFloat));
    }
  }
  std::vector<at::Tensor> x_eval;
  for (int r = 0; r < kWorld; ++r) x_eval.push_back(Randn({rows[r], 2, 4, 3}, 300 + r, at::kFloat));

  // The reference: the original model on the whole batch. Gradients accumulate over the steps.
  std::vector<at::Tensor> ref_y, ref_dx;
  for (int s = 0; s < kSteps; ++s) {
    at::Tensor x = at::cat(xs[s]).requires_grad_(true);
    at::Tensor y = original->forward(x);
    (y * at::cat(ws[s])).sum().backward();
    ref_y.push_back(y.detach());
    ref_dx.push_back(x.grad());
  }
  original->eval();
  at::Tensor ref_eval;
  {
    torch::NoGradGuard no_grad;
    ref_eval = original->forward(at::cat(x_eval));
  }

  struct Got {
    std::vector<at::Tensor> y, dx;
    std::map<std::string, at::Tensor> grads, buffers;
    at::Tensor y_eval;
  };
  std::vector<Got> got(kWorld);
  ExpectAllOk(RunInprocRanks(kWorld, [&](int rank, int, std::shared_ptr<Communicator> comm)
                                         -> absl::Status {
    return fairscale::testing::CatchErrors([&]() -> absl::Status {
      torch::nn::Sequential model = copies[rank];
      std::vector<std::string> names_before;
      for (const auto& p : model->named_parameters()) names_before.push_back(p.key());
      for (const auto& b : model->named_buffers()) names_before.push_back(b.key());
      const at::Tensor bn_weight = model->named_parameters()["1.weight"];
      std::shared_ptr<torch::nn::Module> root = convert_sync_batchnorm(model.ptr(), comm);
      FS_RETURN_IF_ERROR(Check(root == model.ptr(), "the root is converted in place"));
      int sync = 0;
      for (const auto& m : model->modules()) {
        FS_RETURN_IF_ERROR(
            Check(dynamic_cast<torch::nn::BatchNorm2dImpl*>(m.get()) == nullptr,
                  "a BatchNorm2d is left"));
        if (dynamic_cast<SyncBatchNormImpl*>(m.get()) != nullptr) ++sync;
      }
      FS_RETURN_IF_ERROR(Check(sync == 2, absl::StrCat(sync, " SyncBatchNorms, want 2")));
      std::vector<std::string> names_after;
      for (const auto& p : model->named_parameters()) names_after.push_back(p.key());
      for (const auto& b : model->named_buffers()) names_after.push_back(b.key());
      FS_RETURN_IF_ERROR(Check(names_before == names_after,
                               absl::StrCat("names ", absl::StrJoin(names_after, ","))));
      FS_RETURN_IF_ERROR(Check(model->named_parameters()["1.weight"].is_same(bn_weight),
                               "the parameters are shared, not copied"));
      auto* head = model[3]->as<Head>();
      FS_RETURN_IF_ERROR(Check(head != nullptr, "the head"));
      auto* inner_bn = head->seq[1]->as<SyncBatchNormImpl>();
      FS_RETURN_IF_ERROR(Check(inner_bn != nullptr && !inner_bn->options.momentum().has_value(),
                               "the inner SyncBatchNorm keeps momentum nullopt"));
      Got& g = got[rank];
      for (int s = 0; s < kSteps; ++s) {
        at::Tensor x = xs[s][rank].clone().requires_grad_(true);
        at::Tensor y = model->forward(x);
        (y * ws[s][rank]).sum().backward();
        g.y.push_back(y.detach());
        g.dx.push_back(x.grad());
      }
      for (const auto& p : model->named_parameters()) g.grads[p.key()] = p.value().grad().clone();
      for (const auto& b : model->named_buffers()) g.buffers[b.key()] = b.value().clone();
      model->eval();
      torch::NoGradGuard no_grad;
      g.y_eval = model->forward(x_eval[rank]);
      return absl::OkStatus();
    });
  }));

  int64_t offset = 0;
  for (int r = 0; r < kWorld; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    ASSERT_EQ(got[r].y.size(), static_cast<size_t>(kSteps));
    for (int s = 0; s < kSteps; ++s) {
      ExpectNear(got[r].y[s], ref_y[s].narrow(0, offset, rows[r]), absl::StrCat("step ", s, " y"));
      ExpectNear(got[r].dx[s], ref_dx[s].narrow(0, offset, rows[r]),
                 absl::StrCat("step ", s, " dx"));
    }
    for (const auto& b : original->named_buffers()) {
      ASSERT_EQ(got[r].buffers.count(b.key()), 1u) << b.key();
      if (b.value().scalar_type() == at::kLong) {
        EXPECT_TRUE(got[r].buffers[b.key()].equal(b.value())) << b.key();
      } else {
        ExpectNear(got[r].buffers[b.key()], b.value(), b.key());
      }
    }
    ExpectNear(got[r].y_eval, ref_eval.narrow(0, offset, rows[r]), "eval y");
    offset += rows[r];
  }
  // Parameter gradients summed over the ranks (what data-parallel averaging * world gives).
  for (const auto& p : original->named_parameters()) {
    at::Tensor sum = at::zeros_like(p.value());
    for (int r = 0; r < kWorld; ++r) sum += got[r].grads.at(p.key());
    ExpectNear(sum, p.value().grad(), p.key() + " grad");
  }
}

// A ModuleList and a ModuleDict are updated in place as well; a typed member is not (a warning
// says so), and a BatchNorm root is replaced.
TEST(SyncBatchNormTest, ConvertContainersTypedMembersAndRoot) {
  struct Net : torch::nn::Module {
    torch::nn::BatchNorm1d typed{register_module("typed", torch::nn::BatchNorm1d(kC))};
    torch::nn::ModuleList list{register_module(
        "list", torch::nn::ModuleList(torch::nn::Linear(kC, kC), torch::nn::BatchNorm1d(kC)))};
    torch::nn::ModuleDict dict{register_module(
        "dict", torch::nn::ModuleDict(torch::OrderedDict<std::string,
                                                         std::shared_ptr<torch::nn::Module>>(
                    {{"bn", torch::nn::BatchNorm3d(kC).ptr()}})))};
  };
  struct Capture : c10::WarningHandler {
    void process(const c10::SourceLocation&, const std::string& msg, bool) override {
      messages.push_back(msg);
    }
    std::vector<std::string> messages;
  };
  ExpectAllOk(RunInprocRanks(1, [&](int, int, std::shared_ptr<Communicator> comm)
                                    -> absl::Status {
    return fairscale::testing::CatchErrors([&]() -> absl::Status {
      auto net = std::make_shared<Net>();
      Capture capture;
      {
        c10::Warning::WarningHandlerGuard guard(&capture);
        FS_RETURN_IF_ERROR(Check(convert_sync_batchnorm(net, comm) == net, "root kept"));
      }
      FS_RETURN_IF_ERROR(Check(net->list[1]->as<SyncBatchNormImpl>() != nullptr, "list[1]"));
      FS_RETURN_IF_ERROR(Check(net->dict["bn"]->as<SyncBatchNormImpl>() != nullptr, "dict"));
      FS_RETURN_IF_ERROR(Check(
          net->named_children()["typed"]->as<SyncBatchNormImpl>() != nullptr, "typed child"));
      FS_RETURN_IF_ERROR(Check(capture.messages.size() == 1 &&
                                   capture.messages[0].find("'typed'") != std::string::npos,
                               absl::StrCat("warnings: ", absl::StrJoin(capture.messages, "|"))));
      // The list's forward path: through the container's own entry.
      at::Tensor y = net->list[1]->as<SyncBatchNormImpl>()->forward(at::ones({2, kC}));
      FS_RETURN_IF_ERROR(Check(y.abs().max().item<double>() == 0, "constant input -> 0"));
      // A BatchNorm root becomes a new SyncBatchNorm with its tensors.
      torch::nn::BatchNorm2d bn(torch::nn::BatchNorm2dOptions(kC).eps(1e-3));
      bn->eval();
      auto converted = convert_sync_batchnorm(bn.ptr(), comm);
      auto* sbn = converted->as<SyncBatchNormImpl>();
      FS_RETURN_IF_ERROR(Check(sbn != nullptr, "root converted"));
      FS_RETURN_IF_ERROR(Check(sbn->options.eps() == 1e-3 && !sbn->is_training() &&
                                   sbn->running_var.is_same(bn->running_var),
                               "options, mode and buffers"));
      std::ostringstream printed;
      sbn->pretty_print(printed);
      return Check(printed.str().find("SyncBatchNorm(3, eps=0.001") != std::string::npos,
                   printed.str());
    });
  }));
}

TEST(SyncBatchNormTest, Errors) {
  EXPECT_NE(fairscale::testing::ErrorOf([] {
              SyncBatchNorm bn(SyncBatchNormOptions(3), nullptr);
            }).find("the communicator is null"),
            std::string::npos);
  EXPECT_NE(fairscale::testing::ErrorOf([] {
              convert_sync_batchnorm(nullptr, nullptr);
            }).find("null"),
            std::string::npos);
  ExpectAllOk(RunInprocRanks(2, [&](int rank, int, std::shared_ptr<Communicator> comm)
                                    -> absl::Status {
    SyncBatchNorm bn(SyncBatchNormOptions(kC), comm);
    const std::string who = absl::StrCat("rank ", rank, "/2");
    FS_RETURN_IF_ERROR(ExpectError([&] { bn(at::ones({kC})); },
                                   {who, "[3]", "2 or more dimensions"}));
    FS_RETURN_IF_ERROR(ExpectError([&] { bn(at::ones({4, 5, 2})); },
                                   {who, "[4, 5, 2]", "expected 3 channels", "got 5"}));
    // Every rank empty: 0 values per channel over the group, on every rank.
    FS_RETURN_IF_ERROR(ExpectError([&] { bn(at::ones({0, kC, 2})); },
                                   {who, "more than 1 value per channel", "got 0"}));
    // One value per channel over the group (rank 0 has one row, rank 1 none).
    FS_RETURN_IF_ERROR(ExpectError([&] { bn(at::ones({rank == 0 ? 1 : 0, kC})); },
                                   {who, "more than 1 value per channel", "got 1"}));
    FS_RETURN_IF_ERROR(Check(bn->num_batches_tracked.item<int64_t>() == 0,
                             "failed forwards leave the running statistics alone"));
    // The communicator still works, and eval with running statistics needs no peer.
    at::Tensor y = bn(at::ones({rank + 1, kC}) * rank);
    FS_RETURN_IF_ERROR(Check(y.size(0) == rank + 1, "a good forward after the errors"));
    bn->eval();
    return Check(bn(at::ones({0, kC})).numel() == 0, "eval on an empty rank");
  }));
}

TEST(SyncBatchNormTest, ZzReportMaxErrors) {
  for (const auto& [dtype, err] : MaxErrors()) {
    std::printf("max error %s: %.3g\n", c10::toString(dtype), err);
  }
}

}  // namespace
}  // namespace fairscale::sync_batchnorm
