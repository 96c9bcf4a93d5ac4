// The reference side of the SlowMo tests: a small model with two dtype buckets, each worker's
// deterministic batches, and a single-process simulation of N workers written from the paper.
// Shared by slowmo_test (ranks as threads over inproc) and backends_test (ranks as processes over
// tcp and ucx), so both check against the same simulation.
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace fairscale::slowmo::testing {

inline constexpr int kSteps = 7;
inline constexpr double kLr = 0.05;

enum class Opt { kSgd, kAdam };

// A linear model with a f32 weight and a f64 bias: two dtype buckets. Every worker starts from the
// same values (a private generator with a fixed seed).
struct Worker {
  at::Tensor w;                                  // [4, 3] f32
  at::Tensor b;                                  // [3] f64
  std::unique_ptr<torch::optim::Optimizer> opt;  // SGD (momentum 0.9) or Adam, lr kLr

  explicit Worker(Opt kind);
  std::vector<at::Tensor> params() const { return {w, b}; }
};

// Worker `worker`'s gradient at `step` (its own batch, from a private at::Generator seeded by
// (worker, step): thread ranks share torch's global RNG), accumulated into fresh .grad.
void Backward(const Worker& m, int worker, int step);

struct Config {
  int world;
  Opt opt;
  int64_t h;
  double alpha;
  double beta;
  int steps = kSteps;
  std::string Name() const;
};

// The single-process simulation: N workers, f64 averaging and outer step written from the paper.
// Returns each worker's {w, b} after c.steps steps, in f64.
std::vector<std::vector<at::Tensor>> Simulate(const Config& c);

// OK when every got[i] is within `tol` of want[i] (max abs error); else kInternal naming `what`
// and the parameter. Records the largest error seen (thread-safe) for TakeMaxError.
absl::Status Close(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want,
                   double tol, const std::string& what);

// The largest error Close() has seen since the last call (the tests print it; the README quotes
// it), and resets it.
double TakeMaxError();

}  // namespace fairscale::slowmo::testing
