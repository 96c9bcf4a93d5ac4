// Helpers shared by the state-dict and checkpoint tests (testonly): building the test model,
// training steps, comparing losses with the reference run and state dicts with each other; the
// generic checks (Check, ExpectAllOk, ExpectError, TmpPath) under the names these tests use.
#pragma once

#include <ATen/ops/equal.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "comm/testing/rank_runner.h"
#include "fsdp/state_dict.h"
#include "fsdp/test_util.h"
#include "testing/c10_error.h"
#include "testing/tmp.h"

namespace fairscale::fsdp::testing {

using comm::testing::Check;
using comm::testing::ExpectAllOk;
using fairscale::testing::ExpectError;
using fairscale::testing::TmpPath;

inline FullyShardedDataParallel MakeModel(std::shared_ptr<comm::Communicator> comm,
                                   ShardingStrategy strategy, bool nested) {
  const auto opts = FsdpOptions().sharding_strategy(strategy);
  return FullyShardedDataParallel(testing::NestedNet(nested ? comm : nullptr, opts), comm, opts);
}

// Trains steps [first, last); returns this rank's losses.
inline std::vector<at::Tensor> TrainSteps(FullyShardedDataParallel& model, torch::optim::Optimizer& opt,
                                   int first, int last, int rank, int world) {
  std::vector<at::Tensor> losses;
  for (int step = first; step < last; ++step) {
    opt.zero_grad();
    testing::Batch b = testing::GlobalBatch(step);
    at::Tensor loss = testing::Mse(model(testing::RankRows(b.x, rank, world)),
                                   testing::RankRows(b.y, rank, world));
    loss.backward();
    opt.step();
    losses.push_back(loss.detach());
  }
  return losses;
}

// The losses of steps [first, first + losses.size()) equal the uninterrupted reference run's.
inline absl::Status ExpectReferenceLosses(const std::vector<testing::ReferenceStep>& ref,
                                   const std::vector<at::Tensor>& losses, int first, int rank,
                                   int world) {
  for (size_t i = 0; i < losses.size(); ++i) {
    const int step = first + static_cast<int>(i);
    const at::Tensor y = testing::RankRows(testing::GlobalBatch(step).y, rank, world);
    FS_RETURN_IF_ERROR(testing::ExpectClose(
        absl::StrCat("loss of step ", step, " rank ", rank, "/", world), losses[i],
        testing::Mse(testing::RankRows(ref[step].output, rank, world), y), 1e-5));
  }
  return absl::OkStatus();
}

inline absl::Status SameDict(const StateDict& a, const StateDict& b, const std::string& what) {
  FS_RETURN_IF_ERROR(Check(a.keys() == b.keys(), what + ": names differ"));
  for (const auto& item : a) {
    FS_RETURN_IF_ERROR(
        Check(at::equal(item.value(), b[item.key()]), what + ": '" + item.key() + "' differs"));
  }
  return absl::OkStatus();
}

}  // namespace fairscale::fsdp::testing
