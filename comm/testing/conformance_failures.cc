// The failure cases of the conformance suite: errors reach every rank, in time, and leave the
// communicator broken (see conformance.h).
#include "comm/testing/internal/conformance_helpers.h"

namespace fairscale::comm::testing {
namespace {

using namespace conformance_internal;  // NOLINT: the suite's own helpers

// ---------------------------------------------------------------------------------------------
// Observations of failure tests, shared through the store so that one rank can check
// properties that involve several ranks (e.g. "some rank next to the mismatch names its peer").

struct Observation {
  absl::Status status;
  absl::Duration elapsed;
};

constexpr char kObservationKey[] = "fs_conformance/observation/";

absl::Status PublishObservation(Store& store, int rank, const Observation& o) {
  return store.Set(absl::StrCat(kObservationKey, rank),
                   absl::StrCat(static_cast<int>(o.status.code()), "\n",
                                absl::ToInt64Nanoseconds(o.elapsed), "\n", o.status.message()));
}

absl::StatusOr<Observation> ReadObservation(Store& store, int rank) {
  FS_ASSIGN_OR_RETURN(std::string v, store.Get(absl::StrCat(kObservationKey, rank),
                                               kStoreTimeout));
  std::vector<std::string> parts = absl::StrSplit(v, absl::MaxSplits('\n', 2));
  int code = 0;
  int64_t ns = 0;
  if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &code) ||
      !absl::SimpleAtoi(parts[1], &ns)) {
    return absl::InternalError(absl::StrCat("bad observation of rank ", rank, ": ", v));
  }
  return Observation{absl::Status(static_cast<absl::StatusCode>(code), parts[2]),
                     absl::Nanoseconds(ns)};
}

// Publishes this rank's observation exactly once: if the body returns before it observed
// anything (e.g. setup failed), a placeholder goes out so that the other ranks do not wait for it.
// Every rank's published observation (waiting for those not yet published).
absl::StatusOr<std::vector<std::optional<Observation>>> ReadAllObservations(Store& store, int n) {
  std::vector<std::optional<Observation>> all(n);
  for (int r = 0; r < n; ++r) {
    FS_ASSIGN_OR_RETURN(all[r], ReadObservation(store, r));
  }
  return all;
}

class ObservationPublisher {
 public:
  ObservationPublisher(Store& store, int rank) : store_(store), rank_(rank) {}
  ~ObservationPublisher() {
    if (!published_) {
      (void)PublishObservation(
          store_, rank_,
          {absl::InternalError(absl::StrCat("rank ", rank_,
                                            " ended before it observed the failure (see its "
                                            "own status)")),
           absl::ZeroDuration()});
    }
  }
  absl::Status Publish(const Observation& o) {
    published_ = true;
    return PublishObservation(store_, rank_, o);
  }

 private:
  Store& store_;
  const int rank_;
  bool published_ = false;
};

std::string DescribeObservations(const std::vector<std::optional<Observation>>& all) {
  std::string out;
  for (size_t r = 0; r < all.size(); ++r) {
    if (!all[r]) continue;
    absl::StrAppend(&out, "\n    rank ", r, " after ", Fmt(all[r]->elapsed), ": ",
                    all[r]->status.ToString());
  }
  return out;
}

bool Names(const absl::Status& s, absl::string_view text) {
  return absl::StrContains(s.message(), text);
}

std::string PeerName(int peer) { return absl::StrCat("peer ", peer); }

bool IsPeerFailureCode(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kAborted;
}

// After `first` failed an operation, the communicator must stay broken: status() reports the
// error and a later operation fails fast with it. Returns the problems found ("" when none).
std::string CheckBroken(Communicator& comm, const absl::Status& first) {
  const absl::Status st = comm.status();
  if (st.ok()) {
    return absl::StrCat("status() is OK after an operation failed with ", first.ToString());
  }
  std::string problems;
  if (st.code() != first.code()) {
    absl::StrAppend(&problems, "status() is ", st.ToString(), " but the failed op reported ",
                    first.ToString(), "; ");
  }
  const absl::Time start = absl::Now();
  const absl::Status later = comm.Barrier().Wait(kFailFast + kWaitSlack);
  const absl::Duration elapsed = absl::Now() - start;
  if (later.ok()) {
    absl::StrAppend(&problems, "a barrier issued after the failure succeeded; ");
  } else {
    if (later.code() != st.code()) {
      absl::StrAppend(&problems, "a barrier issued after the failure failed with ",
                      later.ToString(), " instead of status() ", st.ToString(), "; ");
    }
    if (elapsed > kBrokenFailFast) {
      absl::StrAppend(&problems, "a barrier issued after the failure took ", Fmt(elapsed),
                      " to fail (limit ", Fmt(kBrokenFailFast), "); ");
    }
  }
  return problems;
}

// Connects, runs a barrier, then waits (through the store, not the backend) until every rank's
// barrier has completed: an error of the op under test breaks the communicator, and a rank still
// finishing the barrier would see the barrier fail too ("every pending operation fails").
absl::StatusOr<std::shared_ptr<Communicator>> ConnectAndSync(const ConformanceParam& p,
                                                             Store& store, int rank, int n) {
  FS_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm, Connect(p, kFailureTimeout));
  FS_RETURN_IF_ERROR(Await(comm->Barrier(), "the barrier before the test", kFailureTimeout));
  FS_RETURN_IF_ERROR(store.Set(absl::StrCat("fs_conformance/ready/", rank), "1"));
  std::vector<std::string> keys;
  for (int r = 0; r < n; ++r) keys.push_back(absl::StrCat("fs_conformance/ready/", r));
  FS_RETURN_IF_ERROR(store.Wait(keys, kStoreTimeout));
  return comm;
}

// Collects a failure test's problems on one rank and turns them into the rank's verdict.
class Problems {
 public:
  void Add(std::string p) {
    if (!p.empty()) list_.push_back(std::move(p));
  }
  absl::Status Verdict(int rank, const std::optional<Observation>& mine,
                       const std::vector<std::optional<Observation>>& all) const {
    if (list_.empty()) return absl::OkStatus();
    return absl::InternalError(absl::StrCat(
        "rank ", rank, ": ", absl::StrJoin(list_, "; "),
        mine ? absl::StrCat("\n  this rank observed after ", Fmt(mine->elapsed), ": ",
                            mine->status.ToString())
             : "",
        all.empty() ? "" : absl::StrCat("\n  all ranks observed:", DescribeObservations(all))));
  }

 private:
  std::vector<std::string> list_;
};

// Problems of an op that a peer made fail (mismatch, abort, death): it must fail well before
// its timeout, with a code in `codes`, naming the op and a peer.
void CheckPeerCausedFailure(Problems& problems, const Observation& o, absl::string_view op,
                            absl::Duration limit,
                            const std::vector<absl::StatusCode>& codes) {
  if (o.status.ok()) {
    problems.Add(absl::StrCat("the ", op, " succeeded but had to fail"));
    return;
  }
  if (std::find(codes.begin(), codes.end(), o.status.code()) == codes.end()) {
    std::vector<std::string> names;
    for (absl::StatusCode c : codes) names.push_back(absl::StatusCodeToString(c));
    problems.Add(absl::StrCat("expected ", absl::StrJoin(names, " or "), ", got ",
                              absl::StatusCodeToString(o.status.code())));
  }
  if (o.elapsed > limit) {
    problems.Add(absl::StrCat("took ", Fmt(o.elapsed), " to fail (limit ", Fmt(limit), ")"));
  }
  if (!Names(o.status, op)) problems.Add(absl::StrCat("the message does not name the op '", op, "'"));
  if (!Names(o.status, "peer ")) problems.Add("the message does not name a peer");
}

// A rank that issues `op` after its peers failed (they timed out or aborted). That op may still
// complete: a peer may have sent everything this rank needed before it failed, and its failure
// notice queues behind that data. Then the next operation must fail. Either way the failure must
// come fast, with UNAVAILABLE or ABORTED naming a peer: the peers told this rank (or closed
// their connections); it must not wait for its own timeout.
Observation CheckLateOp(Problems& problems, Communicator& comm, absl::string_view what,
                        const std::function<Work()>& issue) {
  const absl::Time start = absl::Now();
  Observation o{issue().Wait(kFailureTimeout + kWaitSlack), absl::Duration()};
  o.elapsed = absl::Now() - start;
  std::string failed_op(what);
  if (o.status.ok()) {
    const absl::Time next = absl::Now();
    o.status = comm.Barrier().Wait(kFailureTimeout + kWaitSlack);
    o.elapsed = absl::Now() - next;
    failed_op = absl::StrCat("the barrier after ", what);
    if (o.status.ok()) {
      problems.Add(absl::StrCat(what, " and the barrier after it both succeeded although the "
                                      "peers had failed; they must tell this rank"));
      return o;
    }
  }
  if (!IsPeerFailureCode(o.status.code()) || o.elapsed > kFailFast ||
      !Names(o.status, "peer ")) {
    problems.Add(absl::StrCat(failed_op, " failed after ", Fmt(o.elapsed), " with ",
                              o.status.ToString(), "; expected UNAVAILABLE or ABORTED naming a "
                              "peer within ",
                              Fmt(kFailFast)));
  }
  problems.Add(CheckBroken(comm, o.status));
  return o;
}

enum class Mismatch { kCountSmall, kCountLarge, kOp };

void RunMismatchTest(const ConformanceParam& p, Mismatch kind) {
  const int n = p.world_size;
  // The mismatched rank is 1. Small counts stay under every "one exchange" threshold; large ones
  // go through the pipelined algorithms.
  const size_t count = kind == Mismatch::kCountLarge ? (size_t{1} << 18) : 4 * n;
  std::vector<absl::Status> statuses = RunRanks(
      p.runner, n,
      [&](int rank) -> absl::Status {
        Store& store = *CurrentRank()->store;
        ObservationPublisher publisher(store, rank);
        FS_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm,
                            ConnectAndSync(p, store, rank, n));
        std::vector<float> send(count + 1, 1.0f), recv(n * (count + 1), 0.0f);
        std::string op = "all_reduce";
        const absl::Time start = absl::Now();
        Work work;
        if (kind == Mismatch::kOp && rank == 1) {
          op = "all_gather";  // same byte count per rank as the others' all_reduce
          work = comm->AllGather(MakeConstBuffer(send.data(), count / n),
                                 MakeBuffer(recv.data(), count));
        } else {
          const size_t c = (kind != Mismatch::kOp && rank == 1) ? count + 1 : count;
          work = comm->AllReduce(MakeConstBuffer(send.data(), c), MakeBuffer(recv.data(), c),
                                 ReduceOp::kSum);
        }
        Observation mine{work.Wait(kFailureTimeout + kWaitSlack), absl::Duration()};
        mine.elapsed = absl::Now() - start;
        Problems problems;
        CheckPeerCausedFailure(problems, mine, op, kFailFast,
                               {absl::StatusCode::kInvalidArgument,
                                absl::StatusCode::kUnavailable, absl::StatusCode::kAborted});
        if (!mine.status.ok()) problems.Add(CheckBroken(*comm, mine.status));
        FS_RETURN_IF_ERROR(publisher.Publish(mine));
        FS_ASSIGN_OR_RETURN(std::vector<std::optional<Observation>> all,
                            ReadAllObservations(store, n));
        if (rank == 0) {
          // Someone next to the mismatch must say so: rank 1 naming a peer, or a peer of rank 1
          // naming it.
          bool adjacent = false;
          for (int r = 0; r < n; ++r) {
            const absl::Status& s = all[r]->status;
            if (s.code() != absl::StatusCode::kInvalidArgument) continue;
            if (r == 1 ? Names(s, "peer ") : Names(s, PeerName(1))) adjacent = true;
          }
          if (!adjacent) {
            problems.Add("no rank reported INVALID_ARGUMENT naming the peer across the mismatch "
                         "(rank 1 naming a peer, or another rank naming peer 1)");
          }
          if (n == 2 && kind == Mismatch::kCountSmall) {
            for (int r = 0; r < 2; ++r) {
              const absl::Status& s = all[r]->status;
              if (s.code() != absl::StatusCode::kInvalidArgument || !Names(s, PeerName(1 - r))) {
                problems.Add(absl::StrCat("with 2 ranks both are next to the mismatch, but rank ",
                                          r, " did not report INVALID_ARGUMENT naming ",
                                          PeerName(1 - r)));
              }
            }
          }
        }
        return problems.Verdict(rank, mine, rank == 0 ? all : decltype(all){});
      },
      kRunTimeout);
  ExpectRanksOk(statuses, n);
}

// ---------------------------------------------------------------------------------------------
// CommFailureConformance: errors reach every rank, in time, and leave the communicator broken.

TEST_P(CommFailureConformance, CountMismatchSmall) {
  RunMismatchTest(GetParam(), Mismatch::kCountSmall);
}

TEST_P(CommFailureConformance, CountMismatchLarge) {
  RunMismatchTest(GetParam(), Mismatch::kCountLarge);
}

TEST_P(CommFailureConformance, OpMismatch) { RunMismatchTest(GetParam(), Mismatch::kOp); }

TEST_P(CommFailureConformance, Timeout) {
  // The last rank never issues the all_reduce (1 s timeout) that the others issue.
  const ConformanceParam& p = GetParam();
  const int n = p.world_size;
  const int skipper = n - 1;
  std::vector<absl::Status> statuses = RunRanks(
      p.runner, n,
      [&](int rank) -> absl::Status {
        Store& store = *CurrentRank()->store;
        ObservationPublisher publisher(store, rank);
        FS_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm,
                            ConnectAndSync(p, store, rank, n));
        std::vector<float> buf(1024, 1.0f);
        const ConstBuffer in = MakeConstBuffer(buf.data(), buf.size());
        const Buffer out = MakeBuffer(buf.data(), buf.size());
        Problems problems;
        std::vector<std::optional<Observation>> all(n);
        Observation mine;
        if (rank != skipper) {
          OpOptions opts;
          opts.timeout = kShortTimeout;
          const absl::Time start = absl::Now();
          Work work = comm->AllReduce(in, out, ReduceOp::kSum, opts);
          mine.status = work.Wait(kShortTimeout + kWaitSlack);
          mine.elapsed = absl::Now() - start;
          const absl::Status& s = mine.status;
          if (s.ok()) {
            problems.Add(absl::StrCat("the all_reduce succeeded although rank ", skipper,
                                      " never issued it"));
          } else {
            if (s.code() == absl::StatusCode::kDeadlineExceeded) {
              if (mine.elapsed < kShortTimeout - absl::Milliseconds(50)) {
                problems.Add(absl::StrCat("timed out after ", Fmt(mine.elapsed),
                                          ", before its timeout of ", Fmt(kShortTimeout)));
              }
              if (!Names(s, "all_reduce")) problems.Add("the message does not name the op");
              if (!Names(s, "peer ")) {
                problems.Add("the message does not name the peer it was waiting for");
              }
            } else if (s.code() == absl::StatusCode::kUnavailable) {
              // A peer that timed out first and told this rank.
              if (!Names(s, "peer ")) problems.Add("the message does not name a peer");
            } else {
              problems.Add(absl::StrCat("expected DEADLINE_EXCEEDED (or UNAVAILABLE from a peer "
                                        "that timed out first), got ",
                                        absl::StatusCodeToString(s.code())));
            }
            if (mine.elapsed > kShortTimeout + kShortTimeoutSlack) {
              problems.Add(absl::StrCat("took ", Fmt(mine.elapsed), " to fail; the timeout is ",
                                        Fmt(kShortTimeout), " (slack ",
                                        Fmt(kShortTimeoutSlack), ")"));
            }
            problems.Add(CheckBroken(*comm, s));
          }
          FS_RETURN_IF_ERROR(publisher.Publish(mine));
          for (int r = 0; r < n; ++r) {
            FS_ASSIGN_OR_RETURN(all[r], ReadObservation(store, r));
          }
        } else {
          // Once the others gave up, this rank must learn of it (CheckLateOp).
          for (int r = 0; r < n; ++r) {
            if (r == skipper) continue;
            FS_ASSIGN_OR_RETURN(all[r], ReadObservation(store, r));
          }
          mine = CheckLateOp(problems, *comm, "the skipped all_reduce issued late", [&] {
            return comm->AllReduce(in, out, ReduceOp::kSum);
          });
          FS_RETURN_IF_ERROR(publisher.Publish(mine));
          all[rank] = mine;
        }
        if (rank == 0) {
          bool any_deadline = false;
          for (int r = 0; r < n; ++r) {
            if (r != skipper && all[r]->status.code() == absl::StatusCode::kDeadlineExceeded) {
              any_deadline = true;
            }
          }
          if (!any_deadline) problems.Add("no rank reported DEADLINE_EXCEEDED");
          if (n == 2 && (all[0]->status.code() != absl::StatusCode::kDeadlineExceeded ||
                         !Names(all[0]->status, PeerName(1)))) {
            problems.Add("rank 0 must report DEADLINE_EXCEEDED naming peer 1, the rank it was "
                         "waiting for");
          }
        }
        return problems.Verdict(rank, mine, rank == 0 ? all : decltype(all){});
      },
      kRunTimeout);
  ExpectRanksOk(statuses, n);
}

TEST_P(CommFailureConformance, Abort) {
  // Rank 0 aborts from another thread while its all_reduce is pending (the last rank has not
  // issued it yet); the ranks in between have it pending too; the last rank issues it once they
  // all saw theirs fail.
  const ConformanceParam& p = GetParam();
  const int n = p.world_size;
  const int late = n - 1;
  constexpr absl::Duration kAbortDelay = absl::Milliseconds(300);
  std::vector<absl::Status> statuses = RunRanks(
      p.runner, n,
      [&](int rank) -> absl::Status {
        Store& store = *CurrentRank()->store;
        ObservationPublisher publisher(store, rank);
        FS_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm,
                            ConnectAndSync(p, store, rank, n));
        std::vector<float> buf(1024, 1.0f);
        const ConstBuffer in = MakeConstBuffer(buf.data(), buf.size());
        const Buffer out = MakeBuffer(buf.data(), buf.size());
        Problems problems;
        Observation mine;
        if (rank == 0) {
          const absl::Time start = absl::Now();
          Work work = comm->AllReduce(in, out, ReduceOp::kSum);
          absl::Time abort_time;
          std::thread aborter([&] {
            absl::SleepFor(kAbortDelay);
            abort_time = absl::Now();
            comm->Abort(absl::CancelledError("test"));
          });
          mine.status = work.Wait(kFailureTimeout + kWaitSlack);
          const absl::Time done = absl::Now();
          aborter.join();
          mine.elapsed = done - start;
          if (mine.status.code() != absl::StatusCode::kCancelled ||
              !Names(mine.status, "test")) {
            problems.Add(absl::StrCat("the pending all_reduce of the aborting rank must fail "
                                      "with the abort reason CANCELLED: test, got ",
                                      mine.status.ToString()));
          }
          if (done - abort_time > kFailFast) {
            problems.Add(absl::StrCat("the pending all_reduce failed ", Fmt(done - abort_time),
                                      " after Abort()"));
          }
          if (!mine.status.ok()) problems.Add(CheckBroken(*comm, mine.status));
          // Abort is idempotent: a second reason does not replace the first.
          comm->Abort(absl::InternalError("second abort"));
          if (comm->status().code() != absl::StatusCode::kCancelled) {
            problems.Add(absl::StrCat("after a second Abort() status() is ",
                                      comm->status().ToString()));
          }
        } else {
          if (rank == late) {
            // Only once every other rank has seen its op fail: before that, data this rank
            // sends could still complete theirs (rank 0 sent its part before aborting).
            for (int r = 0; r < n; ++r) {
              if (r == late) continue;
              FS_RETURN_IF_ERROR(ReadObservation(store, r).status());
            }
            mine = CheckLateOp(problems, *comm, "an all_reduce issued after rank 0 aborted",
                               [&] { return comm->AllReduce(in, out, ReduceOp::kSum); });
          } else {
            const absl::Time start = absl::Now();
            Work work = comm->AllReduce(in, out, ReduceOp::kSum);
            mine.status = work.Wait(kFailureTimeout + kWaitSlack);
            mine.elapsed = absl::Now() - start;
            CheckPeerCausedFailure(problems, mine, "all_reduce", kAbortDelay + kFailFast,
                                   {absl::StatusCode::kUnavailable, absl::StatusCode::kAborted});
            if (!mine.status.ok()) problems.Add(CheckBroken(*comm, mine.status));
          }
        }
        FS_RETURN_IF_ERROR(publisher.Publish(mine));
        FS_ASSIGN_OR_RETURN(std::vector<std::optional<Observation>> all,
                            ReadAllObservations(store, n));
        return problems.Verdict(rank, mine, rank == 0 ? all : decltype(all){});
      },
      kRunTimeout);
  ExpectRanksOk(statuses, n);
}

TEST_P(CommFailureConformance, AbortWithPendingReceives) {
  // Every rank r waits in Recv from rank r+1 (mod n) and nothing is in flight; rank 0 aborts.
  // Every peer must be told, including those that wait on another rank.
  const ConformanceParam& p = GetParam();
  const int n = p.world_size;
  constexpr absl::Duration kAbortDelay = absl::Milliseconds(300);
  std::vector<absl::Status> statuses = RunRanks(
      p.runner, n,
      [&](int rank) -> absl::Status {
        Store& store = *CurrentRank()->store;
        ObservationPublisher publisher(store, rank);
        FS_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm,
                            ConnectAndSync(p, store, rank, n));
        std::vector<float> buf(16, 0.0f);
        Problems problems;
        Observation mine;
        const absl::Time start = absl::Now();
        Work work = comm->Recv(MakeBuffer(buf.data(), buf.size()), (rank + 1) % n);
        if (rank == 0) {
          absl::Time abort_time;
          std::thread aborter([&] {
            absl::SleepFor(kAbortDelay);
            abort_time = absl::Now();
            comm->Abort(absl::CancelledError("test"));
          });
          mine.status = work.Wait(kFailureTimeout + kWaitSlack);
          const absl::Time done = absl::Now();
          aborter.join();
          mine.elapsed = done - start;
          if (mine.status.code() != absl::StatusCode::kCancelled ||
              !Names(mine.status, "test")) {
            problems.Add(absl::StrCat("the pending recv of the aborting rank must fail with the "
                                      "abort reason CANCELLED: test, got ",
                                      mine.status.ToString()));
          }
          if (done - abort_time > kFailFast) {
            problems.Add(absl::StrCat("the pending recv failed ", Fmt(done - abort_time),
                                      " after Abort()"));
          }
        } else {
          mine.status = work.Wait(kFailureTimeout + kWaitSlack);
          mine.elapsed = absl::Now() - start;
          CheckPeerCausedFailure(problems, mine, "recv", kAbortDelay + kFailFast,
                                 {absl::StatusCode::kUnavailable, absl::StatusCode::kAborted});
        }
        if (!mine.status.ok()) problems.Add(CheckBroken(*comm, mine.status));
        FS_RETURN_IF_ERROR(publisher.Publish(mine));
        FS_ASSIGN_OR_RETURN(std::vector<std::optional<Observation>> all,
                            ReadAllObservations(store, n));
        return problems.Verdict(rank, mine, rank == 0 ? all : decltype(all){});
      },
      kRunTimeout);
  ExpectRanksOk(statuses, n);
}

TEST_P(CommFailureConformance, PeerKilled) {
  const ConformanceParam& p = GetParam();
  if (p.runner != RunnerKind::kProcesses) {
    GTEST_SKIP() << "needs the process runner (rank 1 SIGKILLs itself)";
  }
  const int n = p.world_size;
  constexpr int kVictim = 1;
  constexpr size_t kCount = size_t{1} << 22;  // 16 MiB of f32
  std::vector<absl::Status> statuses = RunRanks(
      p.runner, n,
      [&](int rank) -> absl::Status {
        Store& store = *CurrentRank()->store;
        ObservationPublisher publisher(store, rank);
        FS_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm,
                            ConnectAndSync(p, store, rank, n));
        std::vector<float> send(kCount, 1.0f), recv(kCount, 0.0f);
        const absl::Time start = absl::Now();
        Work work = comm->AllReduce(MakeConstBuffer(send.data(), kCount),
                                    MakeBuffer(recv.data(), kCount), ReduceOp::kSum);
        if (rank == kVictim) {
          // At once: on a loaded machine even a 1 ms sleep could outlast the whole operation,
          // and then nothing would fail. Killed right after issuing, the victim dies before,
          // during or after its worker starts the op; the others must fail in every case.
          raise(SIGKILL);
        }
        Observation mine;
        mine.status = work.Wait(kFailureTimeout + kWaitSlack);
        mine.elapsed = absl::Now() - start;
        Problems problems;
        CheckPeerCausedFailure(problems, mine, "all_reduce", kFailureTimeout,
                               {absl::StatusCode::kUnavailable});
        if (!mine.status.ok()) problems.Add(CheckBroken(*comm, mine.status));
        FS_RETURN_IF_ERROR(publisher.Publish(mine));
        std::vector<std::optional<Observation>> all(n);
        for (int r = 0; r < n; ++r) {
          if (r == kVictim) continue;
          FS_ASSIGN_OR_RETURN(all[r], ReadObservation(store, r));
        }
        if (rank == 0) {
          bool named = false;
          for (int r = 0; r < n; ++r) {
            if (r != kVictim && Names(all[r]->status, PeerName(kVictim))) named = true;
          }
          if (!named) problems.Add("no surviving rank names peer 1, the rank that died");
          if (n == 2 && !Names(all[0]->status, PeerName(kVictim))) {
            problems.Add("rank 0 waited on peer 1 only, but its message does not name it");
          }
        }
        return problems.Verdict(rank, mine, rank == 0 ? all : decltype(all){});
      },
      kRunTimeout);
  ExpectRanksOk(statuses, n, {kVictim});
  ASSERT_EQ(statuses.size(), static_cast<size_t>(n));
  EXPECT_THAT(statuses[kVictim], StatusIs(absl::StatusCode::kInternal, HasSubstr("signal 9")));
}

}  // namespace
}  // namespace fairscale::comm::testing
