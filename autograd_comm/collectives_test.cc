// Every function of autograd_comm/collectives.h at world sizes 1-4 (ranks as threads over the
// inproc backend), against the single-process equivalent computed here from every rank's data:
// forward results and input gradients (f64 within 1e-12; f32, bf16 and f16 on small-integer data,
// where every sum is exact, bitwise), contiguous and non-contiguous inputs, positive and negative dims;
// central finite differences in f64; a tensor-parallel two-layer MLP (plain, gathered / scattered,
// sequence-parallel) against the dense one; bad shapes and a rank whose shape differs.
#include "autograd_comm/collectives.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "base/status_macros.h"
#include "comm/communicator.h"
#include "comm/testing/counting_communicator.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "testing/c10_error.h"
#include "testing/near.h"

namespace fairscale::autograd_comm {
namespace {

using comm::Communicator;
using comm::testing::Check;
using comm::testing::ExpectAllOk;
using comm::testing::RunInprocRanks;

using Fn = std::function<at::Tensor(const at::Tensor&, Communicator&)>;

// Fixed data from a private generator (thread ranks share torch's global one). f64: normal
// values; other dtypes: integers in [-8, 8], so that every sum here is exact in any order.
at::Tensor Data(at::IntArrayRef shape, uint64_t seed, at::ScalarType dtype,
                bool contiguous = true) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor t = dtype == at::kDouble
                     ? at::randn(shape, gen, at::TensorOptions().dtype(at::kDouble))
                     : at::randint(-8, 9, shape, gen, at::TensorOptions().dtype(at::kDouble))
                           .to(dtype);
  // The same values with other strides.
  if (!contiguous) t = t.transpose(0, -1).contiguous().transpose(0, -1);
  return t;
}

at::Tensor Sum(const std::vector<at::Tensor>& ts) {
  at::Tensor s = ts[0].clone();
  for (size_t i = 1; i < ts.size(); ++i) s += ts[i];
  return s;
}

// Near, and the same dtype.
absl::Status Near(const at::Tensor& got, const at::Tensor& want, double tol,
                  const std::string& what) {
  if (got.defined() && want.defined() && got.scalar_type() != want.scalar_type()) {
    return absl::InternalError(absl::StrCat(what, ": got ", c10::toString(got.scalar_type()),
                                            ", want ", c10::toString(want.scalar_type())));
  }
  return fairscale::testing::Near(got, want, tol, what);
}

// One function at one configuration on this rank: `x` its input, `w` the weights of the loss
// sum(w * out), and the single-process answers.
struct Setup {
  at::Tensor x;
  at::Tensor w;
  at::Tensor want_out;
  at::Tensor want_grad;
};

absl::Status CheckFunction(const std::string& what, Communicator& comm, const Fn& fn,
                           const Setup& s, double tol) {
  at::Tensor x = s.x.detach().requires_grad_(true);  // keeps the strides
  at::Tensor out = fn(x, comm);
  FS_RETURN_IF_ERROR(Near(out, s.want_out, tol, what + " forward"));
  at::Tensor grad = torch::autograd::grad({(out * s.w).sum()}, {x})[0];
  return Near(grad, s.want_grad, tol, what + " grad");
}

// The loss summed over the ranks.
double AllReduceSum(double value, Communicator& comm) {
  double sum = 0;
  absl::Status status = comm.AllReduce(comm::MakeConstBuffer(&value, 1),
                                       comm::MakeBuffer(&sum, 1), comm::ReduceOp::kSum)
                            .Wait();
  TORCH_CHECK(status.ok(), status.ToString());
  return sum;
}

// The gradient of L = sum over ranks of L_r = sum(w_r * out_r^2) against central differences
// (f64). `replicated`: x is one tensor held by every rank (perturbed on all at once); else each
// rank's x is its own input (perturbed on one rank at a time). `one_copy`: the output is
// replicated and so is w (reduce_from, gather_from): every rank computes the same loss, of which
// L is one copy (the mean), as in a tensor-parallel model.
absl::Status CheckFiniteDifferences(const std::string& what, Communicator& comm, const Fn& fn,
                                    const at::Tensor& x0, const at::Tensor& w, bool replicated,
                                    bool one_copy = false) {
  const at::Tensor x = x0.contiguous();
  at::Tensor xg = x.detach().clone().requires_grad_(true);
  at::Tensor out = fn(xg, comm);
  const at::Tensor grad =
      torch::autograd::grad({(w * out * out).sum()}, {xg})[0].contiguous();
  auto loss = [&](const at::Tensor& xp) {
    at::NoGradGuard no_grad;
    const at::Tensor y = fn(xp, comm);
    return AllReduceSum((w * y * y).sum().item<double>(), comm) / (one_copy ? comm.size() : 1);
  };
  const double h = 1e-4;
  const int owners = replicated ? 1 : comm.size();
  for (int p = 0; p < owners; ++p) {
    const bool mine = replicated || p == comm.rank();
    for (int64_t e = 0; e < x.numel(); ++e) {
      at::Tensor plus = x.clone(), minus = x.clone();
      if (mine) {
        plus.data_ptr<double>()[e] += h;
        minus.data_ptr<double>()[e] -= h;
      }
      const double fd = (loss(plus) - loss(minus)) / (2 * h);
      if (!mine) continue;
      const double g = grad.data_ptr<double>()[e];
      FS_RETURN_IF_ERROR(Check(std::abs(g - fd) <= 1e-6,
                               absl::StrCat(what, " element ", e, ": autograd ", g,
                                            ", finite differences ", fd)));
    }
  }
  return absl::OkStatus();
}

const std::vector<int> kWorlds = {1, 2, 3, 4};
const std::vector<at::ScalarType> kDtypes = {at::kDouble, at::kFloat, at::kBFloat16,
                                               at::kHalf};
const std::vector<int64_t> kDims = {0, 1, 2, -1, -2, -3};
const std::vector<int64_t> kChunk = {2, 3, 2};  // the per-rank shape along a split dimension

std::vector<int64_t> Full(int64_t dim, int n) {
  std::vector<int64_t> s = kChunk;
  s[dim < 0 ? dim + 3 : dim] *= n;
  return s;
}

double Tol(at::ScalarType dtype) { return dtype == at::kDouble ? 1e-12 : 0.0; }

// Data of every rank: seed + i.
std::vector<at::Tensor> PerRank(at::IntArrayRef shape, uint64_t seed, at::ScalarType dtype,
                                int n) {
  std::vector<at::Tensor> ts;
  for (int i = 0; i < n; ++i) ts.push_back(Data(shape, seed + i, dtype));
  return ts;
}

// Runs `body(rank, n, comm, dtype, contiguous, label)` for every world, dtype and contiguity.
void ForAllConfigs(
    absl::string_view name,
    const std::function<absl::Status(int r, int n, Communicator& comm, at::ScalarType dtype,
                                     bool contiguous, const std::string& label)>& body) {
  for (int world : kWorlds) {
    ExpectAllOk(RunInprocRanks(world,
                               [&](int rank, int n, std::shared_ptr<Communicator> comm) {
                                 for (at::ScalarType dtype : kDtypes) {
                                   for (bool contiguous : {true, false}) {
                                     const std::string label = absl::StrCat(
                                         name, " world ", n, " ", c10::toString(dtype),
                                         contiguous ? " contiguous" : " non-contiguous");
                                     FS_RETURN_IF_ERROR(
                                         body(rank, n, *comm, dtype, contiguous, label));
                                   }
                                 }
                                 return absl::OkStatus();
                               }),
                std::string(name));
  }
}

TEST(AutogradComm, CopyToParallelRegion) {
  ForAllConfigs("copy_to", [](int r, int n, Communicator& comm, at::ScalarType dtype, bool contig,
                              const std::string& label) {
    const at::Tensor x = Data(kChunk, 3000, dtype, contig);
    const std::vector<at::Tensor> w = PerRank(kChunk, 2000, dtype, n);
    return CheckFunction(label, comm, copy_to_parallel_region, {x, w[r], x, Sum(w)}, Tol(dtype));
  });
}

TEST(AutogradComm, ReduceFromParallelRegion) {
  ForAllConfigs("reduce_from", [](int r, int n, Communicator& comm, at::ScalarType dtype,
                                  bool contig, const std::string& label) {
    const std::vector<at::Tensor> x = PerRank(kChunk, 1000, dtype, n);
    const at::Tensor w = Data(kChunk, 3000, dtype);
    return CheckFunction(label, comm, reduce_from_parallel_region,
                         {Data(kChunk, 1000 + r, dtype, contig), w, Sum(x), w}, Tol(dtype));
  });
}

TEST(AutogradComm, ScatterToParallelRegion) {
  ForAllConfigs("scatter_to", [](int r, int n, Communicator& comm, at::ScalarType dtype,
                                 bool contig, const std::string& label) {
    for (int64_t dim : kDims) {
      const int64_t c = kChunk[dim < 0 ? dim + 3 : dim];
      const at::Tensor x = Data(Full(dim, n), 3000, dtype, contig);
      const std::vector<at::Tensor> w = PerRank(kChunk, 2000, dtype, n);
      FS_RETURN_IF_ERROR(CheckFunction(
          absl::StrCat(label, " dim ", dim), comm,
          [dim](const at::Tensor& t, Communicator& cm) {
            return scatter_to_parallel_region(t, cm, dim);
          },
          {x, w[r], x.narrow(dim, r * c, c), at::cat(w, dim)}, Tol(dtype)));
    }
    return absl::OkStatus();
  });
}

TEST(AutogradComm, GatherFromParallelRegion) {
  ForAllConfigs("gather_from", [](int r, int n, Communicator& comm, at::ScalarType dtype,
                                  bool contig, const std::string& label) {
    for (int64_t dim : kDims) {
      const int64_t c = kChunk[dim < 0 ? dim + 3 : dim];
      const std::vector<at::Tensor> x = PerRank(kChunk, 1000, dtype, n);
      const at::Tensor w = Data(Full(dim, n), 3000, dtype);
      FS_RETURN_IF_ERROR(CheckFunction(
          absl::StrCat(label, " dim ", dim), comm,
          [dim](const at::Tensor& t, Communicator& cm) {
            return gather_from_parallel_region(t, cm, dim);
          },
          {Data(kChunk, 1000 + r, dtype, contig), w, at::cat(x, dim), w.narrow(dim, r * c, c)},
          Tol(dtype)));
    }
    // The default dimension is the last one (FairScale's).
    const at::Tensor x = Data(kChunk, 1000 + r, dtype);
    return Near(gather_from_parallel_region(x, comm),
                at::cat(PerRank(kChunk, 1000, dtype, n), -1), 0, label + " default dim");
  });
}

TEST(AutogradComm, ScatterToSequenceParallelRegion) {
  ForAllConfigs("scatter_to_sequence", [](int r, int n, Communicator& comm, at::ScalarType dtype,
                                          bool contig, const std::string& label) {
    const at::Tensor x = Data(Full(0, n), 3000, dtype, contig);
    const std::vector<at::Tensor> w = PerRank(kChunk, 2000, dtype, n);
    return CheckFunction(label, comm, scatter_to_sequence_parallel_region,
                         {x, w[r], x.narrow(0, r * kChunk[0], kChunk[0]), at::cat(w, 0)},
                         Tol(dtype));
  });
}

TEST(AutogradComm, GatherFromSequenceParallelRegion) {
  ForAllConfigs("gather_from_sequence", [](int r, int n, Communicator& comm, at::ScalarType dtype,
                                           bool contig, const std::string& label) {
    const int64_t c = kChunk[0];
    const std::vector<at::Tensor> x = PerRank(kChunk, 1000, dtype, n);
    const std::vector<at::Tensor> w = PerRank(Full(0, n), 2000, dtype, n);
    const at::Tensor mine = Data(kChunk, 1000 + r, dtype, contig);
    // Tensor-parallel consumer: each rank's gradient of the full sequence is a partial sum.
    FS_RETURN_IF_ERROR(CheckFunction(label + " reduce-scatter grad", comm,
                                     [](const at::Tensor& t, Communicator& cm) {
                                       return gather_from_sequence_parallel_region(t, cm);
                                     },
                                     {mine, w[r], at::cat(x, 0), Sum(w).narrow(0, r * c, c)},
                                     Tol(dtype)));
    return CheckFunction(label + " split grad", comm,
                         [](const at::Tensor& t, Communicator& cm) {
                           return gather_from_sequence_parallel_region(t, cm, false);
                         },
                         {mine, w[r], at::cat(x, 0), w[r].narrow(0, r * c, c)}, Tol(dtype));
  });
}

TEST(AutogradComm, ReduceScatterToSequenceParallelRegion) {
  ForAllConfigs("reduce_scatter_to_sequence", [](int r, int n, Communicator& comm,
                                                 at::ScalarType dtype, bool contig,
                                                 const std::string& label) {
    const int64_t c = kChunk[0];
    const std::vector<at::Tensor> x = PerRank(Full(0, n), 1000, dtype, n);
    const std::vector<at::Tensor> w = PerRank(kChunk, 2000, dtype, n);
    return CheckFunction(
        label, comm, reduce_scatter_to_sequence_parallel_region,
        {Data(Full(0, n), 1000 + r, dtype, contig), w[r], Sum(x).narrow(0, r * c, c),
         at::cat(w, 0)},
        Tol(dtype));
  });
}

TEST(AutogradComm, AllToAll) {
  ForAllConfigs("all_to_all", [](int r, int n, Communicator& comm, at::ScalarType dtype,
                                 bool contig, const std::string& label) {
    const int64_t c = kChunk[0];
    const std::vector<at::Tensor> x = PerRank(Full(0, n), 1000, dtype, n);
    const std::vector<at::Tensor> w = PerRank(Full(0, n), 2000, dtype, n);
    std::vector<at::Tensor> want_out, want_grad;
    for (int i = 0; i < n; ++i) {
      want_out.push_back(x[i].narrow(0, r * c, c));   // block r of rank i
      want_grad.push_back(w[i].narrow(0, r * c, c));  // sent back to where it came from
    }
    return CheckFunction(label, comm, all_to_all,
                         {Data(Full(0, n), 1000 + r, dtype, contig), w[r], at::cat(want_out, 0),
                          at::cat(want_grad, 0)},
                         Tol(dtype));
  });
}

TEST(AutogradComm, FiniteDifferences) {
  const std::vector<int64_t> chunk = {2, 3};
  for (int world : kWorlds) {
    ExpectAllOk(
        RunInprocRanks(
            world,
            [&](int r, int n, std::shared_ptr<Communicator> comm) -> absl::Status {
              const at::ScalarType f64 = at::kDouble;
              const std::vector<int64_t> rows = {2 * n, 3}, cols = {2, 3 * n};
              const std::string label = absl::StrCat("world ", n, " ");
              const uint64_t seed = 100 + r;
              FS_RETURN_IF_ERROR(CheckFiniteDifferences(
                  label + "copy_to", *comm, copy_to_parallel_region, Data(chunk, 7, f64),
                  Data(chunk, seed, f64), /*replicated=*/true));
              FS_RETURN_IF_ERROR(CheckFiniteDifferences(
                  label + "reduce_from", *comm, reduce_from_parallel_region,
                  Data(chunk, seed, f64), Data(chunk, 7, f64), false, /*one_copy=*/true));
              FS_RETURN_IF_ERROR(CheckFiniteDifferences(
                  label + "scatter_to", *comm,
                  [](const at::Tensor& t, Communicator& cm) {
                    return scatter_to_parallel_region(t, cm);
                  },
                  Data(cols, 7, f64), Data(chunk, seed, f64), true));
              FS_RETURN_IF_ERROR(CheckFiniteDifferences(
                  label + "gather_from", *comm,
                  [](const at::Tensor& t, Communicator& cm) {
                    return gather_from_parallel_region(t, cm, -2);
                  },
                  Data(chunk, seed, f64), Data(rows, 7, f64), false, /*one_copy=*/true));
              FS_RETURN_IF_ERROR(CheckFiniteDifferences(
                  label + "scatter_to_sequence", *comm, scatter_to_sequence_parallel_region,
                  Data(rows, 7, f64), Data(chunk, seed, f64), true));
              FS_RETURN_IF_ERROR(CheckFiniteDifferences(
                  label + "gather_from_sequence", *comm,
                  [](const at::Tensor& t, Communicator& cm) {
                    return gather_from_sequence_parallel_region(t, cm);
                  },
                  Data(chunk, seed, f64), Data(rows, 200 + r, f64), false));
              FS_RETURN_IF_ERROR(CheckFiniteDifferences(
                  label + "reduce_scatter_to_sequence", *comm,
                  reduce_scatter_to_sequence_parallel_region, Data(rows, seed, f64),
                  Data(chunk, 200 + r, f64), false));
              return CheckFiniteDifferences(label + "all_to_all", *comm, all_to_all,
                                            Data(rows, seed, f64), Data(rows, 200 + r, f64),
                                            false);
            }),
        absl::StrCat("finite differences world ", world));
  }
}

// A two-layer MLP, Y = relu(X W1^T) W2^T, with W1's rows (column-parallel Linear) and W2's
// columns (row-parallel Linear) split over the ranks, against the dense one: forward, weight and
// input gradients of sum(L * Y).
enum class Mlp { kTensorParallel, kGatherScatter, kSequenceParallel };

absl::Status CheckMlp(Mlp mode, int r, int n, Communicator& comm) {
  const int64_t batch = 8, d = 6, h = 8;
  // Normal values (Data's f64), in f32: the sums are rounded, in a different order per world.
  auto normal = [](at::IntArrayRef shape, uint64_t seed, double scale) {
    return (Data(shape, seed, at::kDouble) * scale).to(at::kFloat);
  };
  const at::Tensor x = normal({batch, d}, 1, 1.0), w1 = normal({h, d}, 2, 1 / std::sqrt(d)),
                   w2 = normal({d, h}, 3, 1 / std::sqrt(h)), l = normal({batch, d}, 4, 1.0);
  // Single process.
  at::Tensor dx = x.detach().clone().requires_grad_(true);
  at::Tensor dw1 = w1.detach().clone().requires_grad_(true);
  at::Tensor dw2 = w2.detach().clone().requires_grad_(true);
  const at::Tensor y = at::matmul(at::relu(at::matmul(dx, dw1.t())), dw2.t());
  (y * l).sum().backward();

  const int64_t hs = h / n, bs = batch / n;
  at::Tensor w1_r = w1.narrow(0, r * hs, hs).clone().requires_grad_(true);
  at::Tensor w2_r = w2.narrow(1, r * hs, hs).clone().requires_grad_(true);
  const std::string label = absl::StrCat(
      mode == Mlp::kTensorParallel   ? "tensor-parallel"
      : mode == Mlp::kGatherScatter ? "gather_output + scatter input"
                                    : "sequence-parallel",
      " MLP world ", n);
  at::Tensor x_r, want_y = y.detach(), want_dx = dx.grad(), loss_w = l;
  if (mode == Mlp::kSequenceParallel) {
    x_r = x.narrow(0, r * bs, bs).clone().requires_grad_(true);
    want_y = want_y.narrow(0, r * bs, bs);
    want_dx = want_dx.narrow(0, r * bs, bs);
    loss_w = l.narrow(0, r * bs, bs);
  } else {
    x_r = x.clone().requires_grad_(true);
  }

  at::Tensor out;
  switch (mode) {
    case Mlp::kTensorParallel: {
      const at::Tensor hid = at::relu(at::matmul(copy_to_parallel_region(x_r, comm), w1_r.t()));
      out = reduce_from_parallel_region(at::matmul(hid, w2_r.t()), comm);
      break;
    }
    case Mlp::kGatherScatter: {
      const at::Tensor hid = gather_from_parallel_region(
          at::relu(at::matmul(copy_to_parallel_region(x_r, comm), w1_r.t())), comm);
      out = reduce_from_parallel_region(
          at::matmul(scatter_to_parallel_region(hid, comm), w2_r.t()), comm);
      break;
    }
    case Mlp::kSequenceParallel: {
      const at::Tensor hid =
          at::relu(at::matmul(gather_from_sequence_parallel_region(x_r, comm), w1_r.t()));
      out = reduce_scatter_to_sequence_parallel_region(at::matmul(hid, w2_r.t()), comm);
      break;
    }
  }
  (out * loss_w).sum().backward();
  const double tol = 1e-5;
  FS_RETURN_IF_ERROR(Near(out, want_y, tol, label + " output"));
  FS_RETURN_IF_ERROR(Near(w1_r.grad(), dw1.grad().narrow(0, r * hs, hs), tol, label + " dW1"));
  FS_RETURN_IF_ERROR(Near(w2_r.grad(), dw2.grad().narrow(1, r * hs, hs), tol, label + " dW2"));
  return Near(x_r.grad(), want_dx, tol, label + " dX");
}

TEST(AutogradComm, TensorParallelMlpEqualsDense) {
  for (int world : {2, 4}) {
    for (Mlp mode : {Mlp::kTensorParallel, Mlp::kGatherScatter, Mlp::kSequenceParallel}) {
      ExpectAllOk(RunInprocRanks(world,
                                 [&](int r, int n, std::shared_ptr<Communicator> comm) {
                                   return CheckMlp(mode, r, n, *comm);
                                 }),
                  absl::StrCat("mlp world ", world));
    }
  }
}

TEST(AutogradComm, WorldOneIssuesNothing) {
  ExpectAllOk(RunInprocRanks(1, [](int, int, std::shared_ptr<Communicator> inner) {
    comm::testing::CountingCommunicator comm(inner);
    const at::Tensor x = Data({4, 2}, 1, at::kFloat).requires_grad_(true);
    std::vector<at::Tensor> outs = {
        copy_to_parallel_region(x, comm),
        reduce_from_parallel_region(x, comm),
        scatter_to_parallel_region(x, comm, 0),
        gather_from_parallel_region(x, comm),
        scatter_to_sequence_parallel_region(x, comm),
        gather_from_sequence_parallel_region(x, comm),
        reduce_scatter_to_sequence_parallel_region(x, comm),
        all_to_all(x, comm)};
    at::Tensor loss = at::zeros({}, at::kFloat);
    for (const at::Tensor& o : outs) {
      FS_RETURN_IF_ERROR(Near(o, x.detach(), 0, "world 1 forward"));
      loss = loss + o.sum();
    }
    loss.backward();
    FS_RETURN_IF_ERROR(Near(x.grad(), at::full({4, 2}, 8.0f), 0, "world 1 grad"));
    for (comm::OpType type : {comm::OpType::kAllReduce, comm::OpType::kAllGather,
                              comm::OpType::kReduceScatter, comm::OpType::kAllToAll}) {
      FS_RETURN_IF_ERROR(Check(comm.count(type).ops == 0,
                               absl::StrCat(comm::OpTypeName(type), " issued at world 1")));
    }
    return absl::OkStatus();
  }), "world 1");
}

TEST(AutogradComm, IndivisibleDimensionIsAClearError) {
  ExpectAllOk(RunInprocRanks(2, [](int r, int, std::shared_ptr<Communicator> comm) {
    const at::Tensor x = Data({3, 5}, 1, at::kFloat);
    FS_RETURN_IF_ERROR(fairscale::testing::ExpectError(
        [&] { (void)scatter_to_parallel_region(x, *comm); },
        {"autograd_comm::scatter_to_parallel_region rank", "x [3, 5]", "INVALID_ARGUMENT",
         "dimension 1 has size 5", "world size 2"}));
    FS_RETURN_IF_ERROR(fairscale::testing::ExpectError(
        [&] { (void)scatter_to_sequence_parallel_region(x, *comm); },
        {"scatter_to_sequence_parallel_region", "dimension 0 has size 3", "world size 2"}));
    FS_RETURN_IF_ERROR(fairscale::testing::ExpectError(
        [&] { (void)reduce_scatter_to_sequence_parallel_region(x, *comm); },
        {"reduce_scatter_to_sequence_parallel_region", "dimension 0 has size 3",
         "world size 2"}));
    FS_RETURN_IF_ERROR(fairscale::testing::ExpectError(
        [&] { (void)all_to_all(x, *comm); },
        {"all_to_all", "dimension 0 has size 3", "world size 2"}));
    FS_RETURN_IF_ERROR(fairscale::testing::ExpectError(
        [&] { (void)gather_from_parallel_region(x, *comm, 2); },
        {"gather_from_parallel_region", "dimension 2 is out of range", "2 dimensions"}));
    // Nothing was sent: the communicator still works.
    const at::Tensor y = Data({4, 2}, 1, at::kFloat);
    return Near(scatter_to_parallel_region(y, *comm, -2), y.narrow(0, 2 * r, 2), 0,
                "after the errors");
  }), "indivisible");
}

// A rank whose shape differs from its peers' gets the communicator's mismatch error (here: the
// all-gather's counts differ), on every rank, and nobody hangs.
TEST(AutogradComm, ShapeMismatchIsAnErrorNotAHang) {
  std::vector<absl::Status> statuses = RunInprocRanks(
      2,
      [](int r, int, std::shared_ptr<Communicator> comm) -> absl::Status {
        const at::Tensor x = Data({2, r == 0 ? 3 : 4}, 1, at::kFloat);
        const std::string error =
            fairscale::testing::ErrorOf([&] { (void)gather_from_parallel_region(x, *comm); });
        // Reported through the status (the barrier after the body fails on a broken comm).
        return absl::CancelledError(error.empty() ? "no error" : error);
      },
      absl::Seconds(10));
  bool invalid_argument = false;
  for (int r = 0; r < 2; ++r) {
    const std::string message(statuses[r].message());
    EXPECT_EQ(statuses[r].code(), absl::StatusCode::kCancelled) << statuses[r];
    EXPECT_NE(message.find(absl::StrCat("autograd_comm::gather_from_parallel_region rank ", r,
                                        "/2 x [2, ", r == 0 ? 3 : 4, "]")),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("all_gather"), std::string::npos) << message;
    invalid_argument |= message.find("INVALID_ARGUMENT") != std::string::npos;
  }
  EXPECT_TRUE(invalid_argument) << "no rank reported the mismatch as INVALID_ARGUMENT";
}

}  // namespace
}  // namespace fairscale::autograd_comm
