// The tensor-parallel layers of model_parallel/layers.h and vocab_parallel_cross_entropy at
// T = 1, 2, 3, 4 (ranks as threads over the inproc backend), each against its dense LibTorch twin
// built from the same full weights and computed here in the main thread (fixed data from private
// generators; rank bodies never touch torch's global RNG): forward outputs, input gradients and
// the shard gradients = slices of the dense gradients, within 1e-5 (f32); a Column -> gelu -> Row
// MLP and 5 Adam steps on it; the cross-entropy against torch's on the full logits; full state
// dicts across T; bad sizes and shapes.
#include "model_parallel/layers.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "comm/communicator.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "model_parallel/cross_entropy.h"
#include "model_parallel/rng.h"
#include "testing/c10_error.h"
#include "testing/near.h"

namespace fairscale::model_parallel {
namespace {

using comm::Communicator;
using comm::testing::Check;
using comm::testing::ExpectAllOk;
using comm::testing::RunInprocRanks;
using fairscale::testing::CatchErrors;
using fairscale::testing::ExpectError;
using fairscale::testing::Near;
using fairscale::testing::Shape;

constexpr double kTol = 1e-5;

at::Tensor Data(at::IntArrayRef shape, uint64_t seed, at::ScalarType dtype = at::kFloat) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kDouble)).to(dtype);
}

at::Tensor Tokens(at::IntArrayRef shape, int64_t vocab, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(0, vocab, shape, gen, at::TensorOptions().dtype(at::kLong));
}



at::Tensor Slice(const at::Tensor& t, int64_t dim, int r, int n) {
  const int64_t k = t.size(dim) / n;
  return t.narrow(dim, r * k, k);
}

void SetParam(at::Tensor& p, const at::Tensor& value) {
  torch::NoGradGuard no_grad;
  p.copy_(value);
}

// The dense reference of a linear layer: torch::nn::Linear with the full weight [out, in] and
// bias [out] (none if undefined), applied to a copy of `x` that requires grad. Built in the main
// thread; the caller runs the backward pass it compares against.
struct DenseLinear {
  torch::nn::Linear linear{nullptr};
  at::Tensor x;  // the input; x.grad() after backward
  at::Tensor y;  // linear(x)
};

DenseLinear RunDenseLinear(const at::Tensor& w, const at::Tensor& b, const at::Tensor& x) {
  DenseLinear d;
  d.linear = torch::nn::Linear(torch::nn::LinearOptions(w.size(1), w.size(0)).bias(b.defined()));
  SetParam(d.linear->weight, w);
  if (b.defined()) SetParam(d.linear->bias, b);
  d.x = x.clone().requires_grad_(true);
  d.y = d.linear(d.x);
  return d;
}

TEST(ModelParallel, ColumnParallelLinearEqualsDense) {
  const at::Tensor w = Data({12, 6}, 1), b = Data({12}, 2), x = Data({2, 3, 6}, 3),
                   l = Data({2, 3, 12}, 4);
  for (bool bias : {true, false}) {
    const DenseLinear dense = RunDenseLinear(w, bias ? b : at::Tensor(), x);
    const at::Tensor &dx = dense.x, &y = dense.y;
    (y * l).sum().backward();
    for (int world : {1, 2, 3, 4}) {
      for (bool gather : {true, false}) {
        const std::string label =
            absl::StrCat("column T=", world, " bias=", bias, " gather_output=", gather);
        ExpectAllOk(RunInprocRanks(
                        world,
                        [&](int r, int n, std::shared_ptr<Communicator> comm) {
                          return CatchErrors([&]() -> absl::Status {
                            ColumnParallelLinear layer(
                                ColumnParallelLinearOptions(6, 12).bias(bias).gather_output(gather),
                                comm);
                            layer->load_full(w, bias ? b : at::Tensor());
                            const at::Tensor xr = x.clone().requires_grad_(true);
                            const at::Tensor out = layer(xr);
                            const at::Tensor want = gather ? y : Slice(y, -1, r, n);
                            (out * (gather ? l : Slice(l, -1, r, n))).sum().backward();
                            FS_RETURN_IF_ERROR(Near(out, want, kTol, label + " output"));
                            FS_RETURN_IF_ERROR(Near(xr.grad(), dx.grad(), kTol, label + " dX"));
                            FS_RETURN_IF_ERROR(Near(layer->weight.grad(),
                                                    Slice(dense.linear->weight.grad(), 0, r, n),
                                                    kTol, label + " dW"));
                            if (bias) {
                              FS_RETURN_IF_ERROR(Near(layer->bias.grad(),
                                                      Slice(dense.linear->bias.grad(), 0, r, n),
                                                      kTol, label + " db"));
                            }
                            FS_RETURN_IF_ERROR(Near(layer->full_weight(), w, 0, label + " full W"));
                            return bias ? Near(layer->full_bias(), b, 0, label + " full b")
                                        : absl::OkStatus();
                          });
                        }),
                    label);
      }
    }
  }
}

TEST(ModelParallel, RowParallelLinearEqualsDense) {
  const at::Tensor w = Data({5, 12}, 11), b = Data({5}, 12), x = Data({2, 3, 12}, 13),
                   l = Data({2, 3, 5}, 14);
  for (bool bias : {true, false}) {
    const DenseLinear dense = RunDenseLinear(w, bias ? b : at::Tensor(), x);
    const at::Tensor &dx = dense.x, &y = dense.y;
    (y * l).sum().backward();
    for (int world : {1, 2, 3, 4}) {
      for (bool parallel : {false, true}) {
        const std::string label =
            absl::StrCat("row T=", world, " bias=", bias, " input_is_parallel=", parallel);
        ExpectAllOk(
            RunInprocRanks(
                world,
                [&](int r, int n, std::shared_ptr<Communicator> comm) {
                  return CatchErrors([&]() -> absl::Status {
                    RowParallelLinear layer(
                        RowParallelLinearOptions(12, 5).bias(bias).input_is_parallel(parallel),
                        comm);
                    layer->load_full(w, bias ? b : at::Tensor());
                    const at::Tensor xr =
                        (parallel ? Slice(x, -1, r, n) : x).clone().requires_grad_(true);
                    const at::Tensor out = layer(xr);
                    (out * l).sum().backward();
                    FS_RETURN_IF_ERROR(Near(out, y, kTol, label + " output"));
                    FS_RETURN_IF_ERROR(Near(xr.grad(),
                                            parallel ? Slice(dx.grad(), -1, r, n) : dx.grad(), kTol,
                                            label + " dX"));
                    FS_RETURN_IF_ERROR(Near(layer->weight.grad(),
                                            Slice(dense.linear->weight.grad(), 1, r, n), kTol,
                                            label + " dW"));
                    if (bias) {
                      FS_RETURN_IF_ERROR(
                          Near(layer->bias.grad(), dense.linear->bias.grad(), kTol, label + " db"));
                    }
                    return Near(layer->full_weight(), w, 0, label + " full W");
                  });
                }),
            label);
      }
    }
  }
}

TEST(ModelParallel, VocabParallelEmbeddingEqualsDense) {
  const at::Tensor w = Data({12, 5}, 21), tokens = Tokens({3, 4}, 12, 22), l = Data({3, 4, 5}, 23);
  torch::nn::Embedding dense(12, 5);
  SetParam(dense->weight, w);
  const at::Tensor y = dense(tokens);
  (y * l).sum().backward();
  for (int world : {1, 2, 3, 4}) {
    const std::string label = absl::StrCat("embedding T=", world);
    ExpectAllOk(
        RunInprocRanks(world,
                       [&](int r, int n, std::shared_ptr<Communicator> comm) {
                         return CatchErrors([&]() -> absl::Status {
                           VocabParallelEmbedding layer(VocabParallelEmbeddingOptions(12, 5), comm);
                           layer->load_full(w);
                           FS_RETURN_IF_ERROR(Check(layer->vocab_start() == r * 12 / n &&
                                                        layer->vocab_end() == (r + 1) * 12 / n,
                                                    label + " range"));
                           const at::Tensor out = layer(tokens);
                           (out * l).sum().backward();
                           FS_RETURN_IF_ERROR(Near(out, y, kTol, label + " output"));
                           FS_RETURN_IF_ERROR(Near(layer->weight.grad(),
                                                   Slice(dense->weight.grad(), 0, r, n), kTol,
                                                   label + " dW"));
                           return Near(layer->full_weight(), w, 0, label + " full W");
                         });
                       }),
        label);
  }
}

TEST(ModelParallel, VocabParallelCrossEntropyEqualsCrossEntropy) {
  for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    const double tol = dtype == at::kFloat ? kTol : 1e-12;
    const at::Tensor logits = Data({2, 5, 12}, 31, dtype) * 3, targets = Tokens({2, 5}, 12, 32);
    const at::Tensor full = logits.clone().requires_grad_(true);
    const at::Tensor want =
        torch::nn::functional::cross_entropy(full.reshape({-1, 12}), targets.reshape({-1}));
    (want * 0.7).backward();
    for (int world : {1, 2, 3, 4}) {
      const std::string label = absl::StrCat("cross-entropy ", c10::toString(dtype), " T=", world);
      ExpectAllOk(RunInprocRanks(world,
                                 [&](int r, int n, std::shared_ptr<Communicator> comm) {
                                   return CatchErrors([&]() -> absl::Status {
                                     const at::Tensor shard =
                                         Slice(logits, -1, r, n).clone().requires_grad_(true);
                                     const at::Tensor loss =
                                         vocab_parallel_cross_entropy(shard, targets, *comm);
                                     (loss * 0.7).backward();
                                     FS_RETURN_IF_ERROR(Near(loss, want, tol, label + " loss"));
                                     return Near(shard.grad(), Slice(full.grad(), -1, r, n), tol,
                                                 label + " grad");
                                   });
                                 }),
                  label);
    }
  }
  // The output layer of a tensor-parallel LM: ColumnParallelLinear(gather_output = false) ->
  // vocab_parallel_cross_entropy equals Linear -> cross_entropy (loss, dX, dW).
  const at::Tensor w = Data({12, 6}, 33), x = Data({7, 6}, 34), targets = Tokens({7}, 12, 35);
  const DenseLinear dense = RunDenseLinear(w, at::Tensor(), x);
  const at::Tensor& dx = dense.x;
  const at::Tensor want = torch::nn::functional::cross_entropy(dense.y, targets);
  want.backward();
  for (int world : {1, 2, 3, 4}) {
    const std::string label = absl::StrCat("column + cross-entropy T=", world);
    ExpectAllOk(
        RunInprocRanks(
            world,
            [&](int r, int n, std::shared_ptr<Communicator> comm) {
              return CatchErrors([&]() -> absl::Status {
                ColumnParallelLinear head(
                    ColumnParallelLinearOptions(6, 12).bias(false).gather_output(false), comm);
                head->load_full(w);
                const at::Tensor xr = x.clone().requires_grad_(true);
                const at::Tensor loss = vocab_parallel_cross_entropy(head(xr), targets, *comm);
                loss.backward();
                FS_RETURN_IF_ERROR(Near(loss, want, kTol, label + " loss"));
                FS_RETURN_IF_ERROR(Near(xr.grad(), dx.grad(), kTol, label + " dX"));
                return Near(head->weight.grad(), Slice(dense.linear->weight.grad(), 0, r, n), kTol,
                            label + " dW");
              });
            }),
        label);
  }
}

// The dense MLP and its tensor-parallel twin, under the same module names.
struct DenseMlpImpl : torch::nn::Module {
  DenseMlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(8, 12))),
        fc2(register_module("fc2", torch::nn::Linear(12, 6))) {}
  at::Tensor forward(const at::Tensor& x) { return fc2(at::gelu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(DenseMlp);

struct TpMlpImpl : torch::nn::Module {
  TpMlpImpl(const std::shared_ptr<Communicator>& comm, uint64_t seed = 0)
      : fc1(register_module(
            "fc1",
            ColumnParallelLinear(
                ColumnParallelLinearOptions(8, 12).gather_output(false).init_seed(seed), comm))),
        fc2(register_module(
            "fc2", RowParallelLinear(
                       RowParallelLinearOptions(12, 6).input_is_parallel(true).init_seed(seed + 1),
                       comm))) {}
  at::Tensor forward(const at::Tensor& x) { return fc2(at::gelu(fc1(x))); }
  ColumnParallelLinear fc1;
  RowParallelLinear fc2;
};
TORCH_MODULE(TpMlp);

// A dense MLP with fixed weights (constructed in the main thread: Linear's own initialization
// draws from the global RNG, and is overwritten here).
DenseMlp MakeDense(uint64_t seed) {
  DenseMlp dense;
  SetParam(dense->fc1->weight, Data({12, 8}, seed));
  SetParam(dense->fc1->bias, Data({12}, seed + 1));
  SetParam(dense->fc2->weight, Data({6, 12}, seed + 2));
  SetParam(dense->fc2->bias, Data({6}, seed + 3));
  return dense;
}

TensorDict DenseState(const DenseMlp& dense) {
  TensorDict d;
  for (const auto& p : dense->named_parameters()) d.insert(p.key(), p.value().detach().clone());
  return d;
}

absl::Status SameState(const TensorDict& got, const TensorDict& want, double tol,
                       const std::string& what) {
  FS_RETURN_IF_ERROR(
      Check(got.keys() == want.keys(), absl::StrCat(what, ": keys ", absl::StrJoin(got.keys(), ","),
                                                    " != ", absl::StrJoin(want.keys(), ","))));
  for (const auto& item : want) {
    FS_RETURN_IF_ERROR(Near(got[item.key()], item.value(), tol, what + " " + item.key()));
  }
  return absl::OkStatus();
}

TEST(ModelParallel, MlpEqualsDense) {
  DenseMlp dense = MakeDense(41);
  const TensorDict state = DenseState(dense);
  const at::Tensor x = Data({4, 8}, 45), l = Data({4, 6}, 46);
  const at::Tensor dx = x.clone().requires_grad_(true);
  const at::Tensor y = dense(dx);
  (y * l).sum().backward();
  for (int world : {1, 2, 3, 4}) {
    const std::string label = absl::StrCat("mlp T=", world);
    ExpectAllOk(
        RunInprocRanks(world,
                       [&](int r, int n, std::shared_ptr<Communicator> comm) {
                         return CatchErrors([&]() -> absl::Status {
                           TpMlp tp(comm);
                           load_full_state_dict(*tp, state);
                           const at::Tensor xr = x.clone().requires_grad_(true);
                           const at::Tensor out = tp(xr);
                           (out * l).sum().backward();
                           FS_RETURN_IF_ERROR(Near(out, y, kTol, label + " output"));
                           FS_RETURN_IF_ERROR(Near(xr.grad(), dx.grad(), kTol, label + " dX"));
                           FS_RETURN_IF_ERROR(Near(tp->fc1->weight.grad(),
                                                   Slice(dense->fc1->weight.grad(), 0, r, n), kTol,
                                                   label + " dW1"));
                           FS_RETURN_IF_ERROR(Near(tp->fc1->bias.grad(),
                                                   Slice(dense->fc1->bias.grad(), 0, r, n), kTol,
                                                   label + " db1"));
                           FS_RETURN_IF_ERROR(Near(tp->fc2->weight.grad(),
                                                   Slice(dense->fc2->weight.grad(), 1, r, n), kTol,
                                                   label + " dW2"));
                           FS_RETURN_IF_ERROR(Near(tp->fc2->bias.grad(), dense->fc2->bias.grad(),
                                                   kTol, label + " db2"));
                           return SameState(full_state_dict(*tp), state, 0, label + " full state");
                         });
                       }),
        label);
  }
}

TEST(ModelParallel, AdamStepsEqualDense) {
  constexpr int kSteps = 5;
  DenseMlp dense = MakeDense(51);
  const TensorDict initial = DenseState(dense);
  std::vector<at::Tensor> xs, targets;
  for (int s = 0; s < kSteps; ++s) {
    xs.push_back(Data({4, 8}, 60 + s));
    targets.push_back(Data({4, 6}, 70 + s));
  }
  torch::optim::Adam dense_opt(dense->parameters(), torch::optim::AdamOptions(1e-2));
  for (int s = 0; s < kSteps; ++s) {
    dense_opt.zero_grad();
    (dense(xs[s]) - targets[s]).pow(2).mean().backward();
    dense_opt.step();
  }
  const TensorDict final_state = DenseState(dense);
  for (int world : {1, 2, 3, 4}) {
    const std::string label = absl::StrCat("adam T=", world);
    ExpectAllOk(
        RunInprocRanks(
            world,
            [&](int r, int n, std::shared_ptr<Communicator> comm) {
              return CatchErrors([&]() -> absl::Status {
                TpMlp tp(comm);
                load_full_state_dict(*tp, initial);
                torch::optim::Adam opt(tp->parameters(), torch::optim::AdamOptions(1e-2));
                for (int s = 0; s < kSteps; ++s) {
                  opt.zero_grad();
                  (tp(xs[s]) - targets[s]).pow(2).mean().backward();
                  opt.step();
                }
                // Slice-wise: this rank's shards against the dense parameters' slices.
                FS_RETURN_IF_ERROR(Near(tp->fc1->weight, Slice(final_state["fc1.weight"], 0, r, n),
                                        kTol, label + " W1"));
                FS_RETURN_IF_ERROR(Near(tp->fc1->bias, Slice(final_state["fc1.bias"], 0, r, n),
                                        kTol, label + " b1"));
                FS_RETURN_IF_ERROR(Near(tp->fc2->weight, Slice(final_state["fc2.weight"], 1, r, n),
                                        kTol, label + " W2"));
                FS_RETURN_IF_ERROR(
                    Near(tp->fc2->bias, final_state["fc2.bias"], kTol, label + " b2"));
                return SameState(full_state_dict(*tp), final_state, kTol, label + " full state");
              });
            }),
        label);
  }
}

// A TpMlp(comm, seed) at T = world, every parameter first changed as training would if
// `perturb`: its full state dict and its output on `x`, as rank 0 sees them.
struct TpExport {
  TensorDict full;
  at::Tensor out;
};

TpExport ExportTpMlp(int world, uint64_t seed, bool perturb, const at::Tensor& x,
                     const std::string& label) {
  TpExport e;
  ExpectAllOk(RunInprocRanks(world,
                             [&](int r, int, std::shared_ptr<Communicator> comm) {
                               return CatchErrors([&]() -> absl::Status {
                                 TpMlp tp(comm, seed);
                                 if (perturb) {
                                   torch::NoGradGuard no_grad;
                                   for (auto& p : tp->parameters()) p.mul_(1.5).add_(0.25);
                                 }
                                 TensorDict full = full_state_dict(*tp);
                                 at::Tensor out = tp(x).detach();
                                 if (r == 0) e = {std::move(full), out};
                                 return absl::OkStatus();
                               });
                             }),
              label);
  return e;
}

TEST(ModelParallel, FullStateDictAcrossWorldSizes) {
  // Seeded initialization: the same full model at every T.
  std::vector<TensorDict> seeded(5);
  const at::Tensor x = Data({3, 8}, 81);
  std::vector<at::Tensor> outputs(5);
  for (int world : {1, 2, 3, 4}) {
    TpExport e =
        ExportTpMlp(world, /*seed=*/7, /*perturb=*/false, x, absl::StrCat("seeded T=", world));
    seeded[world] = std::move(e.full);
    outputs[world] = e.out;
  }
  for (int world : {2, 3, 4}) {
    EXPECT_TRUE(SameState(seeded[world], seeded[1], 0, absl::StrCat("seeded T=", world)).ok());
    EXPECT_TRUE(Near(outputs[world], outputs[1], kTol, "seeded output").ok());
  }
  // The full state dict has the dense twin's keys and shapes, and loads into it.
  DenseMlp dense = MakeDense(0);
  load_full_state_dict(*dense, seeded[2]);
  EXPECT_TRUE(Near(dense(x).detach(), outputs[2], kTol, "dense twin output").ok());

  // Round trip: trained (perturbed) at T = 2, saved full, loaded into fresh models (another seed)
  // at T = 1, 3 and 4.
  const TpExport trained = ExportTpMlp(2, 7, /*perturb=*/true, x, "save at T=2");
  const TensorDict& saved = trained.full;
  const at::Tensor& saved_out = trained.out;
  for (int world : {1, 3, 4}) {
    const std::string label = absl::StrCat("load at T=", world);
    ExpectAllOk(
        RunInprocRanks(world,
                       [&](int, int, std::shared_ptr<Communicator> comm) {
                         return CatchErrors([&]() -> absl::Status {
                           TpMlp tp(comm, 99);
                           load_full_state_dict(*tp, saved);
                           FS_RETURN_IF_ERROR(Near(tp(x), saved_out, kTol, label + " output"));
                           return SameState(full_state_dict(*tp), saved, 0, label + " state");
                         });
                       }),
        label);
  }
}

TEST(ModelParallel, RngReplicatedAgreesParallelDiffers) {
  // The replicated stream is the plain seed's; computed here, in the main thread.
  at::Generator want_gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const at::Tensor ones = at::ones({256});
  const at::Tensor want_rep = dropout(ones, 0.5, true, want_gen);
  for (int world : {1, 2, 3, 4}) {
    std::vector<at::Tensor> rep(world), par(world), par_again(world);
    ExpectAllOk(RunInprocRanks(world,
                               [&](int r, int, std::shared_ptr<Communicator> comm) {
                                 return CatchErrors([&]() -> absl::Status {
                                   ModelParallelRng rng(5, *comm);
                                   rep[r] = dropout(ones, 0.5, true, rng.replicated());
                                   par[r] = dropout(ones, 0.5, true, rng.parallel());
                                   ModelParallelRng again(5, *comm);
                                   par_again[r] = dropout(ones, 0.5, true, again.parallel());
                                   return absl::OkStatus();
                                 });
                               }),
                absl::StrCat("rng T=", world));
    for (int r = 0; r < world; ++r) {
      EXPECT_TRUE(at::equal(rep[r], want_rep)) << "replicated differs on rank " << r;
      EXPECT_TRUE(at::equal(par[r], par_again[r])) << "parallel not reproducible, rank " << r;
      EXPECT_FALSE(at::equal(par[r], want_rep)) << "parallel equals replicated, rank " << r;
      for (int q = 0; q < r; ++q) {
        EXPECT_FALSE(at::equal(par[r], par[q]))
            << "parallel masks equal on ranks " << q << ", " << r;
      }
      // Inverted dropout: kept elements scaled by 1 / (1 - p), about half kept.
      EXPECT_TRUE(at::logical_or(par[r] == 0, par[r] == 2).all().item<bool>());
      const double kept = (par[r] != 0).sum().item<double>() / 256;
      EXPECT_GT(kept, 0.35);
      EXPECT_LT(kept, 0.65);
    }
  }
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
  EXPECT_TRUE(at::equal(dropout(ones, 0.5, false, gen), ones));
  EXPECT_TRUE(at::equal(dropout(ones, 1.0, true, gen), at::zeros({256})));
  EXPECT_NE(fairscale::testing::ErrorOf([&] { dropout(ones, 1.5, true, gen); }).find("p = 1.5"),
            std::string::npos);
}

TEST(ModelParallel, BadInputIsAClearError) {
  ExpectAllOk(
      RunInprocRanks(
          4,
          [](int, int, std::shared_ptr<Communicator> comm) {
            FS_RETURN_IF_ERROR(
                ExpectError([&] { ColumnParallelLinear(ColumnParallelLinearOptions(6, 10), comm); },
                            {"model_parallel::ColumnParallelLinear", "INVALID_ARGUMENT",
                             "out_features = 10", "tensor-parallel size 4"}));
            FS_RETURN_IF_ERROR(
                ExpectError([&] { RowParallelLinear(RowParallelLinearOptions(10, 6), comm); },
                            {"model_parallel::RowParallelLinear", "in_features = 10",
                             "tensor-parallel size 4"}));
            FS_RETURN_IF_ERROR(ExpectError(
                [&] { VocabParallelEmbedding(VocabParallelEmbeddingOptions(10, 3), comm); },
                {"model_parallel::VocabParallelEmbedding", "num_embeddings = 10",
                 "tensor-parallel size 4"}));
            FS_RETURN_IF_ERROR(
                ExpectError([&] { ColumnParallelLinear(ColumnParallelLinearOptions(0, 8), comm); },
                            {"in_features = 0", "positive"}));
            FS_RETURN_IF_ERROR(ExpectError(
                [&] { ColumnParallelLinear(ColumnParallelLinearOptions(6, 8), nullptr); },
                {"null"}));
            ColumnParallelLinear column(ColumnParallelLinearOptions(6, 8), comm);
            FS_RETURN_IF_ERROR(ExpectError(
                [&] {
                  column->load_full(at::zeros({8, 5}), at::zeros({8}));
                },
                {"load_full", "full weight has shape [8, 5], want [8, 6]"}));
            FS_RETURN_IF_ERROR(ExpectError(
                [&] {
                  column->load_full(at::zeros({8, 6}));
                },
                {"full bias has shape (undefined)"}));
            TensorDict extra;
            extra.insert("weight", at::zeros({8, 6}));
            extra.insert("bias", at::zeros({8}));
            extra.insert("scale", at::zeros({8}));
            FS_RETURN_IF_ERROR(ExpectError([&] { load_full_state_dict(*column, extra); },
                                           {"unexpected key 'scale'"}));
            TensorDict missing;
            missing.insert("fc1.weight", at::zeros({12, 8}));
            TpMlp tp(comm);
            FS_RETURN_IF_ERROR(ExpectError([&] { load_full_state_dict(*tp, missing); },
                                           {"layer 'fc1'", "no 'bias'"}));
            FS_RETURN_IF_ERROR(ExpectError(
                [&] {
                  vocab_parallel_cross_entropy(at::zeros({4, 3}), at::zeros({5}, at::kLong), *comm);
                },
                {"vocab_parallel_cross_entropy", "targets must be int64", "[4, 3]", "[5]"}));
            return ExpectError(
                [&] {
                  vocab_parallel_cross_entropy(at::zeros({4, 3}), at::zeros({4}), *comm);
                },
                {"targets must be int64", "Float"});
          }),
      "bad input");
}

}  // namespace
}  // namespace fairscale::model_parallel
