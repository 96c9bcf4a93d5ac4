#include "comm/testing/conformance.h"

#include "comm/testing/internal/conformance_helpers.h"

namespace fairscale::comm::testing {
namespace {

using namespace conformance_internal;  // NOLINT: the suite's own helpers

// ---------------------------------------------------------------------------------------------
// CommConformance: results.

TEST_P(CommConformance, AllReduce) {
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    for (DataType dtype : kDataTypes) {
      for (ReduceOp op : kReduceOps) {
        for (size_t count : kCounts) {
          for (bool in_place : {false, true}) {
            FS_RETURN_IF_ERROR(AllReduceCase(comm, check, dtype, op, count, in_place));
          }
        }
      }
    }
    return absl::OkStatus();
  });
}

TEST_P(CommConformance, ReduceScatter) {
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    for (DataType dtype : kDataTypes) {
      for (ReduceOp op : kReduceOps) {
        for (size_t block : kCounts) {
          for (bool in_place : {false, true}) {
            FS_RETURN_IF_ERROR(ReduceScatterCase(comm, check, dtype, op, block, in_place));
          }
        }
      }
    }
    return absl::OkStatus();
  });
}

TEST_P(CommConformance, Reduce) {
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    const int n = comm.size();
    int case_index = 0;
    // Every dtype x op x count x layout, the root rotating over the ranks...
    for (DataType dtype : kDataTypes) {
      for (ReduceOp op : kReduceOps) {
        for (size_t count : kCounts) {
          for (bool in_place : {false, true}) {
            FS_RETURN_IF_ERROR(
                ReduceCase(comm, check, dtype, op, count, in_place, case_index++ % n));
          }
        }
      }
    }
    // ...and every root for a few.
    for (int root = 0; root < n; ++root) {
      FS_RETURN_IF_ERROR(ReduceCase(comm, check, DataType::kF32, ReduceOp::kSum, 7, false, root));
      FS_RETURN_IF_ERROR(ReduceCase(comm, check, DataType::kI8, ReduceOp::kMax, 4097, true, root));
      FS_RETURN_IF_ERROR(
          ReduceCase(comm, check, DataType::kBF16, ReduceOp::kAvg, 4097, false, root));
    }
    return absl::OkStatus();
  });
}

TEST_P(CommConformance, AllGather) {
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    int salt = 0;
    for (DataType dtype : kDataTypes) {
      for (size_t block : kCounts) {
        for (bool in_place : {false, true}) {
          FS_RETURN_IF_ERROR(AllGatherCase(comm, check, dtype, block, in_place, ++salt));
        }
      }
    }
    return absl::OkStatus();
  });
}

TEST_P(CommConformance, Broadcast) {
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    int salt = 0;
    for (int root = 0; root < comm.size(); ++root) {
      for (DataType dtype : kDataTypes) {
        for (size_t count : kCounts) {
          FS_RETURN_IF_ERROR(BroadcastCase(comm, check, dtype, count, root, ++salt));
        }
      }
    }
    return absl::OkStatus();
  });
}

TEST_P(CommConformance, AllToAll) {
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    int salt = 0;
    for (DataType dtype : kDataTypes) {
      for (size_t block : kCounts) {
        FS_RETURN_IF_ERROR(AllToAllCase(comm, check, dtype, block, ++salt));
      }
    }
    return absl::OkStatus();
  });
}

TEST_P(CommConformance, SendRecvRing) {
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    int salt = 0;
    for (DataType dtype : kDataTypes) {
      for (size_t count : kCounts) {
        FS_RETURN_IF_ERROR(RingCase(comm, check, dtype, count, ++salt));
      }
    }
    // Several messages in flight to the same peer arrive in issue order.
    const int n = comm.size(), r = comm.rank();
    if (n == 1) return absl::OkStatus();
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    struct Msg {
      DataType dtype;
      size_t count;
    };
    const Msg msgs[] = {{DataType::kI32, 7}, {DataType::kF64, 4097}, {DataType::kU8, 0},
                        {DataType::kF16, 1}, {DataType::kI32, 7}};
    constexpr int kBurstSalt = 500;
    std::vector<std::unique_ptr<TestBuffer>> outs, ins;
    std::vector<Work> sends, recvs;
    for (size_t m = 0; m < std::size(msgs); ++m) {
      outs.push_back(std::make_unique<TestBuffer>(msgs[m].dtype, msgs[m].count));
      ins.push_back(std::make_unique<TestBuffer>(msgs[m].dtype, msgs[m].count));
      outs[m]->Fill([&](size_t k) { return P2pValue(msgs[m].dtype, kBurstSalt + m, r, next, k); });
      ins[m]->Fill([&](size_t k) { return Garbage(msgs[m].dtype, r, k); });
    }
    auto issue_sends = [&] {
      for (auto& b : outs) sends.push_back(comm.Send(b->buffer(), next));
    };
    auto issue_recvs = [&] {
      for (auto& b : ins) recvs.push_back(comm.Recv(b->buffer(), prev));
    };
    if (r % 2 == 0) {
      issue_sends();
      issue_recvs();
    } else {
      issue_recvs();
      issue_sends();
    }
    for (size_t m = 0; m < std::size(msgs); ++m) {
      FS_RETURN_IF_ERROR(Await(sends[m], absl::StrCat("burst send #", m, " to ", next)));
      FS_RETURN_IF_ERROR(Await(recvs[m], absl::StrCat("burst recv #", m, " from ", prev)));
    }
    for (size_t m = 0; m < std::size(msgs); ++m) {
      const std::string what = absl::StrCat("burst message #", m, " from rank ", prev);
      check.ExpectGuards(what, *ins[m]);
      check.Expect(what, CompareExact(*ins[m], [&](size_t k) {
                     return P2pValue(msgs[m].dtype, kBurstSalt + m, prev, r, k);
                   }));
    }
    return absl::OkStatus();
  });
}

TEST_P(CommConformance, SendRecvPairwise) {
  // Every pair (a, b), a < b, exchanges a message each way, the pairs taken in one global order:
  // a issues its send then its recv, b its recv then its send (an order that completes even if a
  // send waited for its recv). Everything is issued before anything is waited for.
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    const int n = comm.size(), r = comm.rank();
    struct Op {
      std::unique_ptr<TestBuffer> buf;
      Work work;
      int peer = 0;
      bool is_recv = false;
      int salt = 0;
    };
    std::vector<Op> ops;
    const std::pair<DataType, size_t> rounds[] = {
        {DataType::kI32, 7}, {DataType::kF64, 4097}, {DataType::kBF16, 1}, {DataType::kU8, 0}};
    int salt = 0;
    for (const auto& [dtype, count] : rounds) {
      ++salt;
      for (int a = 0; a < n; ++a) {
        for (int b = a + 1; b < n; ++b) {
          if (r != a && r != b) continue;
          Op send, recv;
          send.peer = recv.peer = r == a ? b : a;
          send.salt = recv.salt = salt;
          recv.is_recv = true;
          send.buf = std::make_unique<TestBuffer>(dtype, count);
          send.buf->Fill([&](size_t k) { return P2pValue(dtype, salt, r, send.peer, k); });
          recv.buf = std::make_unique<TestBuffer>(dtype, count);
          recv.buf->Fill([&](size_t k) { return Garbage(dtype, r, k); });
          if (r == a) {
            send.work = comm.Send(send.buf->buffer(), send.peer);
            recv.work = comm.Recv(recv.buf->buffer(), recv.peer);
          } else {
            recv.work = comm.Recv(recv.buf->buffer(), recv.peer);
            send.work = comm.Send(send.buf->buffer(), send.peer);
          }
          ops.push_back(std::move(send));
          ops.push_back(std::move(recv));
        }
      }
    }
    for (const Op& op : ops) {
      FS_RETURN_IF_ERROR(Await(op.work, absl::StrCat("pairwise ", op.is_recv ? "recv from " : "send to ",
                                                     op.peer, " (", DataTypeName(op.buf->dtype()),
                                                     " count=", op.buf->count(), ")")));
    }
    for (const Op& op : ops) {
      const DataType dtype = op.buf->dtype();
      const std::string what = absl::StrCat("pairwise ", op.is_recv ? "recv from " : "send to ",
                                            op.peer, " ", DataTypeName(dtype),
                                            " count=", op.buf->count());
      check.ExpectGuards(what, *op.buf);
      const int from = op.is_recv ? op.peer : r;
      const int to = op.is_recv ? r : op.peer;
      check.Expect(what, CompareExact(*op.buf, [&](size_t k) {
                     return P2pValue(dtype, op.salt, from, to, k);
                   }));
    }
    return absl::OkStatus();
  });
}

// A receive buffer of a point-to-point test and what it must hold afterwards.
struct ExpectedMessage {
  std::unique_ptr<TestBuffer> buf;
  int from = 0;
  int salt = 0;
};

void CheckMessages(Checker& check, absl::string_view label, int rank,
                   const std::vector<ExpectedMessage>& msgs) {
  for (const ExpectedMessage& m : msgs) {
    const DataType dtype = m.buf->dtype();
    const std::string what = absl::StrCat(label, ": ", DataTypeName(dtype), " count=",
                                          m.buf->count(), " from rank ", m.from);
    check.ExpectGuards(what, *m.buf);
    check.Expect(what, CompareExact(*m.buf, [&](size_t k) {
                   return P2pValue(dtype, m.salt, m.from, rank, k);
                 }));
  }
}

TEST_P(CommConformance, BatchP2P) {
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    const int n = comm.size(), r = comm.rank();
    std::vector<float> a(64, 1.0f), b(64, 0.0f);
    Work empty = comm.BatchP2P({});
    if (!empty.IsDone() || !empty.Wait(kFailFast).ok()) {
      check.Fail("an empty BatchP2P must be done at once with OK");
    }
    ExpectInvalidArgument(check, "batch_p2p item sending to itself", "batch_p2p",
                          comm.BatchP2P({P2POp::Send(MakeConstBuffer(a.data(), 8), r)}));
    if (n > 1) {
      const int peer = (r + 1) % n;
      ExpectInvalidArgument(check, "batch_p2p with overlapping recv items", "batch_p2p",
                            comm.BatchP2P({P2POp::Recv(MakeBuffer(b.data(), 8), peer),
                                           P2POp::Recv(MakeBuffer(b.data() + 4, 8), peer)}));
    }
    if (n == 1) return absl::OkStatus();

    // 1. One batch per rank: two or more messages to and from every other rank, every send
    // listed before every receive (as plain Sends and Recvs this would wait until the timeout
    // on a rendezvous transport). Per peer, the items match in order.
    const std::pair<DataType, size_t> rounds[] = {{DataType::kF32, kLargeCount},
                                                  {DataType::kI8, 7},
                                                  {DataType::kBF16, 0},
                                                  {DataType::kI64, 4097}};
    std::vector<std::unique_ptr<TestBuffer>> outs;
    std::vector<ExpectedMessage> ins;
    std::vector<P2POp> sends, recvs;
    int salt = 100;
    for (const auto& [dtype, count] : rounds) {
      ++salt;
      for (int peer = 0; peer < n; ++peer) {
        if (peer == r) continue;
        outs.push_back(std::make_unique<TestBuffer>(dtype, count));
        outs.back()->Fill([&](size_t k) { return P2pValue(dtype, salt, r, peer, k); });
        sends.push_back(P2POp::Send(outs.back()->buffer(), peer));
        ExpectedMessage in{std::make_unique<TestBuffer>(dtype, count), peer, salt};
        in.buf->Fill([&](size_t k) { return Garbage(dtype, r, k); });
        recvs.push_back(P2POp::Recv(in.buf->buffer(), peer));
        ins.push_back(std::move(in));
      }
    }
    std::vector<P2POp> all = sends;
    all.insert(all.end(), recvs.begin(), recvs.end());
    FS_RETURN_IF_ERROR(Await(comm.BatchP2P(all), "batch_p2p all-pairs exchange"));
    CheckMessages(check, "batch_p2p all-pairs exchange", r, ins);
    for (size_t i = 0; i < outs.size(); ++i) check.ExpectGuards("batch_p2p send buffer", *outs[i]);

    // 2. A batch on one side matches plain Send/Recv on the other. Pairs (a, b), a < b, in one
    // global order: a posts {send to b, recv from b} as a batch, b a plain Send then Recv.
    // Everything is issued before anything is waited for.
    std::vector<std::unique_ptr<TestBuffer>> mixed_outs;
    std::vector<ExpectedMessage> mixed_ins;
    std::vector<Work> works;
    const int mixed_salt = 200;
    for (int a_rank = 0; a_rank < n; ++a_rank) {
      for (int b_rank = a_rank + 1; b_rank < n; ++b_rank) {
        if (r != a_rank && r != b_rank) continue;
        const int peer = r == a_rank ? b_rank : a_rank;
        const DataType dtype = DataType::kF64;
        const size_t count = 4097;
        mixed_outs.push_back(std::make_unique<TestBuffer>(dtype, count));
        mixed_outs.back()->Fill([&](size_t k) { return P2pValue(dtype, mixed_salt, r, peer, k); });
        ExpectedMessage in{std::make_unique<TestBuffer>(dtype, count), peer, mixed_salt};
        in.buf->Fill([&](size_t k) { return Garbage(dtype, r, k); });
        if (r == a_rank) {
          works.push_back(comm.BatchP2P({P2POp::Send(mixed_outs.back()->buffer(), peer),
                                         P2POp::Recv(in.buf->buffer(), peer)}));
        } else {
          works.push_back(comm.Send(mixed_outs.back()->buffer(), peer));
          works.push_back(comm.Recv(in.buf->buffer(), peer));
        }
        mixed_ins.push_back(std::move(in));
      }
    }
    for (size_t i = 0; i < works.size(); ++i) {
      FS_RETURN_IF_ERROR(Await(works[i], absl::StrCat("batch_p2p against plain send/recv, op #",
                                                      i)));
    }
    CheckMessages(check, "batch_p2p against plain send/recv", r, mixed_ins);
    return absl::OkStatus();
  });
}

TEST_P(CommConformance, Barrier) {
  // A barrier may complete on a rank only after every rank entered it. Each round one rank enters
  // late; entry times go through the store (one clock: the ranks share a machine).
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    const int n = comm.size(), r = comm.rank();
    Store& store = *CurrentRank()->store;
    constexpr int kRounds = 3;
    std::vector<absl::Time> exits(kRounds);
    for (int round = 0; round < kRounds; ++round) {
      if (r == round % n) absl::SleepFor(absl::Milliseconds(200));
      const absl::Time enter = absl::Now();
      FS_RETURN_IF_ERROR(store.Set(absl::StrCat("fs_conformance/barrier/", round, "/", r),
                                   absl::StrCat(absl::ToUnixNanos(enter))));
      FS_RETURN_IF_ERROR(Await(comm.Barrier(), absl::StrCat("barrier round ", round)));
      exits[round] = absl::Now();
    }
    for (int round = 0; round < kRounds; ++round) {
      for (int q = 0; q < n; ++q) {
        FS_ASSIGN_OR_RETURN(std::string v,
                            store.Get(absl::StrCat("fs_conformance/barrier/", round, "/", q),
                                      kStoreTimeout));
        int64_t ns = 0;
        if (!absl::SimpleAtoi(v, &ns)) return absl::InternalError("bad barrier entry time");
        const absl::Time entered = absl::FromUnixNanos(ns);
        if (exits[round] < entered) {
          check.Fail(absl::StrCat("barrier round ", round, " completed on rank ", r, " ",
                                  Fmt(entered - exits[round]), " before rank ", q,
                                  " entered it"));
        }
      }
    }
    return absl::OkStatus();
  });
}

// all_reduce (i64 sum) and all_gather (i32) in a child whose ranks are `members` (old ranks in
// child rank order), then a child barrier.
absl::Status CheckChild(Communicator& child, const std::vector<int>& members, int old_rank,
                        Checker& check, absl::string_view label) {
  const int64_t q = old_rank;
  std::vector<int64_t> sum = {q + 1, 1000 * (q + 1), -(q + 1)};
  FS_RETURN_IF_ERROR(Await(child.AllReduce(MakeConstBuffer(sum.data(), sum.size()),
                                           MakeBuffer(sum.data(), sum.size()), ReduceOp::kSum),
                           absl::StrCat(label, ": child all_reduce")));
  int64_t want = 0;
  for (int m : members) want += m + 1;
  if (sum != std::vector<int64_t>{want, 1000 * want, -want}) {
    check.Fail(absl::StrCat(label, ": child all_reduce gave {", absl::StrJoin(sum, ", "),
                            "}, expected {", want, ", ", 1000 * want, ", ", -want, "}"));
  }
  int32_t mine = old_rank;
  std::vector<int32_t> gathered(members.size(), -1);
  FS_RETURN_IF_ERROR(Await(child.AllGather(MakeConstBuffer(&mine, 1),
                                           MakeBuffer(gathered.data(), gathered.size())),
                           absl::StrCat(label, ": child all_gather")));
  if (!std::equal(gathered.begin(), gathered.end(), members.begin(), members.end())) {
    check.Fail(absl::StrCat(label, ": the child's ranks hold old ranks {",
                            absl::StrJoin(gathered, ", "), "}, expected {",
                            absl::StrJoin(members, ", "), "}"));
  }
  return Await(child.Barrier(), absl::StrCat(label, ": child barrier"));
}

// An all_reduce on the parent communicator.
absl::Status CheckParent(Communicator& comm, Checker& check, absl::string_view label) {
  const int n = comm.size(), r = comm.rank();
  std::vector<int32_t> v = {r + 1, 2 * (r + 1)};
  FS_RETURN_IF_ERROR(Await(comm.AllReduce(MakeConstBuffer(v.data(), 2), MakeBuffer(v.data(), 2),
                                          ReduceOp::kSum),
                           label));
  const int32_t want = n * (n + 1) / 2;
  if (v[0] != want || v[1] != 2 * want) {
    check.Fail(absl::StrCat(label, ": got {", v[0], ", ", v[1], "}, expected {", want, ", ",
                            2 * want, "}"));
  }
  return absl::OkStatus();
}

absl::Status CheckSplit(Communicator& comm, Checker& check, int color, int key,
                        const std::vector<int>& members, absl::string_view label) {
  const int r = comm.rank();
  absl::StatusOr<std::shared_ptr<Communicator>> split = comm.Split(color, key);
  if (!split.ok()) {
    return absl::Status(split.status().code(),
                        absl::StrCat(label, ": Split(", color, ", ", key, "): ",
                                     split.status().message()));
  }
  std::shared_ptr<Communicator> child = *std::move(split);
  if (color < 0) {
    if (child != nullptr) {
      check.Fail(absl::StrCat(label, ": Split(kNoColor) returned a communicator, not nullptr"));
    }
    return CheckParent(comm, check, absl::StrCat(label, ": parent all_reduce after the split"));
  }
  if (child == nullptr) {
    check.Fail(absl::StrCat(label, ": Split(", color, ", ", key, ") returned nullptr"));
    return CheckParent(comm, check, absl::StrCat(label, ": parent all_reduce after the split"));
  }
  const int want_rank =
      static_cast<int>(std::find(members.begin(), members.end(), r) - members.begin());
  if (child->size() != static_cast<int>(members.size()) || child->rank() != want_rank) {
    check.Fail(absl::StrCat(label, ": child of old rank ", r, " is rank ", child->rank(), "/",
                            child->size(), ", expected ", want_rank, "/", members.size(),
                            " (members in order: ", absl::StrJoin(members, ", "), ")"));
    // The child's layout is wrong: running collectives on it could pair the wrong ranks.
    return CheckParent(comm, check, absl::StrCat(label, ": parent all_reduce after the split"));
  }
  if (child->backend() != comm.backend()) {
    check.Fail(absl::StrCat(label, ": child backend '", child->backend(), "'"));
  }
  FS_RETURN_IF_ERROR(CheckChild(*child, members, r, check, label));
  // Parent and child are independent; the parent op also orders every rank's child work before
  // any rank destroys its child.
  FS_RETURN_IF_ERROR(CheckParent(comm, check, absl::StrCat(label, ": parent all_reduce")));
  if (!child->status().ok()) {
    check.Fail(absl::StrCat(label, ": child status() ", child->status().ToString()));
  }
  return absl::OkStatus();
}

TEST_P(CommConformance, Split) {
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    const int n = comm.size(), r = comm.rank();
    // color = rank % 2, key = -rank: each child lists its old ranks in descending order.
    std::vector<int> parity;
    for (int q = n - 1; q >= 0; --q) {
      if (q % 2 == r % 2) parity.push_back(q);
    }
    FS_RETURN_IF_ERROR(CheckSplit(comm, check, r % 2, -r, parity, "split by parity"));
    // Rank 0 leaves (kNoColor); the others keep their order (key = rank).
    std::vector<int> rest;
    for (int q = 1; q < n; ++q) rest.push_back(q);
    FS_RETURN_IF_ERROR(
        CheckSplit(comm, check, r == 0 ? kNoColor : 7, r, rest, "split without rank 0"));
    // One color and equal keys: ordered by old rank.
    std::vector<int> all;
    for (int q = 0; q < n; ++q) all.push_back(q);
    FS_RETURN_IF_ERROR(CheckSplit(comm, check, 0, 0, all, "split into one group"));
    return CheckParent(comm, check, "parent all_reduce after every child is gone");
  });
}

TEST_P(CommConformance, InvalidArguments) {
  // Argument errors are rank-local: every rank passes the same bad arguments, gets an
  // already-failed Work with kInvalidArgument, and the communicator stays usable.
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    const int n = comm.size(), r = comm.rank();
    std::vector<float> a(64, 1.0f), b(64, 0.0f);
    std::vector<int32_t> ia(64, 1), ib(64, 0);
    const ConstBuffer a8 = MakeConstBuffer(a.data(), 8);
    ExpectInvalidArgument(check, "all_reduce with send count 8, recv count 7", "all_reduce",
                          comm.AllReduce(a8, MakeBuffer(b.data(), 7), ReduceOp::kSum));
    ExpectInvalidArgument(check, "all_reduce f32 -> i32", "all_reduce",
                          comm.AllReduce(a8, MakeBuffer(ib.data(), 8), ReduceOp::kSum));
    ExpectInvalidArgument(check, "all_reduce i32 avg", "all_reduce",
                          comm.AllReduce(MakeConstBuffer(ia.data(), 8), MakeBuffer(ib.data(), 8),
                                         ReduceOp::kAvg));
    ExpectInvalidArgument(check, "all_reduce partially overlapping", "all_reduce",
                          comm.AllReduce(a8, MakeBuffer(a.data() + 4, 8), ReduceOp::kSum));
    ExpectInvalidArgument(check, "all_reduce null send with count 3", "all_reduce",
                          comm.AllReduce(ConstBuffer(nullptr, 3, DataType::kF32),
                                         MakeBuffer(b.data(), 3), ReduceOp::kSum));
    ExpectInvalidArgument(check, "all_reduce invalid dtype", "all_reduce",
                          comm.AllReduce(ConstBuffer(a.data(), 8, static_cast<DataType>(99)),
                                         Buffer{b.data(), 8, static_cast<DataType>(99)},
                                         ReduceOp::kSum));
    ExpectInvalidArgument(check, "all_reduce invalid op", "all_reduce",
                          comm.AllReduce(a8, MakeBuffer(b.data(), 8), static_cast<ReduceOp>(42)));
    ExpectInvalidArgument(check, "broadcast root == size", "broadcast",
                          comm.Broadcast(MakeBuffer(b.data(), 8), n));
    ExpectInvalidArgument(check, "broadcast root -1", "broadcast",
                          comm.Broadcast(MakeBuffer(b.data(), 8), -1));
    ExpectInvalidArgument(check, "reduce root == size", "reduce",
                          comm.Reduce(a8, MakeBuffer(b.data(), 8), ReduceOp::kSum, n));
    ExpectInvalidArgument(
        check, "reduce_scatter send count size*4+1", "reduce_scatter",
        comm.ReduceScatter(MakeConstBuffer(a.data(), n * 4 + 1), MakeBuffer(b.data(), 4),
                           ReduceOp::kSum));
    ExpectInvalidArgument(check, "all_gather recv count size*4+1", "all_gather",
                          comm.AllGather(MakeConstBuffer(a.data(), 4),
                                         MakeBuffer(b.data(), n * 4 + 1)));
    if (n > 1) {
      // send overlaps recv but is not block `rank` of it.
      const int wrong = (r + 1) % n;
      ExpectInvalidArgument(check, "all_gather with a wrong in-place layout", "all_gather",
                            comm.AllGather(MakeConstBuffer(b.data() + wrong * 4, 4),
                                           MakeBuffer(b.data(), n * 4)));
      ExpectInvalidArgument(check, "all_to_all count not divisible by size", "all_to_all",
                            comm.AllToAll(MakeConstBuffer(a.data(), n * 2 + 1),
                                          MakeBuffer(b.data(), n * 2 + 1)));
    }
    ExpectInvalidArgument(check, "all_to_all in place", "all_to_all",
                          comm.AllToAll(MakeConstBuffer(a.data(), n * 2),
                                        MakeBuffer(a.data(), n * 2)));
    ExpectInvalidArgument(check, "send to itself", "send", comm.Send(a8, r));
    ExpectInvalidArgument(check, "send to rank -1", "send", comm.Send(a8, -1));
    ExpectInvalidArgument(check, "recv from rank size", "recv",
                          comm.Recv(MakeBuffer(b.data(), 8), n));
    if (!comm.SupportsDevice(Device::Cuda(0))) {
      Buffer cuda = MakeBuffer(b.data(), 8);
      cuda.device = Device::Cuda(0);
      ExpectInvalidArgument(check, "broadcast of an unsupported device buffer", "broadcast",
                            comm.Broadcast(cuda, 0));
    }
    if (!comm.status().ok()) {
      check.Fail(absl::StrCat("argument errors broke the communicator: status() ",
                              comm.status().ToString()));
    }
    return CheckParent(comm, check, "all_reduce after the argument errors");
  });
}

TEST_P(CommConformance, LargeMessages) {
  // 1<<20 elements (1-8 MiB) for one representative case per operation.
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    const int n = comm.size();
    const size_t block = kLargeCount / n;
    FS_RETURN_IF_ERROR(AllReduceCase(comm, check, DataType::kF32, ReduceOp::kSum, kLargeCount,
                                     false));
    FS_RETURN_IF_ERROR(AllReduceCase(comm, check, DataType::kBF16, ReduceOp::kMax, kLargeCount,
                                     true));
    FS_RETURN_IF_ERROR(AllReduceCase(comm, check, DataType::kI64, ReduceOp::kProduct,
                                     kLargeCount, false));
    FS_RETURN_IF_ERROR(AllReduceCase(comm, check, DataType::kF16, ReduceOp::kAvg, kLargeCount,
                                     false));
    FS_RETURN_IF_ERROR(ReduceScatterCase(comm, check, DataType::kF64, ReduceOp::kSum, block,
                                         false));
    FS_RETURN_IF_ERROR(ReduceScatterCase(comm, check, DataType::kI32, ReduceOp::kMin, block,
                                         true));
    FS_RETURN_IF_ERROR(AllGatherCase(comm, check, DataType::kI8, block, false, 1));
    FS_RETURN_IF_ERROR(AllGatherCase(comm, check, DataType::kF32, block, true, 2));
    FS_RETURN_IF_ERROR(BroadcastCase(comm, check, DataType::kU8, kLargeCount, n - 1, 3));
    FS_RETURN_IF_ERROR(AllToAllCase(comm, check, DataType::kI32, block, 4));
    FS_RETURN_IF_ERROR(ReduceCase(comm, check, DataType::kF32, ReduceOp::kMin, kLargeCount,
                                  false, 0));
    FS_RETURN_IF_ERROR(ReduceCase(comm, check, DataType::kI64, ReduceOp::kSum, kLargeCount,
                                  true, n - 1));
    return RingCase(comm, check, DataType::kF32, kLargeCount, 5);
  });
}

TEST_P(CommConformance, HugeMessages) {
  // One 64 MiB message each for all_reduce and all_gather (f32).
  RunResultTest(GetParam(), [](Communicator& comm, Checker& check) -> absl::Status {
    const size_t count = kHugeBytes / sizeof(float);
    FS_RETURN_IF_ERROR(AllReduceCase(comm, check, DataType::kF32, ReduceOp::kSum, count, false));
    return AllGatherCase(comm, check, DataType::kF32, count / comm.size(), false, 6);
  });
}

}  // namespace


void PrintTo(const ConformanceParam& param, std::ostream* os) {
  *os << param.backend << "/" << RunnerKindName(param.runner) << "/ws" << param.world_size;
}

std::vector<ConformanceParam> ConformanceParams(const std::string& backend, RunnerKind runner) {
  std::vector<ConformanceParam> params;
  for (int n = 1; n <= 4; ++n) params.push_back({backend, runner, n});
  return params;
}

std::vector<ConformanceParam> FailureConformanceParams(const std::string& backend,
                                                       RunnerKind runner) {
  return {{backend, runner, 2}, {backend, runner, 3}};
}

std::string ConformanceParamName(const ::testing::TestParamInfo<ConformanceParam>& info) {
  return absl::StrCat("ws", info.param.world_size);
}

}  // namespace fairscale::comm::testing
