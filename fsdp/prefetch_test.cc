// Forward prefetch: with FsdpOptions::forward_prefetch (the default), the all-gather of the unit
// that runs next is issued before the current unit computes, so it overlaps with that compute;
// without it, each unit's all-gather is issued only when that unit's forward starts.
//
// Observed through CountingCommunicator: each nested unit's wrapped module records, when its
// forward body runs (its own parameters gathered and waited for), how many all-gathers this
// forward has issued so far. Units: root, unit0, unit1, in that order. With prefetch, when unit0
// computes, unit1's all-gather has already been issued (unit0 sees the same count as unit1);
// without it, unit1's all-gather comes later (unit0 sees one fewer). The first iteration only
// records the order, so it is checked from the second on; results must match either way.
//
// Backward prefetch modes and the all-gather limit (BackwardPrefetchTest): an EventLog
// communicator records, per rank, every all-gather (named by its size, which differs per unit)
// and reduce-scatter as issued, and markers the units' modules write while computing (forward
// body; in backward, a hook on the unit's pre-activation that fires in the middle of the unit's
// gradient). From it: the issue order per mode, and the most all-gathers issued and not yet
// completed at once (a lower bound of FSDP's own count, issued and not yet waited for).
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/sin.h>
#include <ATen/ops/tanh.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/forwarding_communicator.h"
#include "comm/registry.h"
#include "comm/testing/counting_communicator.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/test_util.h"
#include "gtest/gtest.h"
#include "testing/c10_error.h"

namespace fairscale::fsdp {
namespace {

using base::testing::IsOk;
using comm::testing::CountingCommunicator;

int64_t AllGathers(const CountingCommunicator& c) { return c.count(comm::OpType::kAllGather).ops; }

// tanh(fc(x)); records the all-gathers issued so far each time it computes.
class ProbeImpl : public torch::nn::Module {
 public:
  ProbeImpl(const CountingCommunicator* counter, std::vector<int64_t>* seen)
      : counter_(counter), seen_(seen) {
    fc = register_module("fc", torch::nn::Linear(6, 6));
    testing::InitDeterministic(*this, "probe.");
  }
  torch::Tensor forward(torch::Tensor x) {
    seen_->push_back(AllGathers(*counter_));
    return at::tanh(fc(x));
  }
  torch::nn::Linear fc{nullptr};

 private:
  const CountingCommunicator* counter_;
  std::vector<int64_t>* seen_;
};
TORCH_MODULE(Probe);

// fc_out(unit1(unit0(fc_in(x)))), unit0 and unit1 nested FSDP units.
class ChainImpl : public torch::nn::Module {
 public:
  ChainImpl(std::shared_ptr<CountingCommunicator> comm, FsdpOptions options,
            std::vector<int64_t>* seen0, std::vector<int64_t>* seen1)
      : unit0_(Probe(comm.get(), seen0), comm, options),
        unit1_(Probe(comm.get(), seen1), comm, options) {
    fc_in_ = register_module("fc_in", torch::nn::Linear(4, 6));
    register_module("unit0", unit0_);
    register_module("unit1", unit1_);
    fc_out_ = register_module("fc_out", torch::nn::Linear(6, 2));
    testing::InitDeterministic(*fc_in_, "fc_in.");
    testing::InitDeterministic(*fc_out_, "fc_out.");
  }
  torch::Tensor forward(torch::Tensor x) { return fc_out_(unit1_(unit0_(fc_in_(x)))); }

 private:
  torch::nn::Linear fc_in_{nullptr}, fc_out_{nullptr};
  FullyShardedDataParallel unit0_, unit1_;
};
TORCH_MODULE(Chain);

constexpr int kSteps = 3;

// Trains kSteps steps; returns the losses and fills the counts each unit saw per step.
absl::Status RunRank(int rank, int world, std::shared_ptr<comm::Communicator> inner, bool prefetch,
                     std::vector<int64_t>* seen0, std::vector<int64_t>* seen1,
                     std::vector<double>* losses) {
  auto counting = std::make_shared<CountingCommunicator>(inner);
  const auto opts = FsdpOptions()
                        .sharding_strategy(ShardingStrategy::kFullShard)
                        .forward_prefetch(prefetch)
                        .disable_reshard_on_root(false);
  FullyShardedDataParallel model(Chain(counting, opts, seen0, seen1), counting, opts);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    counting->Reset();
    at::Tensor x = at::sin(at::arange(8 * 4, at::kFloat).view({8, 4}) * (0.3 + step) + rank);
    at::Tensor loss = model(x).pow(2).mean();
    loss.backward();
    opt.step();
    losses->push_back(loss.item<double>());
  }
  if (seen0->size() != kSteps || seen1->size() != kSteps) {
    return absl::InternalError(absl::StrCat("units ran ", seen0->size(), " and ", seen1->size(),
                                            " times, expected ", kSteps));
  }
  return absl::OkStatus();
}

TEST(PrefetchTest, NextUnitAllGatherIssuedBeforeCurrentUnitComputes) {
  for (int world : {2, 3}) {
    // [prefetch][rank]
    std::vector<std::vector<int64_t>> seen0[2], seen1[2];
    std::vector<std::vector<double>> losses[2];
    for (int prefetch = 0; prefetch < 2; ++prefetch) {
      seen0[prefetch].assign(world, {});
      seen1[prefetch].assign(world, {});
      losses[prefetch].assign(world, {});
      std::vector<absl::Status> statuses = comm::testing::RunInprocRanks(
          world, [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
            return RunRank(rank, w, comm, prefetch == 1, &seen0[prefetch][rank],
                           &seen1[prefetch][rank], &losses[prefetch][rank]);
          });
      for (int r = 0; r < world; ++r) {
        ASSERT_THAT(statuses[r], IsOk()) << "world " << world << " prefetch " << prefetch;
      }
    }
    for (int r = 0; r < world; ++r) {
      SCOPED_TRACE(absl::StrCat("world ", world, " rank ", r));
      for (int step = 1; step < kSteps; ++step) {
        SCOPED_TRACE(absl::StrCat("step ", step));
        // Prefetch: unit1's gather was issued before unit0 computed.
        EXPECT_EQ(seen0[1][r][step], seen1[1][r][step]);
        // No prefetch: it was issued after unit0 computed, when unit1's forward started.
        EXPECT_EQ(seen0[0][r][step] + 1, seen1[0][r][step]);
        // Prefetch changes when gathers are issued, not how many.
        EXPECT_EQ(seen1[0][r][step], seen1[1][r][step]);
      }
      // The first forward records the order and cannot prefetch.
      EXPECT_EQ(seen0[1][r][0] + 1, seen1[1][r][0]);
      for (int step = 0; step < kSteps; ++step) {
        EXPECT_DOUBLE_EQ(losses[0][r][step], losses[1][r][step]) << "step " << step;
      }
    }
  }
}

// ---- backward prefetch modes and all_gathers_in_flight ----------------------------------------

// Records all-gathers ("AG<bytes>"), reduce-scatters ("RS") and markers in issue order; tracks
// all-gathers issued and not yet completed.
class EventLog : public comm::ForwardingCommunicator {
 public:
  explicit EventLog(std::shared_ptr<comm::Communicator> inner)
      : comm::ForwardingCommunicator(std::move(inner), "event_log") {}

  void Mark(const std::string& m) {
    absl::MutexLock lock(&mu_);
    events_.push_back(m);
  }
  std::vector<std::string> TakeEvents() {
    absl::MutexLock lock(&mu_);
    return std::exchange(events_, {});
  }
  int max_gathers_in_flight() const {
    absl::MutexLock lock(&mu_);
    return max_in_flight_;
  }

 protected:
  comm::Work Forward(const comm::OpContext& ctx, const OpInfo& info,
                     const std::function<comm::Work()>& issue) override {
    const bool gather = ctx.type == comm::OpType::kAllGather;
    {
      absl::MutexLock lock(&mu_);
      if (gather) {
        events_.push_back(absl::StrCat("AG", info.bytes));
        max_in_flight_ = std::max(max_in_flight_, ++in_flight_);
      } else if (ctx.type == comm::OpType::kReduceScatter) {
        events_.push_back("RS");
      }
    }
    comm::Work work = issue();
    if (gather) {
      work.OnDone([this](const absl::Status&) {
        absl::MutexLock lock(&mu_);
        --in_flight_;
      });
    }
    return work;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<std::string> events_ ABSL_GUARDED_BY(mu_);
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  int max_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
};

// tanh(fc(x)); marks "F<name>" when its forward computes and "B<name>" in its backward, after
// tanh's gradient and before fc's.
class MarkedImpl : public torch::nn::Module {
 public:
  MarkedImpl(EventLog* log, std::string name, int in, int out) : log_(log), name_(std::move(name)) {
    fc = register_module("fc", torch::nn::Linear(in, out));
    testing::InitDeterministic(*this, name_ + ".");
  }
  torch::Tensor forward(torch::Tensor x) {
    log_->Mark("F" + name_);
    at::Tensor z = fc(x);
    if (z.requires_grad()) {
      EventLog* log = log_;
      const std::string mark = "B" + name_;
      z.register_hook([log, mark](const at::Tensor&) { log->Mark(mark); });
    }
    return at::tanh(z);
  }
  torch::nn::Linear fc{nullptr};

 private:
  EventLog* log_;
  std::string name_;
};
TORCH_MODULE(Marked);

// fc_out(U1(U0(fc_in(x)))): the root R holds fc_in (4x6) and fc_out (6x2), 44 numbers (176
// bytes gathered); U0 6->8, 56 numbers (224 bytes); U1 8->6, 54 numbers (216 bytes).
class MarkedChainImpl : public torch::nn::Module {
 public:
  MarkedChainImpl(std::shared_ptr<EventLog> log, FsdpOptions options)
      : u0_(Marked(log.get(), "U0", 6, 8), log, options),
        u1_(Marked(log.get(), "U1", 8, 6), log, options) {
    fc_in_ = register_module("fc_in", torch::nn::Linear(4, 6));
    register_module("u0", u0_);
    register_module("u1", u1_);
    fc_out_ = register_module("fc_out", torch::nn::Linear(6, 2));
    testing::InitDeterministic(*fc_in_, "fc_in.");
    testing::InitDeterministic(*fc_out_, "fc_out.");
  }
  torch::Tensor forward(torch::Tensor x) { return fc_out_(u1_(u0_(fc_in_(x)))); }

 private:
  torch::nn::Linear fc_in_{nullptr}, fc_out_{nullptr};
  FullyShardedDataParallel u0_, u1_;
};
TORCH_MODULE(MarkedChain);

std::string Named(const std::string& event) {
  static const std::map<std::string, std::string> names = {
      {"AG176", "AG R"}, {"AG224", "AG U0"}, {"AG216", "AG U1"}};
  auto it = names.find(event);
  return it == names.end() ? event : it->second;
}

struct ModeRun {
  std::vector<std::vector<std::string>> forward, backward;  // per step
  int max_gathers_in_flight = 0;
  std::vector<at::Tensor> params;  // this rank's shards after training
};

absl::Status RunMarkedRank(int rank, std::shared_ptr<comm::Communicator> inner,
                           BackwardPrefetch mode, int limit, ModeRun* out) {
  auto log = std::make_shared<EventLog>(inner);
  const auto opts = FsdpOptions()
                        .sharding_strategy(ShardingStrategy::kFullShard)
                        .backward_prefetch(mode)
                        .all_gathers_in_flight(limit)
                        .disable_reshard_on_root(false);
  FullyShardedDataParallel model(MarkedChain(log, opts), log, opts);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    at::Tensor x = at::sin(at::arange(8 * 4, at::kFloat).view({8, 4}) * (0.3 + step) + rank);
    at::Tensor loss = model(x).pow(2).mean();
    out->forward.push_back(log->TakeEvents());
    loss.backward();
    out->backward.push_back(log->TakeEvents());
    opt.step();
  }
  for (auto& e : out->forward) std::transform(e.begin(), e.end(), e.begin(), Named);
  for (auto& e : out->backward) std::transform(e.begin(), e.end(), e.begin(), Named);
  out->max_gathers_in_flight = log->max_gathers_in_flight();
  for (const at::Tensor& p : model->parameters()) out->params.push_back(p.detach().clone());
  return absl::OkStatus();
}

std::string Join(const std::vector<std::string>& v) { return absl::StrJoin(v, ", "); }

TEST(BackwardPrefetchTest, OrderPerModeLimitOnGathersAndParity) {
  constexpr int kWorld = 2;
  using V = std::vector<std::string>;
  // From the second step on (the first records the orders). Forward prefetch (the default)
  // issues U0's gather with R's and U1's with U0's.
  const V forward = {"AG R", "AG U0", "AG U1", "FU0", "FU1"};
  const std::map<BackwardPrefetch, V> backward = {
      // Each unit gathers when its backward starts; U1 reduces before U0 gathers.
      {BackwardPrefetch::kNone, {"AG R", "AG U1", "BU1", "RS", "AG U0", "BU0", "RS", "RS"}},
      // R prefetches U1, U1 prefetches U0 before computing its gradient.
      {BackwardPrefetch::kBackwardPre, {"AG R", "AG U1", "AG U0", "BU1", "RS", "BU0", "RS", "RS"}},
      // U1 prefetches U0 once its gradient is complete, ahead of its own reduction.
      {BackwardPrefetch::kBackwardPost,
       {"AG R", "AG U1", "BU1", "AG U0", "RS", "BU0", "RS", "RS"}},
  };
  std::vector<ModeRun> baseline;  // kNone, unlimited
  for (BackwardPrefetch mode :
       {BackwardPrefetch::kNone, BackwardPrefetch::kBackwardPre, BackwardPrefetch::kBackwardPost}) {
    for (int limit : {0, 1, 2, 3}) {
      SCOPED_TRACE(absl::StrCat(BackwardPrefetchName(mode), " all_gathers_in_flight ", limit));
      std::vector<ModeRun> runs(kWorld);
      std::vector<absl::Status> statuses = comm::testing::RunInprocRanks(
          kWorld, [&](int rank, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
            return RunMarkedRank(rank, comm, mode, limit, &runs[rank]);
          });
      for (int r = 0; r < kWorld; ++r) {
        ASSERT_THAT(statuses[r], IsOk()) << "rank " << r;
      }
      if (baseline.empty()) baseline = runs;
      for (int r = 0; r < kWorld; ++r) {
        SCOPED_TRACE(absl::StrCat("rank ", r));
        const ModeRun& run = runs[r];
        if (limit > 0) {
          EXPECT_LE(run.max_gathers_in_flight, limit);
        }
        for (int step = 1; step < kSteps; ++step) {
          EXPECT_EQ(Join(run.forward[step]), Join(forward)) << "step " << step;
          EXPECT_EQ(Join(run.backward[step]), Join(backward.at(mode))) << "step " << step;
        }
        // Prefetching changes when parameters are gathered, never the result.
        ASSERT_EQ(run.params.size(), baseline[r].params.size());
        for (size_t i = 0; i < run.params.size(); ++i) {
          EXPECT_TRUE(at::equal(run.params[i], baseline[r].params[i])) << "parameter " << i;
        }
      }
    }
  }
}

TEST(BackwardPrefetchTest, BoolSpellingAndBadOptions) {
  EXPECT_EQ(FsdpOptions().backward_prefetch(), BackwardPrefetch::kBackwardPre);
  EXPECT_EQ(FsdpOptions().backward_prefetch(false).backward_prefetch(), BackwardPrefetch::kNone);
  EXPECT_EQ(FsdpOptions().backward_prefetch(true).backward_prefetch(),
            BackwardPrefetch::kBackwardPre);
  EXPECT_EQ(FsdpOptions().all_gathers_in_flight(), 0);
  std::vector<absl::Status> statuses = comm::testing::RunInprocRanks(
      1, [&](int, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        auto make = [&](FsdpOptions opts) {
          return FullyShardedDataParallel(torch::nn::Linear(2, 2), comm, opts);
        };
        FS_RETURN_IF_ERROR(fairscale::testing::ExpectError(
            [&] { make(FsdpOptions().all_gathers_in_flight(-1)); },
            {"all_gathers_in_flight must be >= 0"}));
        return fairscale::testing::ExpectError(
            [&] { make(FsdpOptions().backward_prefetch(static_cast<BackwardPrefetch>(7))); },
            {"backward_prefetch is not a BackwardPrefetch"});
      });
  ASSERT_EQ(statuses.size(), 1u);
  EXPECT_THAT(statuses[0], IsOk());
}

}  // namespace
}  // namespace fairscale::fsdp
