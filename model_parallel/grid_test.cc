// MakeParallelGrid (model_parallel/grid.h) at world sizes 1, 2, 4, 8 with every (tensor,
// pipeline) whose product divides the world (ranks as threads over the inproc backend): the
// sizes and coordinates follow rank = replica * (pipeline * tensor) + stage * tensor +
// tensor_rank; each group's size and rank are as the formula says; an all-gather of the world
// ranks over each group returns exactly the expected members in order; an all-reduce of the
// world rank over each group gives their sum; describe(); the pipe::PipeGrid view; a
// ColumnParallelLinear over grid.tensor_group of a 2 tensor x 2 data grid equals its dense twin
// on each replica; a pipe::Pipe of such layers on the pipeline group, averaged over the data
// group, equals the dense model at world 8 = 2 x 2 x 2; bad sizes raise errors that name them.
#include "model_parallel/grid.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "base/status_macros.h"
#include "comm/communicator.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "comm/types.h"
#include "model_parallel/layers.h"
#include "model_parallel/pipe_grid.h"
#include "pipe/fsdp_stage.h"
#include "pipe/grid.h"
#include "pipe/pipe.h"
#include "testing/c10_error.h"

namespace fairscale::model_parallel {
namespace {

using comm::Communicator;
using comm::testing::Check;
using comm::testing::ExpectAllOk;
using comm::testing::RunInprocRanks;
using fairscale::testing::CatchErrors;
using fairscale::testing::ExpectError;

constexpr absl::Duration kTimeout = absl::Seconds(20);

// The world ranks of `group`'s members in group-rank order (an all-gather of each member's
// world rank).
absl::StatusOr<std::vector<int64_t>> Members(Communicator& group, int64_t world_rank) {
  std::vector<int64_t> mine = {world_rank};
  std::vector<int64_t> all(static_cast<size_t>(group.size()), -1);
  FS_RETURN_IF_ERROR(group
                         .AllGather(comm::MakeConstBuffer(mine.data(), 1),
                                    comm::MakeBuffer(all.data(), all.size()))
                         .Wait(kTimeout));
  return all;
}

// Checks one group: its size and rank, its members (all-gathered) against `want`, and an
// all-reduce (sum) of the world rank.
absl::Status CheckGroup(const std::shared_ptr<Communicator>& group, int64_t world_rank,
                        int64_t want_rank, const std::vector<int64_t>& want,
                        const std::string& what) {
  FS_RETURN_IF_ERROR(Check(group != nullptr, what + ": null group"));
  FS_RETURN_IF_ERROR(Check(group->size() == static_cast<int>(want.size()),
                           absl::StrCat(what, ": size ", group->size(), ", want ", want.size())));
  FS_RETURN_IF_ERROR(Check(group->rank() == want_rank,
                           absl::StrCat(what, ": rank ", group->rank(), ", want ", want_rank)));
  FS_ASSIGN_OR_RETURN(const std::vector<int64_t> members, Members(*group, world_rank));
  FS_RETURN_IF_ERROR(
      Check(members == want, absl::StrCat(what, ": members ", absl::StrJoin(members, ","),
                                          ", want ", absl::StrJoin(want, ","))));
  std::vector<int64_t> value = {world_rank};
  FS_RETURN_IF_ERROR(group
                         ->AllReduce(comm::MakeConstBuffer(value.data(), 1),
                                     comm::MakeBuffer(value.data(), 1), comm::ReduceOp::kSum)
                         .Wait(kTimeout));
  const int64_t sum = std::accumulate(want.begin(), want.end(), int64_t{0});
  return Check(value[0] == sum, absl::StrCat(what, ": all-reduce sum ", value[0], ", want ", sum));
}

TEST(ParallelGrid, EveryLayoutAtWorlds1To8) {
  for (int world : {1, 2, 4, 8}) {
    for (int64_t tensor = 1; tensor <= world; ++tensor) {
      for (int64_t pipeline = 1; tensor * pipeline <= world; ++pipeline) {
        if (world % (tensor * pipeline) != 0) continue;
        const int64_t data = world / (tensor * pipeline);
        const std::string label =
            absl::StrCat("world ", world, " tensor ", tensor, " pipeline ", pipeline);
        ExpectAllOk(
            RunInprocRanks(
                world,
                [&](int r, int n, std::shared_ptr<Communicator> comm) {
                  return CatchErrors([&]() -> absl::Status {
                    const ParallelGrid g = MakeParallelGrid(comm, tensor, pipeline);
                    FS_RETURN_IF_ERROR(Check(g.tensor == tensor && g.pipeline == pipeline &&
                                                 g.data == data && g.world == comm,
                                             label + ": sizes"));
                    FS_RETURN_IF_ERROR(Check(
                        g.replica * pipeline * tensor + g.stage * tensor + g.tensor_rank == r &&
                            g.tensor_rank >= 0 && g.tensor_rank < tensor && g.stage >= 0 &&
                            g.stage < pipeline && g.replica >= 0 && g.replica < data,
                        absl::StrCat(label, ": coordinates ", g.describe())));
                    // Expected members, by brute force over every world rank.
                    std::vector<int64_t> tp, pp, dp;
                    for (int64_t q = 0; q < n; ++q) {
                      const int64_t t = q % tensor, s = (q / tensor) % pipeline,
                                    d = q / (tensor * pipeline);
                      if (s == g.stage && d == g.replica) tp.push_back(q);
                      if (t == g.tensor_rank && d == g.replica) pp.push_back(q);
                      if (t == g.tensor_rank && s == g.stage) dp.push_back(q);
                    }
                    FS_RETURN_IF_ERROR(Check(
                        g.tensor_ranks() == tp && g.pipeline_ranks() == pp && g.data_ranks() == dp,
                        label + ": *_ranks() " + g.describe()));
                    FS_RETURN_IF_ERROR(
                        CheckGroup(g.tensor_group, r, g.tensor_rank, tp, label + " tensor"));
                    FS_RETURN_IF_ERROR(
                        CheckGroup(g.pipeline_group, r, g.stage, pp, label + " pipeline"));
                    FS_RETURN_IF_ERROR(CheckGroup(g.data_group, r, g.replica, dp, label + " data"));
                    const pipe::PipeGrid pg = ToPipeGrid(g);
                    return Check(pg.stages == pipeline && pg.replicas == data &&
                                     pg.stage == g.stage && pg.replica == g.replica &&
                                     pg.pipe == g.pipeline_group && pg.data == g.data_group,
                                 label + ": ToPipeGrid");
                  });
                }),
            label);
      }
    }
  }
}

// A world barrier before a rank drops a grid whose groups it has not used: Split returns on a
// group's rank 0 before its peers have attached to the new (inproc) communicator, so destroying
// it at once makes their Split fail ("domain ... is gone").
absl::Status Settle(const ParallelGrid& g) { return g.world->Barrier().Wait(kTimeout); }

TEST(ParallelGrid, Describe) {
  ExpectAllOk(RunInprocRanks(8, [](int r, int, std::shared_ptr<Communicator> comm) {
    return CatchErrors([&]() -> absl::Status {
      const ParallelGrid g = MakeParallelGrid(comm, 2, 2);
      FS_RETURN_IF_ERROR(Settle(g));
      if (r != 5) return absl::OkStatus();
      const std::string want =
          "rank 5/8: tensor 1/2 (ranks 4,5), stage 0/2 (ranks 5,7), replica 1/2 (ranks 1,5)";
      return Check(g.describe() == want, absl::StrCat("got '", g.describe(), "'"));
    });
  }));
}

at::Tensor Data(at::IntArrayRef shape, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kFloat));
}

// Within 1e-5 (f32), relative to max(1, |want|): the loss of the pipe test is ~200, where one
// f32 ulp is 1.5e-5 (the pipe averages micro-batch losses in double).
absl::Status Near(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  if (!got.defined() || got.sizes() != want.sizes()) {
    return absl::InternalError(what + ": undefined or wrong shape");
  }
  const double diff = (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
  const double scale = std::max(1.0, want.abs().max().item<double>());
  return Check(diff <= 1e-5 * scale,
               absl::StrCat(what, ": max |got - want| = ", diff, " (scale ", scale, ")"));
}

// World 4 = 2 tensor x 1 pipeline x 2 data: each replica runs its own input through a
// ColumnParallelLinear over grid.tensor_group; both equal the dense layer on that input.
TEST(ParallelGrid, ColumnParallelLinearOnTensorGroupEqualsDense) {
  const at::Tensor w = Data({8, 6}, 1), b = Data({8}, 2);
  const std::vector<at::Tensor> xs = {Data({3, 6}, 3), Data({3, 6}, 4)};
  std::vector<at::Tensor> ys, dws;
  for (const at::Tensor& x : xs) {
    torch::nn::Linear dense(torch::nn::LinearOptions(6, 8));
    {
      torch::NoGradGuard no_grad;
      dense->weight.copy_(w);
      dense->bias.copy_(b);
    }
    const at::Tensor y = dense(x);
    y.sum().backward();
    ys.push_back(y.detach());
    dws.push_back(dense->weight.grad().clone());
  }
  ExpectAllOk(RunInprocRanks(4, [&](int, int, std::shared_ptr<Communicator> comm) {
    return CatchErrors([&]() -> absl::Status {
      const ParallelGrid g = MakeParallelGrid(comm, /*tensor=*/2, /*pipeline=*/1);
      FS_RETURN_IF_ERROR(Settle(g));  // the data group is not used here
      ColumnParallelLinear layer(ColumnParallelLinearOptions(6, 8), g.tensor_group);
      layer->load_full(w, b);
      const at::Tensor out = layer(xs[g.replica]);
      out.sum().backward();
      const std::string what = g.describe();
      FS_RETURN_IF_ERROR(Near(out, ys[g.replica], what + " output"));
      return Near(layer->weight.grad(), dws[g.replica].narrow(0, g.tensor_rank * 4, 4),
                  what + " dW");
    });
  }));
}

// The three groups together, world 8 = 2 tensor x 2 pipeline x 2 data: a two-stage pipe::Pipe on
// grid.pipeline_group whose stages are ColumnParallelLinear layers on grid.tensor_group, each
// replica training its half of the batch (2 micro-batches), then the gradients averaged over
// grid.data_group: every rank's loss is its replica's dense loss, and its weight and bias
// gradients are its rows of the dense model's gradients on the whole batch.
TEST(ParallelGrid, PipeOfTensorParallelStagesWithDataParallelEqualsDense) {
  const at::Tensor w0 = Data({8, 4}, 11), b0 = Data({8}, 12), w1 = Data({6, 8}, 13),
                   b1 = Data({6}, 14), x = Data({8, 4}, 15), y = Data({8, 6}, 16);
  torch::nn::Linear d0(torch::nn::LinearOptions(4, 8)), d1(torch::nn::LinearOptions(8, 6));
  {
    torch::NoGradGuard no_grad;
    d0->weight.copy_(w0);
    d0->bias.copy_(b0);
    d1->weight.copy_(w1);
    d1->bias.copy_(b1);
  }
  torch::mse_loss(d1(d0(x)), y).backward();
  std::vector<at::Tensor> replica_loss;
  for (int64_t d = 0; d < 2; ++d) {
    torch::NoGradGuard no_grad;
    replica_loss.push_back(torch::mse_loss(d1(d0(x.narrow(0, 4 * d, 4))), y.narrow(0, 4 * d, 4)));
  }
  ExpectAllOk(RunInprocRanks(8, [&](int, int, std::shared_ptr<Communicator> comm) {
    return CatchErrors([&]() -> absl::Status {
      const ParallelGrid g = MakeParallelGrid(comm, /*tensor=*/2, /*pipeline=*/2);
      ColumnParallelLinear l0(ColumnParallelLinearOptions(4, 8), g.tensor_group);
      ColumnParallelLinear l1(ColumnParallelLinearOptions(8, 6), g.tensor_group);
      l0->load_full(w0, b0);
      l1->load_full(w1, b1);
      torch::nn::Sequential model;
      model->push_back("fc0", l0);
      model->push_back("fc1", l1);
      auto pipe = pipe::Pipe::Create(model, g.pipeline_group, pipe::PipeOptions().chunks(2));
      const at::Tensor loss = pipe->train_step(
          x.narrow(0, 4 * g.replica, 4), y.narrow(0, 4 * g.replica, 4),
          [](const at::Tensor& out, const at::Tensor& t) { return torch::mse_loss(out, t); });
      pipe::all_reduce_gradients(pipe->parameters(), *g.data_group, kTimeout);
      const std::string what = g.describe();
      FS_RETURN_IF_ERROR(Near(loss, replica_loss[g.replica], what + " loss"));
      const torch::nn::Linear& dense = g.stage == 0 ? d0 : d1;
      const ColumnParallelLinear& mine = g.stage == 0 ? l0 : l1;
      const int64_t rows = dense->weight.size(0) / 2;
      FS_RETURN_IF_ERROR(Near(mine->weight.grad(),
                              dense->weight.grad().narrow(0, g.tensor_rank * rows, rows),
                              what + " dW"));
      return Near(mine->bias.grad(), dense->bias.grad().narrow(0, g.tensor_rank * rows, rows),
                  what + " db");
    });
  }));
}

// FSDP over grid.data_group, world 8 = 2 x 2 x 2: the same pipe with each stage wrapped in
// FSDP (pipe::fsdp_stage) over the data group instead of all_reduce_gradients; one SGD step
// (lr 0.1) on the shards, then the second step's loss on every rank equals the dense model's
// loss on the replica's rows after one dense SGD step on the whole batch.
TEST(ParallelGrid, FsdpOnDataGroupEqualsDense) {
  const at::Tensor w0 = Data({8, 4}, 21), b0 = Data({8}, 22), w1 = Data({6, 8}, 23),
                   b1 = Data({6}, 24), x = Data({8, 4}, 25), y = Data({8, 6}, 26);
  torch::nn::Linear d0(torch::nn::LinearOptions(4, 8)), d1(torch::nn::LinearOptions(8, 6));
  {
    torch::NoGradGuard no_grad;
    d0->weight.copy_(w0);
    d0->bias.copy_(b0);
    d1->weight.copy_(w1);
    d1->bias.copy_(b1);
  }
  torch::optim::SGD dense_opt(std::vector<at::Tensor>{d0->weight, d0->bias, d1->weight, d1->bias},
                              torch::optim::SGDOptions(0.1));
  torch::mse_loss(d1(d0(x)), y).backward();
  dense_opt.step();
  std::vector<at::Tensor> replica_loss;
  for (int64_t d = 0; d < 2; ++d) {
    torch::NoGradGuard no_grad;
    replica_loss.push_back(torch::mse_loss(d1(d0(x.narrow(0, 4 * d, 4))), y.narrow(0, 4 * d, 4)));
  }
  ExpectAllOk(RunInprocRanks(8, [&](int, int, std::shared_ptr<Communicator> comm) {
    return CatchErrors([&]() -> absl::Status {
      const ParallelGrid g = MakeParallelGrid(comm, /*tensor=*/2, /*pipeline=*/2);
      ColumnParallelLinear l0(ColumnParallelLinearOptions(4, 8), g.tensor_group);
      ColumnParallelLinear l1(ColumnParallelLinearOptions(8, 6), g.tensor_group);
      l0->load_full(w0, b0);
      l1->load_full(w1, b1);
      torch::nn::Sequential model;
      model->push_back("fc0", l0);
      model->push_back("fc1", l1);
      auto pipe = pipe::Pipe::Create(
          model, g.pipeline_group,
          pipe::PipeOptions().chunks(2).wrap_stage(pipe::fsdp_stage(g.data_group)));
      torch::optim::SGD opt(pipe->parameters(), torch::optim::SGDOptions(0.1));
      const pipe::LossFn mse = [](const at::Tensor& out, const at::Tensor& t) {
        return torch::mse_loss(out, t);
      };
      const at::Tensor xr = x.narrow(0, 4 * g.replica, 4), yr = y.narrow(0, 4 * g.replica, 4);
      opt.zero_grad();
      pipe->train_step(xr, yr, mse);
      opt.step();
      const at::Tensor loss = pipe->eval_step(xr, yr, mse);
      return Near(loss, replica_loss[g.replica], g.describe() + " loss after one SGD step");
    });
  }));
}

TEST(ParallelGrid, BadSizesAreClearErrors) {
  ExpectAllOk(RunInprocRanks(4, [](int r, int, std::shared_ptr<Communicator> comm) {
    FS_RETURN_IF_ERROR(
        ExpectError([&] { MakeParallelGrid(comm, 3, 1); },
                    {"model_parallel::MakeParallelGrid", absl::StrCat("rank ", r, "/4"),
                     "INVALID_ARGUMENT", "3 * 1 = 3", "does not divide the world size 4"}));
    FS_RETURN_IF_ERROR(
        ExpectError([&] { MakeParallelGrid(comm, 2, 4); }, {"2 * 4 = 8", "world size 4"}));
    FS_RETURN_IF_ERROR(
        ExpectError([&] { MakeParallelGrid(comm, 0, 2); },
                    {"INVALID_ARGUMENT", "tensor = 0", "pipeline = 2", ">= 1", "world size 4"}));
    FS_RETURN_IF_ERROR(
        ExpectError([&] { MakeParallelGrid(comm, 2, 0); }, {"tensor = 2", "pipeline = 0"}));
    FS_RETURN_IF_ERROR(ExpectError([&] { MakeParallelGrid(comm, -1, 1); }, {"tensor = -1"}));
    // The communicator is still usable after the errors (no Split was issued).
    return CatchErrors([&]() -> absl::Status {
      const ParallelGrid g = MakeParallelGrid(comm, 2, 1);
      FS_RETURN_IF_ERROR(Settle(g));
      return Check(g.data == 2, "grid after errors");
    });
  }));
  EXPECT_NE(fairscale::testing::ErrorOf([] { MakeParallelGrid(nullptr, 1, 1); }).find("null"),
            std::string::npos);
}

}  // namespace
}  // namespace fairscale::model_parallel
