// Deterministic mode of OSS + ShardedDataParallel (issue 22): 10 steps of Adam on the test Net,
// 24 micro-batches of 2 rows per step, with and without clip_grad_norm, give bitwise the same
// step losses and final parameters at 1, 2, 3, 4 and 8 ranks, and the same bits as an
// independent single-process loop (plain torch::optim::Adam over the canonical tree sum of the
// per-micro-batch gradients). The default mode does not (the negative control). Bad input:
// a world size that does not divide the micro-batches, ranks mixing modes, a wrong number of
// backward passes, options deterministic mode refuses.
//
// bf16: ShardedDataParallel has no mixed precision, so there is no bf16 variant to test.
#include <ATen/Parallel.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/adam.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "deterministic/collectives.h"
#include "deterministic/tree.h"
#include "oss/oss.h"
#include "oss/sharded_data_parallel.h"
#include "testing/bitwise.h"
#include "testing/c10_error.h"
#include "testing/model.h"

namespace fairscale::oss {
namespace {

using ::fairscale::comm::testing::Check;
using ::fairscale::comm::testing::ExpectAllOk;
using ::fairscale::comm::testing::RunInprocRanks;
using ::fairscale::testing::Bitwise;
using ::fairscale::testing::ErrorOf;
using ::fairscale::testing::ExpectError;
using ::fairscale::testing::Mse;
using ::fairscale::testing::Net;
using ::testing::HasSubstr;

constexpr int64_t kM = 24;    // micro-batches per step
constexpr int64_t kRows = 2;  // rows per micro-batch
constexpr int kSteps = 10;
constexpr double kMaxNorm = 0.05;  // below the gradients' norm: every step clips

struct Data {
  std::vector<std::vector<at::Tensor>> x, y;  // [step][micro-batch]
};

// Fixed data, made once in the main thread (the rank threads share torch's global RNG).
const Data& TheData() {
  static const Data* data = [] {
    auto* d = new Data;
    torch::manual_seed(1234);
    for (int s = 0; s < kSteps; ++s) {
      d->x.emplace_back();
      d->y.emplace_back();
      for (int64_t i = 0; i < kM; ++i) {
        d->x.back().push_back(torch::randn({kRows, 5}));
        d->y.back().push_back(torch::randn({kRows, 3}));
      }
    }
    return d;
  }();
  return *data;
}

OptimizerFactory AdamFactory() {
  return [](std::vector<torch::optim::OptimizerParamGroup> groups) {
    return std::unique_ptr<torch::optim::Optimizer>(
        std::make_unique<torch::optim::Adam>(std::move(groups), torch::optim::AdamOptions(0.01)));
  };
}

bool SameBits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

struct Result {
  std::vector<double> losses;  // the step loss: the mean over the step's micro-batches
  std::vector<double> norms;   // clip_grad_norm's return
  std::vector<at::Tensor> params;
};

std::string Describe(const Result& a, const Result& b) {
  for (size_t s = 0; s < a.losses.size(); ++s) {
    if (!SameBits(a.losses[s], b.losses[s])) {
      return absl::StrCat("step ", s, " loss ", a.losses[s], " vs ", b.losses[s]);
    }
  }
  for (size_t s = 0; s < a.norms.size(); ++s) {
    if (!SameBits(a.norms[s], b.norms[s])) {
      return absl::StrCat("step ", s, " norm ", a.norms[s], " vs ", b.norms[s]);
    }
  }
  for (size_t i = 0; i < a.params.size(); ++i) {
    if (!Bitwise(a.params[i], b.params[i])) {
      return absl::StrCat("parameter ", i, " differs by up to ",
                          (a.params[i] - b.params[i]).abs().max().item<double>());
    }
  }
  if (a.losses.size() != b.losses.size() || a.norms.size() != b.norms.size() ||
      a.params.size() != b.params.size()) {
    return "different lengths";
  }
  return "";
}

// The loop a user writes, on `world` inproc ranks. Deterministic: one backward per micro-batch
// on its own loss. Default: the usual gradient accumulation (loss / k, no_sync for all but the
// last backward; the library averages over the ranks). Returns rank 0's result after checking
// that every rank ends with the same bits.
Result Train(int world, bool det, bool clip) {
  const Data& data = TheData();
  std::vector<Result> results(world);
  ExpectAllOk(
      RunInprocRanks(
          world,
          [&](int rank, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
            return fairscale::testing::CatchErrors([&]() -> absl::Status {
              Net net;
              auto opt = std::make_shared<OSS>(fairscale::testing::DistinctParameters(*net),
                                               AdamFactory(), comm,
                                               OssOptions().deterministic(det));
              ShardedDataParallel model(torch::nn::AnyModule(net), opt,
                                        ShardedDataParallelOptions()
                                            .reduce_bucket_numel(64)
                                            .deterministic(det)
                                            .micro_batches(kM));
              const auto layout = deterministic::MicroBatchLayout::Make(kM, world, rank);
              const int64_t k = layout.per_rank();
              Result& out = results[rank];
              for (int s = 0; s < kSteps; ++s) {
                opt->zero_grad();
                std::vector<double> losses;
                for (int64_t i = layout.first(); i < layout.first() + k; ++i) {
                  at::Tensor loss = Mse(model->forward(data.x[s][i]), data.y[s][i]);
                  losses.push_back(loss.item<double>());
                  if (det) {
                    loss.backward();
                  } else if (i + 1 < layout.first() + k) {
                    auto guard = model->no_sync();
                    (loss / static_cast<double>(k)).backward();
                  } else {
                    (loss / static_cast<double>(k)).backward();
                  }
                }
                if (clip) out.norms.push_back(opt->clip_grad_norm(kMaxNorm));
                opt->step();
                out.losses.push_back(deterministic::Mean(*comm, layout, losses, "loss"));
              }
              for (const at::Tensor& p : net->parameters()) out.params.push_back(p.detach().clone());
              return absl::OkStatus();
            });
          }),
      absl::StrCat("train at world ", world));
  for (int r = 1; r < world; ++r) {
    const std::string diff = Describe(results[0], results[r]);
    EXPECT_EQ(diff, "") << "world " << world << ": rank " << r << " differs from rank 0";
  }
  return results[0];
}

// The independent reference: one process, plain torch::optim::Adam over all parameters, each
// micro-batch's gradient taken from .grad, summed over the canonical tree, divided by M; the
// 2-norm from the exact sum of squares.
Result Reference(bool clip) {
  const Data& data = TheData();
  Net net;
  std::vector<at::Tensor> params = fairscale::testing::DistinctParameters(*net);
  torch::optim::Adam adam(params, torch::optim::AdamOptions(0.01));
  Result out;
  for (int s = 0; s < kSteps; ++s) {
    std::vector<deterministic::Accumulator> acc(params.size());
    std::vector<double> losses;
    for (int64_t i = 0; i < kM; ++i) {
      for (at::Tensor& p : params) p.mutable_grad() = at::Tensor();
      at::Tensor loss = Mse(net->forward(data.x[s][i]), data.y[s][i]);
      losses.push_back(loss.item<double>());
      loss.backward();
      for (size_t j = 0; j < params.size(); ++j) {
        acc[j].Add(i, params[j].grad().detach().clone().reshape({-1}));
      }
    }
    torch::NoGradGuard no_grad;
    for (size_t j = 0; j < params.size(); ++j) {
      params[j].mutable_grad() =
          deterministic::Total(acc[j].Take(), kM).div_(kM).view(params[j].sizes());
    }
    if (clip) {
      deterministic::ExactSquareSum sum;
      for (const at::Tensor& p : params) sum.Add(p.grad());
      const double norm = sum.norm();
      out.norms.push_back(norm);
      const double coef = kMaxNorm / (norm + 1e-6);
      if (coef < 1) {
        for (const at::Tensor& p : params) p.grad().mul_(coef);
      }
    }
    adam.step();
    out.losses.push_back(deterministic::TotalOf(losses) / static_cast<double>(kM));
  }
  for (const at::Tensor& p : net->parameters()) out.params.push_back(p.detach().clone());
  return out;
}

class DeterministicTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    threads_ = at::get_num_threads();
    at::set_num_threads(1);
  }
  void TearDown() override { at::set_num_threads(threads_); }
  int threads_ = 1;
};

TEST_P(DeterministicTest, BitwiseIdenticalAtEveryWorldSize) {
  const bool clip = GetParam();
  const Result ref = Reference(clip);
  const Result one = Train(1, /*det=*/true, clip);
  EXPECT_EQ(Describe(ref, one), "") << "world 1 vs the single-process reference";
  for (int world : {2, 3, 4, 8}) {
    const Result got = Train(world, /*det=*/true, clip);
    EXPECT_EQ(Describe(one, got), "") << "world " << world << " vs world 1";
  }
  if (clip) {
    for (double norm : one.norms) EXPECT_GT(norm, kMaxNorm);  // every step clipped
  }
}

// The control: the default mode's loop (the usual accumulation and averaging) is close to the
// deterministic one but not bitwise equal across world sizes, so the test above can fail.
TEST_P(DeterministicTest, DefaultModeDiffersAcrossWorldSizes) {
  const bool clip = GetParam();
  const Result one = Train(1, /*det=*/false, clip);
  const Result three = Train(3, /*det=*/false, clip);
  const Result four = Train(4, /*det=*/false, clip);
  EXPECT_TRUE(Describe(one, three) != "" || Describe(one, four) != "")
      << "the default mode happened to be bitwise reproducible: the control shows nothing";
  const Result det = Train(1, /*det=*/true, clip);
  for (size_t i = 0; i < one.params.size(); ++i) {
    EXPECT_TRUE(at::allclose(one.params[i], det.params[i], 0, 1e-4)) << "parameter " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Clip, DeterministicTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Clip" : "NoClip"; });

class DeterministicErrorsTest : public DeterministicTest {};

// Builds OSS + SDP in deterministic mode (or per `det`) on `comm`.
struct Built {
  Net net;
  std::shared_ptr<OSS> opt;
  ShardedDataParallel model{nullptr};
};
std::unique_ptr<Built> Build(std::shared_ptr<comm::Communicator> comm, bool oss_det, bool sdp_det,
                             int64_t micro_batches = kM) {
  auto b = std::make_unique<Built>();
  b->opt = std::make_shared<OSS>(fairscale::testing::DistinctParameters(*b->net), AdamFactory(),
                                 comm, OssOptions().deterministic(oss_det));
  b->model = ShardedDataParallel(
      torch::nn::AnyModule(b->net), b->opt,
      ShardedDataParallelOptions().deterministic(sdp_det).micro_batches(micro_batches));
  return b;
}

TEST_F(DeterministicErrorsTest, WorldSizeMustDivideTheMicroBatches) {
  ExpectAllOk(RunInprocRanks(5, [&](int, int, std::shared_ptr<comm::Communicator> comm) {
    return ExpectError([&] { Build(comm, true, true); },
                       {"24 micro-batches per step cannot be split evenly over 5 ranks",
                        "1, 2, 3, 4, 6, 8, 12, 24"});
  }));
}

TEST_F(DeterministicErrorsTest, MixedModesFailOnEveryRank) {
  // OSS: rank 2 default, the others deterministic.
  ExpectAllOk(RunInprocRanks(3, [&](int rank, int, std::shared_ptr<comm::Communicator> comm) {
    return ExpectError([&] { Build(comm, rank != 2, rank != 2); },
                       {"oss::OSS::construct", "ranks disagree on deterministic mode"});
  }));
  // ShardedDataParallel: every OSS deterministic, rank 1's SDP not.
  ExpectAllOk(RunInprocRanks(3, [&](int rank, int, std::shared_ptr<comm::Communicator> comm) {
    return ExpectError([&] { Build(comm, true, rank != 1); },
                       {"oss::ShardedDataParallel::construct", "ranks disagree",
                        "24 micro-batches per step", "default (non-deterministic) mode"});
  }));
  // Different micro-batch counts.
  ExpectAllOk(RunInprocRanks(2, [&](int rank, int, std::shared_ptr<comm::Communicator> comm) {
    return ExpectError([&] { Build(comm, true, true, rank == 0 ? 24 : 12); },
                       {"ranks disagree", "12 micro-batches"});
  }));
  // One process: OSS and SDP disagree.
  ExpectAllOk(RunInprocRanks(1, [&](int, int, std::shared_ptr<comm::Communicator> comm) {
    FS_RETURN_IF_ERROR(ExpectError([&] { Build(comm, false, true); },
                                   {"OssOptions().deterministic(true)"}));
    return ExpectError([&] { Build(comm, true, false); },
                       {"ShardedDataParallelOptions().deterministic(true)"});
  }));
}

TEST_F(DeterministicErrorsTest, RefusedOptionsAndThreads) {
  ExpectAllOk(RunInprocRanks(1, [&](int, int, std::shared_ptr<comm::Communicator> comm) {
    Net net;
    auto params = fairscale::testing::DistinctParameters(*net);
    FS_RETURN_IF_ERROR(ExpectError(
        [&] {
          OSS(params, AdamFactory(), comm,
              OssOptions().deterministic(true).broadcast_dtype(at::kBFloat16));
        },
        {"broadcast_dtype"}));
    FS_RETURN_IF_ERROR(ExpectError(
        [&] {
          OSS(params, AdamFactory(), comm,
              OssOptions().deterministic(true).partition(PartitionMode::kFlat));
        },
        {"kGreedy"}));
    return ExpectError([&] { Build(comm, true, true, 0); }, {"at least 1, got 0"});
  }));
  at::set_num_threads(2);
  ExpectAllOk(RunInprocRanks(1, [&](int, int, std::shared_ptr<comm::Communicator> comm) {
    return ExpectError([&] { Build(comm, true, true); }, {"at::set_num_threads(1)"});
  }));
  at::set_num_threads(1);
}

TEST_F(DeterministicErrorsTest, WrongNumberOfBackwardPasses) {
  const Data& data = TheData();
  ExpectAllOk(RunInprocRanks(2, [&](int rank, int, std::shared_ptr<comm::Communicator> comm)
                                    -> absl::Status {
    return fairscale::testing::CatchErrors([&]() -> absl::Status {
      auto b = Build(comm, true, true);
      const int64_t first = rank * 12;
      auto backward = [&](int64_t n) {
        for (int64_t i = 0; i < n; ++i) {
          Mse(b->model->forward(data.x[0][first + i % 12]), data.y[0][first + i % 12]).backward();
        }
      };
      FS_RETURN_IF_ERROR(ExpectError([&] { b->opt->step(); },
                                     {"oss::ShardedDataParallel::step rank", "after 0 backward",
                                      "each step runs exactly 12"}));
      backward(1);
      // Autograd did not accumulate: the micro-batch's gradient is with the wrapper.
      for (const at::Tensor& p : b->net->parameters()) {
        FS_RETURN_IF_ERROR(Check(!p.grad().defined(), "a .grad after one micro-batch"));
      }
      backward(10);
      FS_RETURN_IF_ERROR(ExpectError([&] { b->opt->step(); },
                                     {"after 11 of this rank's 12 backward passes"}));
      FS_RETURN_IF_ERROR(ExpectError([&] { b->opt->clip_grad_norm(1.0); },
                                     {"clip_grad_norm after 11 of"}));
      backward(1);  // the 12th: reduced to the owners
      for (const ParamShard& s : b->opt->shards()) {
        FS_RETURN_IF_ERROR(Check(s.param.grad().defined() == (s.rank == rank),
                                 "a gradient on a non-owner, or none on the owner"));
      }
      FS_RETURN_IF_ERROR(ExpectError([&] { b->opt->clip_grad_norm(1.0, 1.0); },
                                     {"norm_type 2 and inf"}));
      b->opt->clip_grad_norm(1.0, std::numeric_limits<double>::infinity());
      b->opt->step();
      backward(24);
      FS_RETURN_IF_ERROR(ExpectError([&] { b->opt->step(); },
                                     {"after 24 backward passes since the last step"}));
      FS_RETURN_IF_ERROR(ExpectError([&] { auto g = b->model->no_sync(); }, {"no_sync"}));
      return ExpectError([&] { b->model->reduce(); }, {"reduces by itself"});
    });
  }));
}

}  // namespace
}  // namespace fairscale::oss
