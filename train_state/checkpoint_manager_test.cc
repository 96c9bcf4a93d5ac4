// CheckpointManager at 1-4 ranks (inproc): what a restore gives back is what was saved (the
// reference: values captured at save time), sync and async; the snapshot is a copy; retention;
// a failing rank, a corrupt file or a mismatching state is a clear error that changes nothing.
#include "train_state/checkpoint_manager.h"

#include <ATen/ops/allclose.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/rand.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/string_utils.h>
#include <sys/stat.h>
#include <torch/nn/modules/linear.h>

#include <atomic>
#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "amp/grad_scaler.h"
#include "base/status_macros.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "gtest/gtest.h"
#include "oss/oss.h"
#include <torch/optim/adam.h>
#include <torch/serialize/input-archive.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/full.h>
#include "testing/tmp.h"
#include "train_state/items.h"

namespace fairscale::train_state {
namespace {

using comm::testing::Check;
using comm::testing::ExpectAllOk;
using comm::testing::RunInprocRanks;

void SetScale(amp::GradScaler& scaler, double scale) {
  amp::GradScalerState s = scaler.state_dict();
  s.scale = scale;
  scaler.load_state_dict(s);
}

// The state of one rank: a replicated Linear, a JSON counter, the loss scaler, RNG.
struct Rank {
  std::shared_ptr<torch::nn::LinearImpl> linear = std::make_shared<torch::nn::LinearImpl>(3, 2);
  nlohmann::json counter = {{"step", 0}, {"samples", 0}};
  amp::GradScaler scaler;
  TrainState state;
  Rank() {
    state.add("model", module_item(linear))
        .add("trainer", json_item([this] { return counter; },
                                  [this](const nlohmann::json& j) { counter = j; }))
        .add("scaler", grad_scaler_item(scaler))
        .add("rng", rng_item());
  }
  void Perturb() {
    c10::NoGradGuard no_grad;
    linear->weight.add_(1.0);
    counter["step"] = -1;
    SetScale(scaler, 1.0);
    (void)at::rand({7});
  }
};

absl::Status SameTensor(const at::Tensor& a, const at::Tensor& b, const std::string& what) {
  return Check(at::equal(a, b), what);
}

class CheckpointManagerTest : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(CheckpointManagerTest, RestoresWhatWasSavedAndTheSnapshotIsACopy) {
  const auto [world, async] = GetParam();
  const std::string root =
      fairscale::testing::UniqueTmpPath(absl::StrCat("mgr_", world, async ? "_async" : "_sync"));
  ExpectAllOk(RunInprocRanks(world, [&](int rank, int, std::shared_ptr<comm::Communicator> comm)
                                        -> absl::Status {
    Rank r;
    CheckpointManager m(comm, CheckpointManagerOptions(root).async(async).keep_last(2));
    FS_RETURN_IF_ERROR(Check(!m.restore(r.state).has_value(), "fresh start"));
    // Identical replicas (what a replicated module is), then save step 10.
    { c10::NoGradGuard g; r.linear->weight.fill_(0.5); r.linear->bias.fill_(-0.25); }
    r.counter = {{"step", 10}, {"samples", 640}};
    SetScale(r.scaler, 1024.0);
    const at::Tensor w10 = r.linear->weight.clone();
    const at::Tensor rng10 = at::rand({4});  // the next draw after the save...
    (void)rng10;
    at::manual_seed(1234 + rank);  // ...from a known state
    const at::Tensor draw = at::rand({5});
    at::manual_seed(1234 + rank);
    m.save(10, r.state, {{"loss", 3.5}});
    // Training goes on while an async save writes: the checkpoint must hold the values of the
    // snapshot.
    r.Perturb();
    m.wait();
    FS_RETURN_IF_ERROR(Check(m.latest_complete() == 10, "latest after the save"));
    r.Perturb();
    std::optional<int64_t> step = m.restore(r.state);
    FS_RETURN_IF_ERROR(Check(step == 10, "restored step"));
    FS_RETURN_IF_ERROR(SameTensor(r.linear->weight, w10, "weight"));
    FS_RETURN_IF_ERROR(Check(r.counter["samples"] == 640 && r.counter["step"] == 10, "counter"));
    FS_RETURN_IF_ERROR(Check(r.scaler.get_scale() == 1024.0, "scale"));
    // The CPU generator is per process, and the ranks here are threads of one process: its
    // stream is only this rank's at world size 1.
    if (world == 1) {
      FS_RETURN_IF_ERROR(SameTensor(at::rand({5}), draw, "the RNG stream continues"));
    }
    FS_RETURN_IF_ERROR(Check(m.restored_marker()->metadata["loss"] == 3.5, "metadata"));
    FS_RETURN_IF_ERROR(Check(m.restored_marker()->world_size == world, "world size"));
    return absl::OkStatus();
  }));
}

INSTANTIATE_TEST_SUITE_P(WorldsAndModes, CheckpointManagerTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Bool()));

TEST(CheckpointManagerRetention, KeepsLastKAndEveryNth) {
  const std::string root = fairscale::testing::UniqueTmpPath("mgr_retention");
  ExpectAllOk(RunInprocRanks(2, [&](int, int, std::shared_ptr<comm::Communicator> comm)
                                    -> absl::Status {
    Rank r;
    CheckpointManager m(comm, CheckpointManagerOptions(root).keep_last(2).keep_every(3));
    for (int64_t s = 1; s <= 7; ++s) m.save(s, r.state);
    FS_RETURN_IF_ERROR(
        Check(m.all_steps() == std::vector<int64_t>({3, 6, 7}), "steps kept"));
    // A step not after the newest is refused.
    try {
      m.save(5, r.state);
      return absl::InternalError("saving step 5 after 7 did not throw");
    } catch (const c10::Error& e) {
      FS_RETURN_IF_ERROR(Check(absl::StrContains(e.what(), "not after the newest complete "
                                                           "checkpoint (step 7"),
                               e.what()));
    }
    return absl::OkStatus();
  }));
}

// An item whose write fails on one rank.
class FailingItem final : public Stateful {
 public:
  explicit FailingItem(int failing_rank) : failing_rank_(failing_rank) {}
  std::string kind() const override { return "failing"; }
  class Snap final : public Snapshot {
   public:
    explicit Snap(bool fail) : fail_(fail) {}
    absl::StatusOr<WriteResult> write(const std::string& dir) override {
      if (fail_) return absl::ResourceExhaustedError("cannot write " + dir + "/x: disk full");
      return WriteResult{};
    }
    bool fail_;
  };
  std::unique_ptr<Snapshot> snapshot(const SaveContext& ctx, std::unique_ptr<Snapshot>) override {
    return std::make_unique<Snap>(armed && ctx.rank == failing_rank_);
  }
  std::function<void()> restore(const RestoreContext&) override { return [] {}; }
  bool armed = false;

 private:
  int failing_rank_;
};

TEST(CheckpointManagerFailures, AFailingRankIsNamedAndThePreviousCheckpointStays) {
  for (bool async : {false, true}) {
    const std::string root = fairscale::testing::UniqueTmpPath("mgr_fail");
    ExpectAllOk(RunInprocRanks(3, [&](int, int, std::shared_ptr<comm::Communicator> comm)
                                      -> absl::Status {
      Rank r;
      auto failing = std::make_shared<FailingItem>(1);
      r.state.add("fails", failing);
      CheckpointManager m(comm, CheckpointManagerOptions(root).async(async));
      { c10::NoGradGuard g; r.linear->weight.fill_(2.0); }
      m.save(1, r.state);
      m.wait();
      failing->armed = true;
      std::string error;
      try {
        m.save(2, r.state);
        m.wait();
      } catch (const c10::Error& e) {
        error = e.what();
      }
      FS_RETURN_IF_ERROR(Check(absl::StrContains(error, "rank 1") &&
                                   absl::StrContains(error, "disk full") &&
                                   absl::StrContains(error, "step 2"),
                               "error: " + error));
      FS_RETURN_IF_ERROR(Check(m.latest_complete() == 1, "step 1 is still the newest"));
      r.Perturb();
      FS_RETURN_IF_ERROR(Check(m.restore(r.state) == 1, "restores step 1"));
      FS_RETURN_IF_ERROR(Check(at::equal(r.linear->weight, at::full({2, 3}, 2.0)), "weight"));
      // The next save cleans the leftovers up and succeeds.
      failing->armed = false;
      m.save(2, r.state);
      m.wait();
      return Check(m.all_steps() == std::vector<int64_t>({1, 2}), "steps after the retry");
    }));
  }
}

TEST(CheckpointManagerFailures, CorruptFilesAndMismatchedStatesChangeNothing) {
  const std::string root = fairscale::testing::UniqueTmpPath("mgr_corrupt");
  ExpectAllOk(RunInprocRanks(2, [&](int rank, int, std::shared_ptr<comm::Communicator> comm)
                                    -> absl::Status {
    Rank r;
    CheckpointManager m(comm, CheckpointManagerOptions(root));
    m.save(1, r.state);
    const at::Tensor saved = r.linear->weight.clone();
    { c10::NoGradGuard g; r.linear->weight.fill_(7.0); }
    FS_RETURN_IF_ERROR(Check(comm->Barrier().Wait().ok(), "barrier"));
    if (rank == 0) {
      std::fstream f(StepDir(root, 1) + "/model/module.pt",
                     std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(40);
      f.put('\x5a');
    }
    FS_RETURN_IF_ERROR(Check(comm->Barrier().Wait().ok(), "barrier"));
    std::string error;
    try {
      m.restore(r.state);
    } catch (const c10::Error& e) {
      error = e.what();
    }
    FS_RETURN_IF_ERROR(Check(absl::StrContains(error, "model/module.pt is corrupt"), error));
    FS_RETURN_IF_ERROR(Check(at::equal(r.linear->weight, at::full({2, 3}, 7.0)), "unchanged"));

    // A state with an item the checkpoint lacks (and lacking one it has).
    TrainState other;
    other.add("model", module_item(r.linear)).add("extra", rng_item());
    CheckpointManager quiet(comm, CheckpointManagerOptions(root).verify_on_restore(false));
    try {
      quiet.restore(other);
      error.clear();
    } catch (const c10::Error& e) {
      error = e.what();
    }
    FS_RETURN_IF_ERROR(Check(absl::StrContains(error, "item(s) not in the checkpoint: extra") &&
                                 absl::StrContains(error, "not in the state: rng, scaler, trainer"),
                             error));
    (void)saved;
    return absl::OkStatus();
  }));
}

TEST(CheckpointManagerFailures, RngAtAnotherWorldSizeIsRefusedUnlessReseeding) {
  const std::string root = fairscale::testing::UniqueTmpPath("mgr_rng");
  ExpectAllOk(RunInprocRanks(2, [&](int, int, std::shared_ptr<comm::Communicator> comm)
                                    -> absl::Status {
    Rank r;
    CheckpointManager(comm, CheckpointManagerOptions(root)).save(3, r.state);
    return absl::OkStatus();
  }));
  ExpectAllOk(RunInprocRanks(3, [&](int, int, std::shared_ptr<comm::Communicator> comm)
                                    -> absl::Status {
    Rank r;
    CheckpointManager m(comm, CheckpointManagerOptions(root));
    std::string error;
    try {
      m.restore(r.state);
    } catch (const c10::Error& e) {
      error = e.what();
    }
    FS_RETURN_IF_ERROR(Check(absl::StrContains(error, "are of 2 ranks, this run has 3"), error));
    TrainState reseed;
    reseed.add("model", module_item(r.linear))
        .add("trainer", json_item([&] { return r.counter; },
                                  [&](const nlohmann::json& j) { r.counter = j; }))
        .add("scaler", grad_scaler_item(r.scaler))
        .add("rng", rng_item(/*reseed_on_world_change=*/true));
    return Check(m.restore(reseed) == 3, "restores with reseeding");
  }));
}

TEST(CheckpointManagerItems, TheSamplerPositionResumesAtAnotherWorldSize) {
  // Reference: the global order of epoch 0 at world 1 (global batch 6 = 3 ranks x 2 = 2 x 3).
  const size_t n = 40;
  const std::vector<size_t> order = epoch_order(n, 7, 0, true);
  const std::string root = fairscale::testing::UniqueTmpPath("mgr_sampler");
  std::vector<std::vector<size_t>> seen(3);
  ExpectAllOk(RunInprocRanks(2, [&](int rank, int, std::shared_ptr<comm::Communicator> comm)
                                    -> absl::Status {
    DistributedSampler sampler(n, rank, 2, DistributedSamplerOptions().seed(7));
    for (int b = 0; b < 3; ++b) sampler.next(3);  // 18 samples
    TrainState state;
    state.add("data", sampler_item(sampler));
    CheckpointManager(comm, CheckpointManagerOptions(root)).save(3, state);
    return absl::OkStatus();
  }));
  ExpectAllOk(RunInprocRanks(3, [&](int rank, int, std::shared_ptr<comm::Communicator> comm)
                                    -> absl::Status {
    DistributedSampler sampler(n, rank, 3, DistributedSamplerOptions().seed(7));
    TrainState state;
    state.add("data", sampler_item(sampler));
    CheckpointManager m(comm, CheckpointManagerOptions(root));
    FS_RETURN_IF_ERROR(Check(m.restore(state) == 3, "restored"));
    FS_RETURN_IF_ERROR(Check(sampler.position() == 18, "position"));
    auto batch = sampler.next(2);
    FS_RETURN_IF_ERROR(Check(batch.has_value(), "a batch"));
    seen[rank] = *batch;
    return absl::OkStatus();
  }));
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(seen[r], std::vector<size_t>(order.begin() + 18 + 2 * r, order.begin() + 20 + 2 * r))
        << "rank " << r;
  }
}

// A replicated model with a ZeRO-sharded Adam (module_item + oss_item) saved at 2 ranks and
// restored at 3 continues like a plain single-process Adam (the reference).
TEST(CheckpointManagerItems, OssOptimizerSavedAt2ContinuesAt3LikePlainAdam) {
  // Fixed weights (the global generator is shared by the thread ranks).
  auto make = [] {
    auto m = std::make_shared<torch::nn::LinearImpl>(5, 4);
    c10::NoGradGuard g;
    m->weight.copy_(at::arange(20, at::kFloat).reshape({4, 5}).sin());
    m->bias.copy_(at::arange(4, at::kFloat).cos());
    return m;
  };
  auto step = [](torch::nn::LinearImpl& m, torch::optim::Optimizer& opt, int k) {
    opt.zero_grad();
    const at::Tensor x = at::full({6, 5}, 0.1 * (k + 1));
    (m.forward(x) - 1.0).pow(2).mean().backward();
    opt.step();
  };
  auto ref = make();
  torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(0.05));
  for (int k = 0; k < 4; ++k) step(*ref, ref_opt, k);

  const std::string root = fairscale::testing::UniqueTmpPath("mgr_oss");
  for (int world : {2, 3}) {
    ExpectAllOk(RunInprocRanks(world, [&](int, int, std::shared_ptr<comm::Communicator> comm)
                                          -> absl::Status {
      auto m = make();
      auto opt = oss::OSS::make<torch::optim::Adam>(m->parameters(),
                                                    torch::optim::AdamOptions(0.05), comm);
      TrainState state;
      state.add("model", module_item(m)).add("optimizer", oss_item(*opt));
      CheckpointManager mgr(comm, CheckpointManagerOptions(root));
      if (world == 2) {
        for (int k = 0; k < 2; ++k) step(*m, *opt, k);
        mgr.save(2, state);
        return absl::OkStatus();
      }
      FS_RETURN_IF_ERROR(Check(mgr.restore(state) == 2, "restored"));
      for (int k = 2; k < 4; ++k) step(*m, *opt, k);
      FS_RETURN_IF_ERROR(Check(at::allclose(m->weight, ref->weight, 1e-6, 1e-7), "weight"));
      return Check(at::allclose(m->bias, ref->bias, 1e-6, 1e-7), "bias");
    }), absl::StrCat("world ", world));
  }
}

// A model and a plain Adam replicated on every rank (module_item + optimizer_item), saved at 2
// ranks and restored at 1 and 3, continue like the uninterrupted single-process run.
TEST(CheckpointManagerItems, ReplicatedOptimizerSavedAt2ContinuesAt1And3) {
  auto make = [] {
    auto m = std::make_shared<torch::nn::LinearImpl>(3, 2);
    c10::NoGradGuard g;
    m->weight.copy_(at::arange(6, at::kFloat).reshape({2, 3}).cos());
    m->bias.copy_(at::arange(2, at::kFloat).sin());
    return m;
  };
  auto step = [](torch::nn::LinearImpl& m, torch::optim::Optimizer& opt, int k) {
    opt.zero_grad();
    (m.forward(at::full({4, 3}, 0.2 * (k + 1))) + 0.5).pow(2).mean().backward();
    opt.step();
  };
  auto ref = make();
  torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(0.1));
  for (int k = 0; k < 5; ++k) step(*ref, ref_opt, k);

  const std::string root = fairscale::testing::UniqueTmpPath("mgr_replicated");
  for (int world : {2, 1, 3}) {
    ExpectAllOk(RunInprocRanks(world, [&](int, int, std::shared_ptr<comm::Communicator> comm)
                                          -> absl::Status {
      auto m = make();
      torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(0.1));
      TrainState state;
      state.add("model", module_item(m)).add("optimizer", optimizer_item(opt));
      CheckpointManager mgr(comm, CheckpointManagerOptions(root));
      if (world == 2) {
        for (int k = 0; k < 3; ++k) step(*m, opt, k);
        mgr.save(3, state);
        return absl::OkStatus();
      }
      FS_RETURN_IF_ERROR(Check(mgr.restore(state) == 3, "restored"));
      FS_RETURN_IF_ERROR(Check(mgr.restored_marker()->items.at("optimizer").kind == "optimizer",
                               "kind"));
      for (int k = 3; k < 5; ++k) step(*m, opt, k);
      // Bitwise: the same float operations in the same order as the reference.
      FS_RETURN_IF_ERROR(Check(at::equal(m->weight, ref->weight), "weight"));
      return Check(at::equal(m->bias, ref->bias), "bias");
    }), absl::StrCat("world ", world));
  }
}

// optimizer_item's snapshot serializes into the previous snapshot's buffer: after training on,
// the second snapshot (reusing the first) writes exactly the optimizer's current archive (no
// stale bytes of the first), which a plain Adam loads to the same state.
TEST(CheckpointManagerItems, OptimizerSnapshotReusingABufferWritesTheCurrentState) {
  auto m = std::make_shared<torch::nn::LinearImpl>(3, 2);
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(0.1));
  auto step = [&] {
    opt.zero_grad();
    m->forward(at::full({2, 3}, 0.5)).pow(2).sum().backward();
    opt.step();
  };
  auto item = optimizer_item(opt);
  const std::string dir = fairscale::testing::UniqueTmpPath("optimizer_reuse");
  std::filesystem::create_directories(dir + "/a");
  std::filesystem::create_directories(dir + "/b");
  step();
  std::unique_ptr<Stateful::Snapshot> first = item->snapshot(SaveContext{1, 0, 1}, nullptr);
  ASSERT_TRUE(first->write(dir + "/a").ok());
  for (int k = 0; k < 3; ++k) step();
  std::unique_ptr<Stateful::Snapshot> second = item->snapshot(SaveContext{4, 0, 1}, std::move(first));
  ASSERT_TRUE(second->write(dir + "/b").ok());
  torch::optim::Adam loaded(m->parameters(), torch::optim::AdamOptions(0.1));
  torch::serialize::InputArchive archive;
  archive.load_from(dir + "/b/optimizer.pt");
  loaded.load(archive);
  for (const at::Tensor& p : m->parameters()) {
    const auto& want = static_cast<const torch::optim::AdamParamState&>(
        *opt.state().at(c10::guts::to_string(p.unsafeGetTensorImpl())));
    const auto& got = static_cast<const torch::optim::AdamParamState&>(
        *loaded.state().at(c10::guts::to_string(p.unsafeGetTensorImpl())));
    EXPECT_EQ(got.step(), 4);
    EXPECT_TRUE(at::equal(got.exp_avg(), want.exp_avg()));
    EXPECT_TRUE(at::equal(got.exp_avg_sq(), want.exp_avg_sq()));
  }
  EXPECT_NE(std::filesystem::file_size(dir + "/a/optimizer.pt"), 0u);
}

}  // namespace
}  // namespace fairscale::train_state
