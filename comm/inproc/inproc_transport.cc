#include "comm/inproc/inproc_transport.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"

namespace fairscale::comm {
namespace {

constexpr char kDomainKey[] = "inproc/domain";

struct Posted {
  enum class State { kQueued, kCopying, kDone };
  Transport::Request id = 0;
  int owner = 0;  // rank that posted it
  bool is_send = false;
  int peer = 0;
  uint64_t tag = 0;
  void* data = nullptr;  // const for sends
  size_t bytes = 0;
  State state = State::kQueued;
  absl::Status status;
};

// The shared state of one communicator's ranks. One mutex guards everything; the copy itself
// runs outside it, so the lock is only held for queue operations.
class Domain {
 public:
  Domain(std::string id, int size)
      : id_(std::move(id)), size_(size), pairs_(size * size), ranks_(size) {}
  ~Domain();

  const std::string& id() const { return id_; }
  int size() const { return size_; }

  absl::Mutex mu;

  // Posted and not yet matched, per ordered pair (src, dst).
  struct Pair {
    std::deque<Posted*> sends;
    std::deque<Posted*> recvs;
  };
  Pair& pair(int src, int dst) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return pairs_[src * size_ + dst];
  }

  struct RankState {
    absl::CondVar cv;  // signalled when anything this rank may wait for changes
    bool joined = false;
    bool closed = false;  // shut down: nothing more can be sent to or received from it
    std::string closed_reason;
    absl::Status failure;  // the error it shut down with (OK for a normal close)
    uint64_t failure_order = 0;  // when it failed, to report the first failure of a cascade
    int copying = 0;       // its requests being copied right now
  };
  RankState& rank(int r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return ranks_[r]; }
  uint64_t NextFailureOrder() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return ++failures_; }

 private:
  const std::string id_;
  const int size_;
  std::vector<Pair> pairs_ ABSL_GUARDED_BY(mu);
  std::vector<RankState> ranks_ ABSL_GUARDED_BY(mu);
  uint64_t failures_ ABSL_GUARDED_BY(mu) = 0;
};

// Process-global registry of live domains (leaked: ranks may join during static destruction).
struct Registry {
  absl::Mutex mu;
  absl::flat_hash_map<std::string, std::weak_ptr<Domain>> domains ABSL_GUARDED_BY(mu);
};
Registry& GetRegistry() {
  static Registry* registry = new Registry();
  return *registry;
}

Domain::~Domain() {
  Registry& reg = GetRegistry();
  absl::MutexLock lock(&reg.mu);
  auto it = reg.domains.find(id_);
  if (it != reg.domains.end() && it->second.expired()) reg.domains.erase(it);
}

std::string RandomId() {
  std::random_device rd;
  const uint64_t hi = rd();
  const uint64_t lo = rd();
  return absl::StrCat(absl::Hex((hi << 32) | lo, absl::kZeroPad16));
}

std::string Describe(const Posted& r) {
  return absl::StrCat(r.is_send ? "send to" : "recv from", " peer ", r.peer, " (",
                      DescribeTag(r.tag), ", ", r.bytes, " bytes)");
}

class InprocTransport final : public Transport {
 public:
  InprocTransport(std::shared_ptr<Domain> domain, int rank)
      : d_(std::move(domain)), rank_(rank), size_(d_->size()) {}

  ~InprocTransport() override {
    Shutdown(absl::OkStatus());
    absl::MutexLock lock(&d_->mu);
    d_->rank(rank_).joined = false;
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Request Isend(int peer, uint64_t tag, const void* data, size_t bytes) override {
    return Post(/*is_send=*/true, peer, tag, const_cast<void*>(data), bytes);
  }
  Request Irecv(int peer, uint64_t tag, void* data, size_t bytes) override {
    return Post(/*is_send=*/false, peer, tag, data, bytes);
  }

  absl::Status Wait(absl::Span<const Request> requests, absl::Time deadline) override {
    absl::MutexLock lock(&d_->mu);
    for (;;) {
      if (!broken_.ok()) return broken_;
      bool all_done = true;
      for (Request id : requests) {
        auto it = requests_.find(id);
        if (it == requests_.end()) {
          return BreakLocked(absl::InternalError(absl::StrCat("unknown request ", id)));
        }
        const Posted& r = *it->second;
        if (r.state != Posted::State::kDone) {
          all_done = false;
        } else if (!r.status.ok()) {
          // A peer's shutdown (kUnavailable) may be the echo of a mismatch this rank's own
          // requests already recorded; report the local finding, it names both sides.
          absl::Status own = OwnFailureLocked();
          return BreakLocked(r.status.code() == absl::StatusCode::kUnavailable && !own.ok() &&
                                     own.code() != absl::StatusCode::kUnavailable
                                 ? own
                                 : r.status);
        }
      }
      if (all_done) {
        for (Request id : requests) requests_.erase(id);
        return absl::OkStatus();
      }
      // A failure already recorded on any of this rank's own requests (e.g. a mismatch found
      // while matching a send that is not among `requests`) explains more than the peer's
      // shutdown that it caused, so it wins over TroubleLocked().
      absl::Status own = OwnFailureLocked();
      if (!own.ok()) return BreakLocked(own);
      absl::Status trouble = TroubleLocked();
      if (!trouble.ok()) return BreakLocked(trouble);
      if (absl::Now() >= deadline) {
        std::vector<std::string> pending;
        for (Request id : requests) {
          const Posted& r = *requests_.at(id);
          if (r.state != Posted::State::kDone) pending.push_back(Describe(r));
        }
        return BreakLocked(absl::DeadlineExceededError(
            absl::StrCat("deadline passed while waiting for ", absl::StrJoin(pending, ", "))));
      }
      d_->rank(rank_).cv.WaitWithDeadline(&d_->mu, deadline);
    }
  }

  absl::Status Poll() override {
    absl::MutexLock lock(&d_->mu);
    if (!broken_.ok()) return broken_;
    absl::Status trouble = TroubleLocked();
    if (!trouble.ok()) return BreakLocked(trouble);
    return absl::OkStatus();
  }

  void Cancel(const absl::Status& reason) override {
    absl::MutexLock lock(&d_->mu);
    if (cancel_.ok()) cancel_ = reason.ok() ? absl::CancelledError("cancelled") : reason;
    d_->rank(rank_).cv.SignalAll();
  }

  void Shutdown(const absl::Status& reason) override {
    absl::MutexLock lock(&d_->mu);
    if (shut_down_) return;
    shut_down_ = true;
    (void)BreakLocked(reason.ok() ? absl::FailedPreconditionError("the transport was shut down")
                                  : reason);
    Domain::RankState& me = d_->rank(rank_);
    me.closed = true;
    me.failure = reason;
    if (!reason.ok()) me.failure_order = d_->NextFailureOrder();
    me.closed_reason = reason.ok() ? "its communicator was destroyed" : reason.ToString();
    const absl::Status gone = PeerGone(rank_, me.closed_reason);
    // Fail what peers posted towards this rank; they would otherwise wait for their deadline.
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      for (auto* q : {&d_->pair(p, rank_).sends, &d_->pair(rank_, p).recvs}) {
        for (Posted* r : *q) FinishLocked(r, gone);
        q->clear();
      }
      d_->rank(p).cv.SignalAll();
    }
  }

 private:
  static absl::Status PeerGone(int peer, absl::string_view reason) {
    return absl::UnavailableError(absl::StrCat("peer ", peer, " shut down: ", reason));
  }

  Request Post(bool is_send, int peer, uint64_t tag, void* data, size_t bytes) {
    absl::MutexLock lock(&d_->mu);
    auto owned = std::make_unique<Posted>();
    Posted* r = owned.get();
    r->id = next_id_++;
    r->owner = rank_;
    r->is_send = is_send;
    r->peer = peer;
    r->tag = tag;
    r->data = data;
    r->bytes = bytes;
    requests_.emplace(r->id, std::move(owned));
    if (!broken_.ok()) {
      FinishLocked(r, broken_);
    } else if (peer < 0 || peer >= size_ || peer == rank_) {
      FinishLocked(r, absl::InvalidArgumentError(
                          absl::StrCat(is_send ? "send to" : "recv from", " invalid peer ", peer)));
    } else if (d_->rank(peer).closed) {
      FinishLocked(r, PeerGone(peer, d_->rank(peer).closed_reason));
    } else {
      Domain::Pair& pair = is_send ? d_->pair(rank_, peer) : d_->pair(peer, rank_);
      auto& mine = is_send ? pair.sends : pair.recvs;
      auto& theirs = is_send ? pair.recvs : pair.sends;
      if (mine.empty() && !theirs.empty()) {
        Posted* other = theirs.front();
        theirs.pop_front();
        MatchLocked(is_send ? r : other, is_send ? other : r);
      } else {
        mine.push_back(r);
      }
    }
    return r->id;
  }

  // Completes a matched pair: checks tag and size, copies outside the lock, finishes both.
  void MatchLocked(Posted* send, Posted* recv) ABSL_EXCLUSIVE_LOCKS_REQUIRED(d_->mu) {
    if (send->tag != recv->tag || send->bytes != recv->bytes) {
      const std::string sent =
          absl::StrCat(DescribeTag(send->tag), " with ", send->bytes, " bytes");
      const std::string expected =
          absl::StrCat(DescribeTag(recv->tag), " with ", recv->bytes, " bytes");
      FinishLocked(recv, absl::InvalidArgumentError(absl::StrCat(
                             "message from peer ", send->owner,
                             " does not match the receive: expected ", expected, ", got ", sent)));
      FinishLocked(send, absl::InvalidArgumentError(absl::StrCat(
                             "message to peer ", recv->owner, " does not match its receive: sent ",
                             sent, ", the peer expected ", expected)));
      return;
    }
    send->state = recv->state = Posted::State::kCopying;
    ++d_->rank(send->owner).copying;
    ++d_->rank(recv->owner).copying;
    d_->mu.Unlock();
    if (send->bytes > 0) std::memcpy(recv->data, send->data, send->bytes);
    d_->mu.Lock();
    --d_->rank(send->owner).copying;
    --d_->rank(recv->owner).copying;
    FinishLocked(send, absl::OkStatus());
    FinishLocked(recv, absl::OkStatus());
  }

  void FinishLocked(Posted* r, absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(d_->mu) {
    r->state = Posted::State::kDone;
    r->status = std::move(status);
    d_->rank(r->owner).cv.SignalAll();
  }

  // A Cancel() or a peer that shut down with an error: the communicator is broken everywhere.
  // Of several failed peers the first one to fail is named: the others usually failed because
  // of it.
  // The error recorded on one of this rank's own requests, preferring one found here (any code
  // but kUnavailable) over a peer's shutdown.
  absl::Status OwnFailureLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(d_->mu) {
    absl::Status found;
    for (const auto& [id, owned] : requests_) {
      if (owned->state != Posted::State::kDone || owned->status.ok()) continue;
      if (owned->status.code() != absl::StatusCode::kUnavailable) return owned->status;
      if (found.ok()) found = owned->status;
    }
    return found;
  }

  absl::Status TroubleLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(d_->mu) {
    if (!cancel_.ok()) return cancel_;
    int first = -1;
    for (int p = 0; p < size_; ++p) {
      const Domain::RankState& s = d_->rank(p);
      if (p == rank_ || s.failure.ok()) continue;
      if (first < 0 || s.failure_order < d_->rank(first).failure_order) first = p;
    }
    if (first >= 0) return PeerGone(first, d_->rank(first).closed_reason);
    return absl::OkStatus();
  }

  // Makes `error` final: withdraws this rank's unmatched requests from the queues and waits
  // for copies into or out of its buffers to finish, so that no peer touches them afterwards.
  absl::Status BreakLocked(absl::Status error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(d_->mu) {
    if (!broken_.ok()) return broken_;
    broken_ = std::move(error);
    for (auto& [id, owned] : requests_) {
      Posted* r = owned.get();
      if (r->state != Posted::State::kQueued) continue;
      Domain::Pair& pair = r->is_send ? d_->pair(rank_, r->peer) : d_->pair(r->peer, rank_);
      auto& q = r->is_send ? pair.sends : pair.recvs;
      q.erase(std::remove(q.begin(), q.end(), r), q.end());
      FinishLocked(r, broken_);
    }
    Domain::RankState& me = d_->rank(rank_);
    while (me.copying > 0) me.cv.Wait(&d_->mu);
    requests_.clear();
    return broken_;
  }

  const std::shared_ptr<Domain> d_;
  const int rank_;
  const int size_;
  // Guarded by d_->mu (the annotation cannot name a member of a member).
  absl::flat_hash_map<Request, std::unique_ptr<Posted>> requests_;
  Request next_id_ = 1;
  absl::Status broken_;
  absl::Status cancel_;
  bool shut_down_ = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateInprocTransport(std::shared_ptr<Store> store,
                                                                 int rank, int size,
                                                                 absl::Duration timeout) {
  if (store == nullptr) return absl::InvalidArgumentError("inproc: no store");
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("inproc: invalid rank ", rank, " of ", size));
  }
  Registry& reg = GetRegistry();
  std::shared_ptr<Domain> domain;
  if (rank == 0) {
    domain = std::make_shared<Domain>(RandomId(), size);
    {
      absl::MutexLock lock(&reg.mu);
      reg.domains[domain->id()] = domain;
    }
    absl::Status set = store->Set(kDomainKey, domain->id());
    if (!set.ok()) return set;
  } else {
    absl::StatusOr<std::string> id = store->Get(kDomainKey, timeout);
    if (!id.ok()) {
      return absl::Status(id.status().code(),
                          absl::StrCat("inproc: waiting for rank 0 to publish its domain: ",
                                       id.status().message()));
    }
    absl::MutexLock lock(&reg.mu);
    auto it = reg.domains.find(*id);
    if (it != reg.domains.end()) domain = it->second.lock();
    if (domain == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("inproc: domain ", *id,
                       " is gone (rank 0 is in another process, or its "
                       "communicator was already destroyed)"));
    }
  }
  absl::MutexLock lock(&domain->mu);
  if (domain->size() != size) {
    return absl::InvalidArgumentError(absl::StrCat("inproc: rank ", rank, " has size ", size,
                                                   " but rank 0 created the domain with size ",
                                                   domain->size()));
  }
  Domain::RankState& me = domain->rank(rank);
  if (me.joined || me.closed) {
    return absl::InvalidArgumentError(
        absl::StrCat("inproc: rank ", rank, " joined domain ", domain->id(), " twice"));
  }
  me.joined = true;
  return std::unique_ptr<Transport>(new InprocTransport(domain, rank));
}

}  // namespace fairscale::comm
