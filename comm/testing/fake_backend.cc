// "fake": a deliberately simple in-process backend that runs the conformance suite's own tests
// (//comm/testing:fake_conformance_test), so that a failure of a real backend's conformance test
// can be told apart from a bug of the suite. Thread ranks only (the group lives in process
// memory, found by the address of the shared store). Every operation runs on the
// communicator's worker thread: collectives meet in a slot per sequence number where each rank
// leaves a copy of its input, point-to-point messages go through per-pair mailboxes (sends are
// eager). Not a model of performance: reductions decode every element to long double.
#include <algorithm>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "comm/communicator.h"
#include "comm/config.h"
#include "comm/registry.h"
#include "comm/testing/reference.h"

namespace fairscale::comm::testing {
namespace {

// What one rank brings to a collective.
struct Part {
  OpType type = OpType::kBarrier;
  DataType dtype = DataType::kF32;
  ReduceOp op = ReduceOp::kSum;
  int root = -1;
  size_t count = 0;  // send count
  std::vector<uint8_t> data;
  int color = 0;
  int key = 0;
};

std::string Describe(const Part& p) {
  return absl::StrCat(OpTypeName(p.type), " ", DataTypeName(p.dtype), " count ", p.count,
                      p.root >= 0 ? absl::StrCat(" root ", p.root) : "");
}

bool Matches(const Part& a, const Part& b) {
  if (a.type != b.type) return false;
  switch (a.type) {
    case OpType::kBarrier:
    case OpType::kSplit: return true;
    case OpType::kBroadcast: return a.dtype == b.dtype && a.count == b.count && a.root == b.root;
    case OpType::kReduce:
      return a.dtype == b.dtype && a.count == b.count && a.op == b.op && a.root == b.root;
    case OpType::kAllReduce:
    case OpType::kReduceScatter: return a.dtype == b.dtype && a.count == b.count && a.op == b.op;
    default: return a.dtype == b.dtype && a.count == b.count;
  }
}

struct Message {
  DataType dtype;
  size_t count;
  std::vector<uint8_t> data;
};

struct Group;

struct Slot {
  explicit Slot(int n) : parts(n) {}
  std::vector<std::optional<Part>> parts;
  int consumed = 0;
  std::map<int, std::shared_ptr<Group>> children;  // Split: by color
};

struct Group {
  explicit Group(int n) : size(n) {}
  const int size;
  absl::Mutex mu;
  absl::CondVar cv;
  std::map<uint64_t, Slot> slots ABSL_GUARDED_BY(mu);
  std::map<std::pair<int, int>, std::deque<Message>> mail ABSL_GUARDED_BY(mu);
  // The first failure anywhere in the group and the rank it happened on.
  absl::Status error ABSL_GUARDED_BY(mu);
  int failed_rank ABSL_GUARDED_BY(mu) = -1;
};

// Groups by key ("<store address>/<name>"); weak, so a finished test leaves nothing behind.
std::shared_ptr<Group> FindGroup(const std::string& key, int size) {
  static absl::Mutex mu(absl::kConstInit);
  static auto* groups ABSL_PT_GUARDED_BY(mu) = new std::map<std::string, std::weak_ptr<Group>>();
  absl::MutexLock lock(&mu);
  std::shared_ptr<Group> g = (*groups)[key].lock();
  if (g == nullptr || g->size != size) {
    g = std::make_shared<Group>(size);
    (*groups)[key] = g;
  }
  return g;
}

long double Combine(ReduceOp op, long double a, long double b) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return a + b;
    case ReduceOp::kProduct: return a * b;
    case ReduceOp::kMin: return std::min(a, b);
    case ReduceOp::kMax: return std::max(a, b);
  }
  return a;
}

template <typename T>
void ReduceTyped(const std::vector<std::optional<Part>>& parts, ReduceOp op, size_t offset,
                 size_t count, void* out) {
  const int n = static_cast<int>(parts.size());
  T* dst = static_cast<T*>(out);
  const T* first = reinterpret_cast<const T*>(parts[0]->data.data()) + offset;
  std::copy(first, first + count, dst);
  for (int p = 1; p < n; ++p) {
    const T* src = reinterpret_cast<const T*>(parts[p]->data.data()) + offset;
    for (size_t i = 0; i < count; ++i) {
      dst[i] = static_cast<T>(Combine(op, dst[i], src[i]));
    }
  }
  if (op == ReduceOp::kAvg) {
    for (size_t i = 0; i < count; ++i) dst[i] = static_cast<T>(dst[i] / n);
  }
}

// out[i] = reduction over parts of element (offset + i).
void ReduceInto(const std::vector<std::optional<Part>>& parts, DataType dtype, ReduceOp op,
                size_t offset, size_t count, void* out) {
  switch (dtype) {
    case DataType::kF32: return ReduceTyped<float>(parts, op, offset, count, out);
    case DataType::kF64: return ReduceTyped<double>(parts, op, offset, count, out);
    case DataType::kI32: return ReduceTyped<int32_t>(parts, op, offset, count, out);
    case DataType::kI64: return ReduceTyped<int64_t>(parts, op, offset, count, out);
    default: break;
  }
  const size_t es = SizeOf(dtype);
  const int n = static_cast<int>(parts.size());
  for (size_t i = 0; i < count; ++i) {
    long double acc = DecodeValue(dtype, parts[0]->data.data() + (offset + i) * es);
    for (int p = 1; p < n; ++p) {
      acc = Combine(op, acc, DecodeValue(dtype, parts[p]->data.data() + (offset + i) * es));
    }
    if (op == ReduceOp::kAvg) acc /= n;
    EncodeValue(dtype, acc, static_cast<uint8_t*>(out) + i * es);
  }
}

std::vector<uint8_t> Copy(ConstBuffer b) {
  const auto* p = static_cast<const uint8_t*>(b.data);
  return std::vector<uint8_t>(p, p + b.bytes());
}

class FakeComm : public Communicator {
 public:
  FakeComm(int rank, int size, absl::Duration timeout, std::string key,
           std::shared_ptr<Group> group)
      : Communicator(rank, size, "fake", timeout),
        key_(std::move(key)),
        group_(std::move(group)),
        worker_([this] { Loop(); }) {}

  ~FakeComm() override {
    {
      absl::MutexLock lock(&queue_mu_);
      stop_ = true;
    }
    worker_.join();
  }

  void Abort(absl::Status reason) override {
    if (reason.ok()) reason = absl::AbortedError("Abort() called");
    absl::MutexLock lock(&group_->mu);
    if (!local_error_.ok()) return;
    local_error_ = reason;
    if (group_->error.ok()) {
      group_->error = absl::UnavailableError(
          absl::StrCat("peer ", rank(), " aborted: ", reason.ToString()));
      group_->failed_rank = rank();
    }
    group_->cv.SignalAll();
  }

  absl::Status status() const override {
    absl::MutexLock lock(&group_->mu);
    if (!local_error_.ok()) return local_error_;
    if (!group_->error.ok()) return FromPeer(nullptr);
    return absl::OkStatus();
  }

 protected:
  Work DoAllReduce(const OpContext& ctx, ConstBuffer send, Buffer recv, ReduceOp op) override {
    Part p = MakePart(ctx, send);
    p.op = op;
    return Enqueue(ctx, std::move(p), [recv, op](const Slot& s, int) {
      ReduceInto(s.parts, recv.dtype, op, 0, recv.count, recv.data);
    });
  }
  Work DoReduceScatter(const OpContext& ctx, ConstBuffer send, Buffer recv,
                       ReduceOp op) override {
    Part p = MakePart(ctx, send);
    p.op = op;
    return Enqueue(ctx, std::move(p), [recv, op](const Slot& s, int rank) {
      ReduceInto(s.parts, recv.dtype, op, rank * recv.count, recv.count, recv.data);
    });
  }
  Work DoAllGather(const OpContext& ctx, ConstBuffer send, Buffer recv) override {
    return Enqueue(ctx, MakePart(ctx, send), [recv](const Slot& s, int) {
      auto* out = static_cast<uint8_t*>(recv.data);
      for (const auto& part : s.parts) {
        std::copy(part->data.begin(), part->data.end(), out);
        out += part->data.size();
      }
    });
  }
  Work DoBroadcast(const OpContext& ctx, Buffer buffer, int root) override {
    Part p = MakePart(ctx, buffer);
    p.root = root;
    return Enqueue(ctx, std::move(p), [buffer, root](const Slot& s, int) {
      std::copy(s.parts[root]->data.begin(), s.parts[root]->data.end(),
                static_cast<uint8_t*>(buffer.data));
    });
  }
  Work DoReduce(const OpContext& ctx, ConstBuffer send, Buffer recv, ReduceOp op,
                int root) override {
    Part p = MakePart(ctx, send);
    p.op = op;
    p.root = root;
    return Enqueue(ctx, std::move(p), [recv, op, root, send](const Slot& s, int rank) {
      if (rank == root) ReduceInto(s.parts, send.dtype, op, 0, send.count, recv.data);
    });
  }
  Work DoAllToAll(const OpContext& ctx, ConstBuffer send, Buffer recv) override {
    return Enqueue(ctx, MakePart(ctx, send), [recv](const Slot& s, int rank) {
      const size_t block = recv.bytes() / s.parts.size();
      auto* out = static_cast<uint8_t*>(recv.data);
      for (size_t i = 0; i < s.parts.size(); ++i) {
        const uint8_t* from = s.parts[i]->data.data() + rank * block;
        std::copy(from, from + block, out + i * block);
      }
    });
  }
  // Sends are eager here, so running the batch's sends before its receives cannot deadlock.
  // The final task runs after every item (the worker runs tasks in order) and reports the first
  // failure.
  Work DoBatchP2P(const OpContext& ctx, std::vector<P2PItem> items) override {
    std::vector<Work> works;
    for (int pass = 0; pass < 2; ++pass) {
      for (const P2PItem& item : items) {
        if (item.op.is_send != (pass == 0)) continue;
        OpContext c = ctx;
        c.type = item.op.is_send ? OpType::kSend : OpType::kRecv;
        c.seq = item.seq;
        works.push_back(item.op.is_send ? DoSend(c, item.op.buffer, item.op.peer)
                                        : DoRecv(c, item.op.buffer, item.op.peer));
      }
    }
    return Submit(ctx, [works](const OpContext&) {
      for (const Work& w : works) {
        absl::Status s = w.Wait(absl::ZeroDuration());
        if (!s.ok()) return s;
      }
      return absl::OkStatus();
    });
  }
  Work DoSend(const OpContext& ctx, ConstBuffer buffer, int peer) override {
    Message m{buffer.dtype, buffer.count, Copy(buffer)};
    return Submit(ctx, [this, m = std::move(m), peer](const OpContext&) mutable {
      absl::MutexLock lock(&group_->mu);
      if (absl::Status s = BrokenLocked(); !s.ok()) return s;
      group_->mail[{rank(), peer}].push_back(std::move(m));
      group_->cv.SignalAll();
      return absl::OkStatus();
    });
  }
  Work DoRecv(const OpContext& ctx, Buffer buffer, int peer) override {
    return Submit(ctx, [this, buffer, peer](const OpContext& c) {
      const absl::Time deadline = absl::Now() + c.timeout;
      absl::MutexLock lock(&group_->mu);
      auto& box = group_->mail[{peer, rank()}];
      while (true) {
        if (absl::Status s = BrokenLocked(&c); !s.ok()) return s;
        if (!box.empty()) break;
        if (group_->cv.WaitWithDeadline(&group_->mu, deadline) && box.empty()) {
          return FailLocked(c.Error(absl::StatusCode::kDeadlineExceeded,
                                    absl::StrCat("no message from peer ", peer)));
        }
      }
      Message m = std::move(box.front());
      box.pop_front();
      if (m.dtype != buffer.dtype || m.count != buffer.count) {
        return FailLocked(c.Error(
            absl::StatusCode::kInvalidArgument,
            absl::StrCat("peer ", peer, " sent ", DataTypeName(m.dtype), " count ", m.count,
                         " but this rank receives ", DataTypeName(buffer.dtype), " count ",
                         buffer.count)));
      }
      std::copy(m.data.begin(), m.data.end(), static_cast<uint8_t*>(buffer.data));
      return absl::OkStatus();
    });
  }
  Work DoBarrier(const OpContext& ctx) override {
    return Enqueue(ctx, MakePart(ctx, ConstBuffer()), [](const Slot&, int) {});
  }
  absl::StatusOr<std::shared_ptr<Communicator>> DoSplit(const OpContext& ctx, int color,
                                                        int key) override {
    Part p = MakePart(ctx, ConstBuffer());
    p.color = color;
    p.key = key;
    std::shared_ptr<Communicator> child;
    const std::string child_key = absl::StrCat(key_, "/split", ctx.seq, "/", color);
    const absl::Duration timeout = default_timeout();
    Work work = Enqueue(ctx, std::move(p), [&, color](const Slot& s, int rank) {
      if (color < 0) return;
      std::vector<std::pair<std::pair<int, int>, int>> members;  // ((key, rank), rank)
      for (int r = 0; r < static_cast<int>(s.parts.size()); ++r) {
        if (s.parts[r]->color == color) members.push_back({{s.parts[r]->key, r}, r});
      }
      std::sort(members.begin(), members.end());
      int my = 0;
      for (size_t i = 0; i < members.size(); ++i) {
        if (members[i].second == rank) my = static_cast<int>(i);
      }
      const int n = static_cast<int>(members.size());
      child = std::make_shared<FakeComm>(my, n, timeout, child_key,
                                         FindGroup(child_key, n));
    });
    absl::Status s = work.Wait();
    if (!s.ok()) return s;
    return child;
  }

 private:
  using Task = std::function<absl::Status(const OpContext&)>;
  struct Queued {
    OpContext ctx;
    Task task;
    WorkCompleter done;
  };

  Part MakePart(const OpContext& ctx, ConstBuffer send) {
    Part p;
    p.type = ctx.type;
    p.dtype = send.dtype;
    p.count = send.count;
    p.data = Copy(send);
    return p;
  }

  Work Submit(const OpContext& ctx, Task task) {
    auto [work, completer] = Work::Pending(ctx.Label());
    absl::MutexLock lock(&queue_mu_);
    queue_.push_back({ctx, std::move(task), completer});
    return work;
  }

  // A collective: leave this rank's part in the slot of ctx.seq, wait for the others, then
  // `finish` computes this rank's result from all parts.
  Work Enqueue(const OpContext& ctx, Part part,
               std::function<void(const Slot&, int rank)> finish) {
    return Submit(ctx, [this, part = std::move(part), finish = std::move(finish)](
                           const OpContext& c) mutable -> absl::Status {
      const absl::Time deadline = absl::Now() + c.timeout;
      absl::MutexLock lock(&group_->mu);
      if (absl::Status s = BrokenLocked(&c); !s.ok()) return s;
      Slot& slot = group_->slots.try_emplace(c.seq, size()).first->second;
      slot.parts[rank()] = std::move(part);
      group_->cv.SignalAll();
      while (true) {
        // A mismatch this rank can see is reported as such, naming the peer.
        const Part& mine = *slot.parts[rank()];
        for (int p = 0; p < size(); ++p) {
          if (p != rank() && slot.parts[p] && !Matches(mine, *slot.parts[p])) {
            return FailLocked(c.Error(absl::StatusCode::kInvalidArgument,
                                      absl::StrCat("peer ", p, " issued ",
                                                   Describe(*slot.parts[p]), ", this rank ",
                                                   Describe(mine))));
          }
        }
        // Complete before broken: the peers may have finished this op and failed a later one
        // before this rank woke up.
        std::vector<int> missing;
        for (int p = 0; p < size(); ++p) {
          if (!slot.parts[p]) missing.push_back(p);
        }
        if (missing.empty()) break;
        if (absl::Status s = BrokenLocked(&c); !s.ok()) return s;
        if (group_->cv.WaitWithDeadline(&group_->mu, deadline) && absl::Now() >= deadline) {
          return FailLocked(c.Error(absl::StatusCode::kDeadlineExceeded,
                                    absl::StrCat("waited ", absl::FormatDuration(c.timeout),
                                                 " for peer ", absl::StrJoin(missing, ", peer "))));
        }
      }
      finish(slot, rank());
      if (++slot.consumed == size()) group_->slots.erase(c.seq);
      return absl::OkStatus();
    });
  }

  // The error of a peer's failure, as this rank reports it.
  absl::Status FromPeer(const OpContext* ctx) const ABSL_SHARED_LOCKS_REQUIRED(group_->mu) {
    const std::string msg =
        absl::StrCat("peer ", group_->failed_rank, " failed: ", group_->error.message());
    if (ctx != nullptr) return ctx->Error(absl::StatusCode::kUnavailable, msg);
    return absl::UnavailableError(msg);
  }

  absl::Status BrokenLocked(const OpContext* ctx = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(group_->mu) {
    if (!local_error_.ok()) return local_error_;
    if (!group_->error.ok()) {
      local_error_ = FromPeer(ctx);
      return local_error_;
    }
    return absl::OkStatus();
  }

  absl::Status FailLocked(absl::Status s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(group_->mu) {
    if (local_error_.ok()) local_error_ = s;
    if (group_->error.ok()) {
      group_->error = s;
      group_->failed_rank = rank();
    }
    group_->cv.SignalAll();
    return local_error_;
  }

  void Loop() {
    while (true) {
      Queued q;
      {
        absl::MutexLock lock(&queue_mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(queue_mu_) {
          return stop_ || !queue_.empty();
        };
        queue_mu_.Await(absl::Condition(&ready));
        if (queue_.empty()) return;  // stop_ and drained
        q = std::move(queue_.front());
        queue_.pop_front();
      }
      q.done.Complete(q.task(q.ctx));
    }
  }

  const std::string key_;
  const std::shared_ptr<Group> group_;
  absl::Status local_error_ ABSL_GUARDED_BY(group_->mu);
  absl::Mutex queue_mu_;
  std::deque<Queued> queue_ ABSL_GUARDED_BY(queue_mu_);
  bool stop_ ABSL_GUARDED_BY(queue_mu_) = false;
  std::thread worker_;
};

absl::StatusOr<std::shared_ptr<Communicator>> CreateFake(const CommConfig& config) {
  if (config.store == nullptr) return absl::InvalidArgumentError("[fake] needs a store");
  const std::string key = absl::StrCat(reinterpret_cast<uintptr_t>(config.store.get()), "/",
                                       config.name.empty() ? "default" : config.name);
  return std::shared_ptr<Communicator>(std::make_shared<FakeComm>(
      config.rank, config.size, config.timeout, key, FindGroup(key, config.size)));
}

const BackendRegistration kRegistration("fake", /*priority=*/-100, &CreateFake);

}  // namespace
}  // namespace fairscale::comm::testing
