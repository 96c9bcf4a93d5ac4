// Megatron sequence parallelism in the tensor-parallel layers (layers.h: sequence_parallel on
// ColumnParallelLinear / RowParallelLinear; sequence_parallel.h) at T = 1, 2, 4, ranks as threads
// over the inproc backend: a transformer MLP block x -> LayerNorm -> Column -> gelu -> Row -> +x
// run on each rank's chunk of the sequence (dim 0) against the dense block (torch::nn::LayerNorm,
// Linear) on the full sequence, built in the main thread from fixed data (private generators;
// rank bodies never touch torch's global RNG): outputs, input gradients, weight gradients
// slice-wise, the replicated parameters' gradients after all_reduce_sequence_parallel_grads (and
// not without it), 5 Adam steps, within 1e-5 (f32); the bytes on the wire against the plain
// tensor-parallel block; bad options and sizes.
#include "model_parallel/sequence_parallel.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "autograd_comm/collectives.h"
#include "base/status_macros.h"
#include "comm/communicator.h"
#include "comm/testing/counting_communicator.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "model_parallel/layers.h"
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

constexpr double kTol = 1e-5;
constexpr int64_t kSeq = 8, kBatch = 2, kWidth = 8, kHidden = 16;

at::Tensor Data(at::IntArrayRef shape, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kDouble)).to(at::kFloat);
}

// The largest difference any comparison saw (printed per test, for the README).
struct MaxError {
  std::mutex mu;
  double value = 0;
  void Update(double d) {
    std::lock_guard<std::mutex> lock(mu);
    value = std::max(value, d);
  }
};

absl::Status Near(const at::Tensor& got, const at::Tensor& want, const std::string& what,
                  MaxError* max_error = nullptr) {
  double diff = 0;
  absl::Status s = fairscale::testing::Near(got, want, kTol, what, &diff);
  if (max_error != nullptr) max_error->Update(diff);
  return s;
}

at::Tensor Slice(const at::Tensor& t, int64_t dim, int r, int n) {
  const int64_t k = t.size(dim) / n;
  return t.narrow(dim, r * k, k);
}

void SetParam(at::Tensor& p, const at::Tensor& value) {
  torch::NoGradGuard no_grad;
  p.copy_(value);
}

// The dense block and its tensor-parallel twin, under the same module names.
struct DenseBlockImpl : torch::nn::Module {
  DenseBlockImpl()
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})))),
        fc1(register_module("fc1", torch::nn::Linear(kWidth, kHidden))),
        fc2(register_module("fc2", torch::nn::Linear(kHidden, kWidth))) {}
  at::Tensor forward(const at::Tensor& x) { return x + fc2(at::gelu(fc1(ln(x)))); }
  torch::nn::LayerNorm ln;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(DenseBlock);

// sequence_parallel: x is this rank's chunk [s/T, b, C]; else the full [s, b, C] (plain tensor
// parallelism, the LayerNorm and residual computed redundantly on every rank).
struct TpBlockImpl : torch::nn::Module {
  TpBlockImpl(const std::shared_ptr<Communicator>& comm, bool sequence_parallel)
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})))),
        fc1(register_module("fc1", ColumnParallelLinear(ColumnParallelLinearOptions(kWidth, kHidden)
                                                            .gather_output(false)
                                                            .sequence_parallel(sequence_parallel),
                                                        comm))),
        fc2(register_module("fc2", RowParallelLinear(RowParallelLinearOptions(kHidden, kWidth)
                                                         .input_is_parallel(true)
                                                         .sequence_parallel(sequence_parallel),
                                                     comm))) {}
  at::Tensor forward(const at::Tensor& x) { return x + fc2(at::gelu(fc1(ln(x)))); }
  // The replicated parameters applied to the sequence chunk.
  std::vector<at::Tensor> sequence_parallel_params() { return {ln->weight, ln->bias, fc2->bias}; }
  torch::nn::LayerNorm ln;
  ColumnParallelLinear fc1;
  RowParallelLinear fc2;
};
TORCH_MODULE(TpBlock);

// Fixed weights, LayerNorm's included (not its ones / zeros, so its gradients are not special);
// constructed in the main thread (Linear's own initialization draws from the global RNG, and is
// overwritten here).
DenseBlock MakeDense(uint64_t seed) {
  DenseBlock dense;
  SetParam(dense->ln->weight, 1 + 0.1 * Data({kWidth}, seed));
  SetParam(dense->ln->bias, 0.1 * Data({kWidth}, seed + 1));
  SetParam(dense->fc1->weight, 0.3 * Data({kHidden, kWidth}, seed + 2));
  SetParam(dense->fc1->bias, 0.1 * Data({kHidden}, seed + 3));
  SetParam(dense->fc2->weight, 0.3 * Data({kWidth, kHidden}, seed + 4));
  SetParam(dense->fc2->bias, 0.1 * Data({kWidth}, seed + 5));
  return dense;
}

TensorDict DenseState(const DenseBlock& dense) {
  TensorDict d;
  for (const auto& p : dense->named_parameters()) d.insert(p.key(), p.value().detach().clone());
  return d;
}

TEST(SequenceParallel, MlpBlockEqualsDense) {
  DenseBlock dense = MakeDense(101);
  const TensorDict state = DenseState(dense);
  const at::Tensor x = Data({kSeq, kBatch, kWidth}, 110), l = Data({kSeq, kBatch, kWidth}, 111);
  const at::Tensor dx = x.clone().requires_grad_(true);
  const at::Tensor y = dense(dx);
  (y * l).sum().backward();
  auto grad = [&](const char* key) { return dense->named_parameters()[key].grad(); };
  MaxError max_error;
  double min_partial_diff = 1e9;  // the smallest gap to the dense gradient without the all-reduce
  std::mutex mu;
  for (int world : {1, 2, 4}) {
    const std::string label = absl::StrCat("seq-par block T=", world);
    ExpectAllOk(
        RunInprocRanks(
            world,
            [&](int r, int n, std::shared_ptr<Communicator> comm) {
              return CatchErrors([&]() -> absl::Status {
                TpBlock tp(comm, /*sequence_parallel=*/true);
                load_full_state_dict(*tp, state);
                const at::Tensor xr = Slice(x, 0, r, n).clone().requires_grad_(true);
                const at::Tensor out = tp(xr);
                (out * Slice(l, 0, r, n)).sum().backward();
                FS_RETURN_IF_ERROR(
                    Near(out, Slice(y, 0, r, n), label + " output chunk", &max_error));
                FS_RETURN_IF_ERROR(
                    Near(xr.grad(), Slice(dx.grad(), 0, r, n), label + " dX chunk", &max_error));
                FS_RETURN_IF_ERROR(Near(tp->fc1->weight.grad(), Slice(grad("fc1.weight"), 0, r, n),
                                        label + " dW1", &max_error));
                FS_RETURN_IF_ERROR(Near(tp->fc1->bias.grad(), Slice(grad("fc1.bias"), 0, r, n),
                                        label + " db1", &max_error));
                FS_RETURN_IF_ERROR(Near(tp->fc2->weight.grad(), Slice(grad("fc2.weight"), 1, r, n),
                                        label + " dW2", &max_error));
                // The replicated parameters: this rank's tokens only, until the all-reduce.
                const std::vector<std::string> keys = {"ln.weight", "ln.bias", "fc2.bias"};
                const std::vector<at::Tensor> params = tp->sequence_parallel_params();
                if (n > 1) {
                  for (size_t i = 0; i < keys.size(); ++i) {
                    const double d = fairscale::testing::MaxAbsDiff(params[i].grad(), grad(keys[i].c_str()));
                    {
                      std::lock_guard<std::mutex> lock(mu);
                      min_partial_diff = std::min(min_partial_diff, d);
                    }
                    FS_RETURN_IF_ERROR(Check(
                        d > 1e-3, absl::StrCat(label, " ", keys[i],
                                               ": the partial gradient already equals the dense "
                                               "one (max diff ",
                                               d, ")")));
                  }
                }
                all_reduce_sequence_parallel_grads(params, *comm);
                for (size_t i = 0; i < keys.size(); ++i) {
                  FS_RETURN_IF_ERROR(Near(params[i].grad(), grad(keys[i].c_str()),
                                          label + " d" + keys[i] + " after the all-reduce",
                                          &max_error));
                }
                // The full state dict is still the dense one.
                for (const auto& item : full_state_dict(*tp)) {
                  FS_RETURN_IF_ERROR(
                      Near(item.value(), state[item.key()], label + " full " + item.key()));
                }
                return absl::OkStatus();
              });
            }),
        label);
  }
  std::cout << "max |seq-par - dense| = " << max_error.value
            << "; smallest gap of a replicated gradient without the all-reduce = "
            << min_partial_diff << "\n";
}

TEST(SequenceParallel, AdamStepsEqualDense) {
  constexpr int kSteps = 5;
  DenseBlock dense = MakeDense(201);
  const TensorDict initial = DenseState(dense);
  std::vector<at::Tensor> xs, targets;
  for (int s = 0; s < kSteps; ++s) {
    xs.push_back(Data({kSeq, kBatch, kWidth}, 210 + s));
    targets.push_back(Data({kSeq, kBatch, kWidth}, 220 + s));
  }
  const double tokens = static_cast<double>(kSeq * kBatch * kWidth);
  torch::optim::Adam dense_opt(dense->parameters(), torch::optim::AdamOptions(1e-2));
  for (int s = 0; s < kSteps; ++s) {
    dense_opt.zero_grad();
    (dense(xs[s]) - targets[s]).pow(2).mean().backward();
    dense_opt.step();
  }
  const TensorDict final_state = DenseState(dense);
  MaxError max_error;
  for (int world : {1, 2, 4}) {
    const std::string label = absl::StrCat("seq-par adam T=", world);
    ExpectAllOk(
        RunInprocRanks(
            world,
            [&](int r, int n, std::shared_ptr<Communicator> comm) {
              return CatchErrors([&]() -> absl::Status {
                TpBlock tp(comm, /*sequence_parallel=*/true);
                load_full_state_dict(*tp, initial);
                torch::optim::Adam opt(tp->parameters(), torch::optim::AdamOptions(1e-2));
                for (int s = 0; s < kSteps; ++s) {
                  opt.zero_grad();
                  // This rank's share of the dense mean: its chunk's squared errors over all
                  // the tokens (the ranks' losses sum to the dense loss).
                  const at::Tensor out = tp(Slice(xs[s], 0, r, n));
                  ((out - Slice(targets[s], 0, r, n)).pow(2).sum() / tokens).backward();
                  all_reduce_sequence_parallel_grads(tp->sequence_parallel_params(), *comm);
                  opt.step();
                }
                FS_RETURN_IF_ERROR(Near(tp->fc1->weight, Slice(final_state["fc1.weight"], 0, r, n),
                                        label + " W1", &max_error));
                FS_RETURN_IF_ERROR(Near(tp->fc1->bias, Slice(final_state["fc1.bias"], 0, r, n),
                                        label + " b1", &max_error));
                FS_RETURN_IF_ERROR(Near(tp->fc2->weight, Slice(final_state["fc2.weight"], 1, r, n),
                                        label + " W2", &max_error));
                for (const char* key : {"fc2.bias", "ln.weight", "ln.bias"}) {
                  FS_RETURN_IF_ERROR(Near(tp->named_parameters()[key], final_state[key],
                                          label + " " + key, &max_error));
                }
                return absl::OkStatus();
              });
            }),
        label);
  }
  std::cout << "max |seq-par - dense| after " << kSteps << " Adam steps = " << max_error.value
            << "\n";
}

// Sequence parallelism replaces each all-reduce of a [s, b, C] activation (forward: the row
// layer's output; backward: the column layer's input gradient) by a reduce-scatter and an
// all-gather of the same full tensor: the same bytes on the wire (a ring all-reduce is a
// reduce-scatter followed by an all-gather). The counting communicator counts the full tensor
// for each of the three ops (the all-reduce's send, the reduce-scatter's send, the all-gather's
// receive buffer), so the all-gather bytes and the reduce-scatter bytes each equal the
// all-reduce bytes. The replicated gradients' all-reduce adds 3 * C floats.
TEST(SequenceParallel, SameBytesAsTensorParallel) {
  DenseBlock dense = MakeDense(301);
  const TensorDict state = DenseState(dense);
  const at::Tensor x = Data({kSeq, kBatch, kWidth}, 310);
  const int64_t activation_bytes = kSeq * kBatch * kWidth * 4;
  for (int world : {2, 4}) {
    const std::string label = absl::StrCat("bytes T=", world);
    ExpectAllOk(
        RunInprocRanks(
            world,
            [&](int r, int n, std::shared_ptr<Communicator> inner) {
              return CatchErrors([&]() -> absl::Status {
                using comm::OpType;
                auto counting = std::make_shared<comm::testing::CountingCommunicator>(inner);
                TpBlock plain(counting, /*sequence_parallel=*/false);
                load_full_state_dict(*plain, state);
                plain(x).sum().backward();
                const auto ar = counting->count(OpType::kAllReduce);
                FS_RETURN_IF_ERROR(Check(ar.ops == 2 && ar.bytes == 2 * activation_bytes &&
                                             counting->count(OpType::kAllGather).ops == 0 &&
                                             counting->count(OpType::kReduceScatter).ops == 0,
                                         absl::StrCat(label, " plain TP: ", ar.ops,
                                                      " all-reduces, ", ar.bytes, " bytes")));
                counting->Reset();
                TpBlock seq(counting, /*sequence_parallel=*/true);
                load_full_state_dict(*seq, state);
                seq(Slice(x, 0, r, n)).sum().backward();
                const auto ag = counting->count(OpType::kAllGather);
                const auto rs = counting->count(OpType::kReduceScatter);
                FS_RETURN_IF_ERROR(
                    Check(ag.ops == 2 && rs.ops == 2 && ag.bytes == ar.bytes &&
                              rs.bytes == ar.bytes && counting->count(OpType::kAllReduce).ops == 0,
                          absl::StrCat(label, " seq-par: ", ag.ops, " all-gathers (", ag.bytes,
                                       " bytes), ", rs.ops, " reduce-scatters (", rs.bytes,
                                       " bytes); plain all-reduce bytes ", ar.bytes)));
                all_reduce_sequence_parallel_grads(seq->sequence_parallel_params(), *counting);
                const auto grads = counting->count(OpType::kAllReduce);
                return Check(grads.ops == 1 && grads.bytes == 3 * kWidth * 4,
                             absl::StrCat(label, " replicated gradients: ", grads.ops, " ops, ",
                                          grads.bytes, " bytes"));
              });
            }),
        label);
  }
}

TEST(SequenceParallel, BadInputIsAClearError) {
  ExpectAllOk(
      RunInprocRanks(
          4,
          [](int, int, std::shared_ptr<Communicator> comm) {
            FS_RETURN_IF_ERROR(ExpectError(
                [&] {
                  ColumnParallelLinear(ColumnParallelLinearOptions(8, 16).sequence_parallel(true),
                                       comm);
                },
                {"model_parallel::ColumnParallelLinear rank", "INVALID_ARGUMENT",
                 "sequence_parallel(true) is incompatible with gather_output(true)"}));
            FS_RETURN_IF_ERROR(ExpectError(
                [&] {
                  RowParallelLinear(RowParallelLinearOptions(16, 8).sequence_parallel(true), comm);
                },
                {"model_parallel::RowParallelLinear rank", "INVALID_ARGUMENT",
                 "sequence_parallel(true) requires input_is_parallel(true)"}));
            // A sequence of 10 at T = 4: splitting it ...
            FS_RETURN_IF_ERROR(ExpectError(
                [&] {
                  autograd_comm::scatter_to_sequence_parallel_region(at::zeros({10, 2, 8}), *comm);
                },
                {"scatter_to_sequence_parallel_region", "dimension 0 has size 10",
                 "not divisible by the world size 4"}));
            // ... or a row layer's input of that length.
            RowParallelLinear row(
                RowParallelLinearOptions(16, 8).input_is_parallel(true).sequence_parallel(true),
                comm);
            FS_RETURN_IF_ERROR(ExpectError(
                [&] {
                  row(at::zeros({10, 2, 4}));
                },
                {"model_parallel::RowParallelLinear::forward rank",
                 "sequence length (dim 0 of the input [10, 2, 4]) = 10",
                 "not divisible by the tensor-parallel size 4"}));
            // The group still works: a correct forward afterwards.
            return Check(row(at::zeros({8, 2, 4})).sizes() == at::IntArrayRef({2, 2, 8}),
                         "row output after the errors");
          }),
      "bad input");
}

}  // namespace
}  // namespace fairscale::model_parallel
