#include "comm/algorithms/transport_communicator.h"

#include <pthread.h>

#include <algorithm>
#include <deque>
#include <functional>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "comm/algorithms/algorithms.h"
#include "comm/algorithms/heartbeat.h"
#include "comm/store/hash_store.h"
#include "comm/store/prefix_store.h"

namespace fairscale::comm {
namespace {

// How often an idle worker asks the transport whether a peer died.
constexpr absl::Duration kIdlePollInterval = absl::Milliseconds(50);

class TransportCommunicator final : public Communicator {
 public:
  static absl::StatusOr<std::shared_ptr<Communicator>> Build(std::string backend,
                                                             const CommConfig& config,
                                                             algo::Options options,
                                                             std::shared_ptr<Store> store,
                                                             TransportFactory factory) {
    FS_ASSIGN_OR_RETURN(std::unique_ptr<Transport> transport,
                        factory(store, config.rank, config.size, config));
    if (transport == nullptr || transport->rank() != config.rank ||
        transport->size() != config.size) {
      return absl::InternalError(
          "the transport factory returned no transport or one of the "
          "wrong rank/size");
    }
    return std::shared_ptr<Communicator>(
        new TransportCommunicator(std::move(backend), config, options, std::move(store),
                                  std::move(factory), std::move(transport)));
  }

  ~TransportCommunicator() override {
    heartbeat_.reset();  // disarmed before anything it could cancel goes away
    bool cancel = false;
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      FailQueueLocked(absl::FailedPreconditionError(
          absl::StrCat(Who(), ": the communicator was destroyed before the operation started")));
      cancel = running_;
    }
    // An operation still running would otherwise hold the destructor until its deadline.
    if (cancel) {
      transport_->Cancel(absl::CancelledError(
          absl::StrCat(Who(), ": the communicator was destroyed during the operation")));
    }
    worker_.join();
    bool shut_down;
    {
      absl::MutexLock lock(&mu_);
      shut_down = shut_down_;
    }
    if (!shut_down) transport_->Shutdown(absl::OkStatus());
  }

  void Abort(absl::Status reason) override {
    if (reason.ok()) reason = absl::AbortedError(absl::StrCat(Who(), ": Abort() was called"));
    {
      absl::MutexLock lock(&mu_);
      if (!error_.ok()) return;
      error_ = reason;
      FailQueueLocked(reason);
    }
    // The caller chose to abort and reports its reason itself (every rank of a job that fails
    // the same way would otherwise log it once more): a detail for verbose logs.
    FS_VLOG(1) << "communicator aborted: " << reason;
    // The worker wakes up (its condition sees error_) and shuts the transport down.
    transport_->Cancel(reason);
  }

  absl::Status status() const override {
    absl::MutexLock lock(&mu_);
    return error_;
  }

 protected:
  Work DoAllReduce(const OpContext& ctx, ConstBuffer send, Buffer recv, ReduceOp op) override {
    return Enqueue(ctx, [=](const algo::Context& a) { return algo::AllReduce(a, send, recv, op); });
  }
  Work DoReduceScatter(const OpContext& ctx, ConstBuffer send, Buffer recv, ReduceOp op) override {
    return Enqueue(ctx,
                   [=](const algo::Context& a) { return algo::ReduceScatter(a, send, recv, op); });
  }
  Work DoAllGather(const OpContext& ctx, ConstBuffer send, Buffer recv) override {
    return Enqueue(ctx, [=](const algo::Context& a) { return algo::AllGather(a, send, recv); });
  }
  Work DoBroadcast(const OpContext& ctx, Buffer buffer, int root) override {
    return Enqueue(ctx, [=](const algo::Context& a) { return algo::Broadcast(a, buffer, root); });
  }
  Work DoReduce(const OpContext& ctx, ConstBuffer send, Buffer recv, ReduceOp op,
                int root) override {
    return Enqueue(ctx,
                   [=](const algo::Context& a) { return algo::Reduce(a, send, recv, op, root); });
  }
  Work DoAllToAll(const OpContext& ctx, ConstBuffer send, Buffer recv) override {
    return Enqueue(ctx, [=](const algo::Context& a) { return algo::AllToAll(a, send, recv); });
  }
  Work DoSend(const OpContext& ctx, ConstBuffer buffer, int peer) override {
    return Enqueue(ctx, [=](const algo::Context& a) { return algo::Send(a, buffer, peer); });
  }
  Work DoRecv(const OpContext& ctx, Buffer buffer, int peer) override {
    return Enqueue(ctx, [=](const algo::Context& a) { return algo::Recv(a, buffer, peer); });
  }
  Work DoBatchP2P(const OpContext& ctx, std::vector<P2PItem> items) override {
    return Enqueue(ctx, [items = std::move(items)](const algo::Context& a) {
      return algo::BatchP2P(a, items);
    });
  }
  Work DoBarrier(const OpContext& ctx) override {
    return Enqueue(ctx, [](const algo::Context& a) { return algo::Barrier(a); });
  }

  absl::StatusOr<std::shared_ptr<Communicator>> DoSplit(const OpContext& ctx, int color,
                                                        int key) override {
    const int n = size();
    const int r = rank();
    // Everyone's (color, key), gathered through the transport like any collective.
    auto table = std::make_shared<std::vector<int32_t>>(2 * n, 0);
    (*table)[2 * r] = color;
    (*table)[2 * r + 1] = key;
    const absl::Duration budget = QueuedTimeBudget() + ctx.timeout;
    Work exchange = Enqueue(ctx, [table, r](const algo::Context& a) {
      Buffer all = MakeBuffer(table->data(), table->size());
      return algo::AllGather(a, all.Slice(2 * r, 2), all);
    });
    // The worker ends every operation within its own timeout, so this bound is never the one
    // that fires unless something is badly wrong.
    FS_RETURN_IF_ERROR(exchange.Wait(budget + absl::Seconds(5)));
    if (color == kNoColor) return std::shared_ptr<Communicator>();

    std::vector<std::pair<int, int>> members;  // (key, old rank)
    for (int p = 0; p < n; ++p) {
      if ((*table)[2 * p] == color) members.emplace_back((*table)[2 * p + 1], p);
    }
    std::sort(members.begin(), members.end());
    CommConfig child = config_;
    child.size = static_cast<int>(members.size());
    child.rank = static_cast<int>(
        std::find(members.begin(), members.end(), std::make_pair(key, r)) - members.begin());
    child.timeout = default_timeout();
    // Unique per parent, split and color, so children never collide in the store.
    child.store =
        std::make_shared<PrefixStore>(absl::StrCat("split", ctx.seq, "/color", color), store_);
    absl::StatusOr<std::shared_ptr<Communicator>> made =
        Build(std::string(backend()), child, options_, child.store, factory_);
    if (!made.ok()) {
      return ctx.Error(made.status().code(),
                       absl::StrCat("creating the communicator of color ", color, " (rank ",
                                    child.rank, "/", child.size, "): ", made.status().message()));
    }
    return made;
  }

 private:
  using OpFn = std::function<absl::Status(const algo::Context&)>;
  struct Op {
    OpContext ctx;
    OpFn run;
    WorkCompleter done;
  };

  TransportCommunicator(std::string backend, const CommConfig& config, algo::Options options,
                        std::shared_ptr<Store> store, TransportFactory factory,
                        std::unique_ptr<Transport> transport)
      : Communicator(config.rank, config.size, std::move(backend), config.timeout),
        config_(config),
        options_(options),
        store_(std::move(store)),
        factory_(std::move(factory)),
        transport_(std::move(transport)) {
    if (config.size > 1 && options.heartbeat_ms > 0) {
      HeartbeatMonitor::Options hb;
      hb.interval = absl::Milliseconds(options.heartbeat_ms);
      hb.stall_timeout = algo::EffectiveStallTimeout(options, config.timeout);
      for (int p = 0; p < config.size; ++p) hb.peer_addresses.push_back(transport_->PeerAddress(p));
      Transport* t = transport_.get();
      heartbeat_ = std::make_unique<HeartbeatMonitor>(
          store_, config.rank, config.size, hb, [t](const absl::Status& s) { t->Cancel(s); });
    }
    worker_ = std::thread([this] {
      // Named so that top -H, perf and /proc/<pid>/task/*/comm tell it from the training
      // thread (the kernel keeps 15 characters): "fs-comm tcp".
      pthread_setname_np(pthread_self(),
                         absl::StrCat("fs-comm ", this->backend()).substr(0, 15).c_str());
      WorkerLoop();
    });
  }

  std::string Who() const {
    return absl::StrCat("rank ", rank(), "/", size(), " [", backend(), "]");
  }

  // The longest the worker can take to finish what is running and queued now.
  absl::Duration QueuedTimeBudget() {
    absl::MutexLock lock(&mu_);
    absl::Duration budget = running_ ? running_timeout_ : absl::ZeroDuration();
    for (const Op& op : queue_) budget += op.ctx.timeout;
    return budget;
  }

  Work Enqueue(const OpContext& ctx, OpFn run) {
    auto [work, done] = Work::Pending(ctx.Label());
    absl::MutexLock lock(&mu_);
    if (!error_.ok()) {
      // Name this op too: the stored error may come from the idle poll ("(idle): peer 1
      // closed the connection") and say nothing about what the caller just issued.
      done.Complete(ctx.Error(error_.code(), absl::StrCat("not run, the communicator is broken: ",
                                                          error_.message())));
    } else {
      queue_.push_back({ctx, std::move(run), done});
    }
    return work;
  }

  void FailQueueLocked(const absl::Status& error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (Op& op : queue_) {
      op.done.Complete(op.ctx.Error(
          error.code(), absl::StrCat("not run, the communicator is broken: ", error.message())));
    }
    queue_.clear();
  }

  // Makes `error` the communicator's error unless it already has one; returns the one it has.
  absl::Status Break(const absl::Status& error) {
    absl::MutexLock lock(&mu_);
    if (error_.ok()) {
      error_ = error;
      FailQueueLocked(error);
      FS_LOG(WARNING) << "communicator broken: " << error;
    }
    return error_;
  }

  void WorkerLoop() {
    base::ScopedLogRank log_rank(rank(), size());
    for (;;) {
      std::optional<Op> op;
      absl::Status shut_down_with;
      bool poll = false;
      {
        absl::MutexLock lock(&mu_);
        auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return !queue_.empty() || stopping_ || (!error_.ok() && !shut_down_);
        };
        mu_.AwaitWithTimeout(absl::Condition(&wake), kIdlePollInterval);
        if (!error_.ok() && !shut_down_) {
          shut_down_ = true;
          shut_down_with = error_;
        } else if (!queue_.empty()) {
          op.emplace(std::move(queue_.front()));
          queue_.pop_front();
          running_ = true;
          running_timeout_ = op->ctx.timeout;
        } else if (stopping_) {
          return;
        } else {
          poll = error_.ok() && size() > 1;
        }
      }
      if (!shut_down_with.ok()) {
        // Tell the peers, so they fail fast with this reason instead of timing out.
        transport_->Shutdown(shut_down_with);
      } else if (op.has_value()) {
        RunOp(*op);
      } else if (poll) {
        absl::Status s = transport_->Poll();
        if (!s.ok())
          (void)Break(absl::Status(s.code(), absl::StrCat(Who(), " (idle): ", s.message())));
      }
    }
  }

  void RunOp(Op& op) {
    algo::Context actx;
    actx.transport = transport_.get();
    // Send and Recv share one tag space (OpType::kSend, per-peer sequence) so both sides agree.
    actx.tag = MakeTag(op.ctx.type == OpType::kRecv ? OpType::kSend : op.ctx.type, op.ctx.seq,
                       op.ctx.signature);
    actx.deadline = absl::Now() + op.ctx.timeout;
    actx.options = options_;
    actx.scratch = &scratch_;
    if (heartbeat_ != nullptr) heartbeat_->OperationStarted();
    const absl::Status s = op.run(actx);
    if (heartbeat_ != nullptr) heartbeat_->OperationFinished();
    if (s.ok()) {
      {
        absl::MutexLock lock(&mu_);
        running_ = false;
      }
      op.done.Complete(s);
      return;
    }
    // Reasons this communicator made up itself (Abort, destruction) already name the rank.
    absl::string_view reason = s.message();
    absl::ConsumePrefix(&reason, absl::StrCat(Who(), ": "));
    std::string message(reason);
    if (s.code() == absl::StatusCode::kDeadlineExceeded) {
      absl::StrAppend(&message, " (timeout ", absl::FormatDuration(op.ctx.timeout), ")");
    }
    const absl::Status error = op.ctx.Error(s.code(), message);
    const absl::Status first = Break(error);
    bool shut_down_now = false;
    {
      absl::MutexLock lock(&mu_);
      running_ = false;
      if (!shut_down_) shut_down_now = shut_down_ = true;
    }
    // Shut down before completing the Work: afterwards no peer can touch this op's buffers,
    // which the caller may free as soon as Wait() returns.
    if (shut_down_now) transport_->Shutdown(first);
    op.done.Complete(error);
  }

  const CommConfig config_;
  const algo::Options options_;
  const std::shared_ptr<Store> store_;  // this communicator's namespace
  const TransportFactory factory_;
  const std::unique_ptr<Transport> transport_;
  algo::Scratch scratch_;  // worker thread only
  // After transport_: destroyed (disarmed) first. Null at size 1 or with algo.heartbeat_ms=0.
  std::unique_ptr<HeartbeatMonitor> heartbeat_;

  mutable absl::Mutex mu_;
  std::deque<Op> queue_ ABSL_GUARDED_BY(mu_);
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  absl::Duration running_timeout_ ABSL_GUARDED_BY(mu_);
  // Set once Transport::Shutdown has been (or is being) called.
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  std::thread worker_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<Communicator>> CreateTransportCommunicator(
    std::string backend, const CommConfig& config, TransportFactory factory) {
  const std::string who = absl::StrCat("rank ", config.rank, "/", config.size);
  const std::string prefix = absl::StrCat("[", backend, "] ", who, ": ");
  // A message that names this rank already ("tcp rendezvous rank 3/4: ...") gets the backend only.
  auto fail = [&prefix, &backend, &who](const absl::Status& s) {
    const bool named = absl::StrContains(s.message(), who);
    return absl::Status(s.code(), absl::StrCat(named ? absl::StrCat("[", backend, "] ") : prefix,
                                               s.message()));
  };
  if (config.size < 1 || config.rank < 0 || config.rank >= config.size) {
    return fail(absl::InvalidArgumentError("invalid rank/size"));
  }
  if (config.timeout <= absl::ZeroDuration()) {
    return fail(absl::InvalidArgumentError("timeout must be positive"));
  }
  if (!factory) return fail(absl::InvalidArgumentError("no transport factory"));
  absl::StatusOr<algo::Options> options = algo::ParseOptions(config.options);
  if (!options.ok()) return fail(options.status());
  std::shared_ptr<Store> store = config.store;
  if (store == nullptr) {
    if (config.size > 1) {
      return fail(absl::InvalidArgumentError("CommConfig::store is required when size > 1"));
    }
    store = std::make_shared<HashStore>();
  }
  // The k-th communicator this rank creates under `name` uses namespace k; ranks that create
  // their communicators in the same order agree on it, and several never collide.
  const std::string name = config.name.empty() ? "default" : config.name;
  absl::StatusOr<int64_t> generation =
      store->Add(absl::StrCat("fscomm/", name, "/gen/", config.rank), 1);
  if (!generation.ok()) return fail(generation.status());
  auto ns = std::make_shared<PrefixStore>(absl::StrCat("fscomm/", name, "/", *generation), store);
  absl::StatusOr<std::shared_ptr<Communicator>> comm = TransportCommunicator::Build(
      std::move(backend), config, *options, std::move(ns), std::move(factory));
  if (!comm.ok()) return fail(comm.status());
  return comm;
}

}  // namespace fairscale::comm
