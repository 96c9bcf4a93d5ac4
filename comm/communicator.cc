#include "comm/communicator.h"

#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fairscale::comm {

absl::string_view OpTypeName(OpType type) {
  switch (type) {
    case OpType::kAllReduce: return "all_reduce";
    case OpType::kReduceScatter: return "reduce_scatter";
    case OpType::kAllGather: return "all_gather";
    case OpType::kBroadcast: return "broadcast";
    case OpType::kReduce: return "reduce";
    case OpType::kAllToAll: return "all_to_all";
    case OpType::kSend: return "send";
    case OpType::kRecv: return "recv";
    case OpType::kBarrier: return "barrier";
    case OpType::kSplit: return "split";
    case OpType::kBatchP2P: return "batch_p2p";
  }
  return "invalid-op-type";
}

uint32_t MakeSignature(const DataType* dtype, const ReduceOp* op, int root) {
  uint32_t sig = 0;
  if (dtype != nullptr) sig |= (static_cast<uint32_t>(*dtype) + 1) & 0xf;
  if (op != nullptr) sig |= ((static_cast<uint32_t>(*op) + 1) & 0xf) << 4;
  if (root >= 0) sig |= (static_cast<uint32_t>(root + 1) & 0xffff) << 8;
  return sig;
}

std::string DescribeSignature(uint32_t signature) {
  std::vector<std::string> parts;
  if (uint32_t d = signature & 0xf; d != 0) {
    parts.emplace_back(DataTypeName(static_cast<DataType>(d - 1)));
  }
  if (uint32_t o = (signature >> 4) & 0xf; o != 0) {
    parts.emplace_back(ReduceOpName(static_cast<ReduceOp>(o - 1)));
  }
  if (uint32_t r = (signature >> 8) & 0xffff; r != 0) parts.push_back(absl::StrCat("root ", r - 1));
  return absl::StrJoin(parts, " ");
}

std::string OpContext::Label() const {
  return absl::StrCat(OpTypeName(type), " #", seq, " rank ", rank, "/", size, " [", backend, "]");
}

absl::Status OpContext::Error(absl::StatusCode code, absl::string_view message) const {
  return absl::Status(code, absl::StrCat(Label(), ": ", message));
}

Communicator::Communicator(int rank, int size, std::string backend,
                           absl::Duration default_timeout)
    : rank_(rank),
      size_(size),
      backend_(std::move(backend)),
      default_timeout_(default_timeout),
      send_seq_(size > 0 ? size : 0, 0),
      recv_seq_(size > 0 ? size : 0, 0) {}

Communicator::~Communicator() = default;

OpContext Communicator::MakeContext(OpType type, uint64_t seq, const OpOptions& opts) const {
  OpContext ctx;
  ctx.type = type;
  ctx.seq = seq;
  ctx.timeout = opts.timeout > absl::ZeroDuration() ? opts.timeout : default_timeout_;
  ctx.rank = rank_;
  ctx.size = size_;
  ctx.backend = backend_;
  return ctx;
}

OpContext Communicator::NextCollective(OpType type, const OpOptions& opts) {
  return MakeContext(type, ++collective_seq_, opts);
}

namespace {

bool ValidDataType(DataType t) { return static_cast<int>(t) < kNumDataTypes; }
bool ValidReduceOp(ReduceOp op) { return static_cast<int>(op) < kNumReduceOps; }

// True when [a, a+na) and [b, b+nb) share a byte.
bool Overlaps(const void* a, size_t na, const void* b, size_t nb) {
  if (na == 0 || nb == 0) return false;
  auto pa = reinterpret_cast<uintptr_t>(a);
  auto pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + nb && pb < pa + na;
}

}  // namespace

absl::Status Communicator::CheckBuffer(const OpContext& ctx, absl::string_view what,
                                       const void* data, size_t count, DataType dtype,
                                       Device device) const {
  if (!ValidDataType(dtype)) {
    return ctx.Error(absl::StatusCode::kInvalidArgument,
                     absl::StrCat(what, " buffer has invalid dtype ", static_cast<int>(dtype)));
  }
  if (count > std::numeric_limits<size_t>::max() / 16) {
    return ctx.Error(absl::StatusCode::kInvalidArgument,
                     absl::StrCat(what, " buffer count ", count, " is too large"));
  }
  if (count > 0 && data == nullptr) {
    return ctx.Error(absl::StatusCode::kInvalidArgument,
                     absl::StrCat(what, " buffer is null with count ", count));
  }
  if (!SupportsDevice(device)) {
    return ctx.Error(absl::StatusCode::kInvalidArgument,
                     absl::StrCat(what, " buffer is on ", DeviceName(device), ", which the ",
                                  backend_, " backend does not support"));
  }
  return absl::OkStatus();
}

// Helpers shared by the validating entry points below. Each returns an already-failed Work on
// bad input.
#define FS_COMM_CHECK(expr)                                 \
  do {                                                      \
    absl::Status fs_check_status_ = (expr);                 \
    if (!fs_check_status_.ok()) return Work::Done(fs_check_status_); \
  } while (0)

#define FS_COMM_REQUIRE(cond, ...)                                                   \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      return Work::Done(                                                             \
          ctx.Error(absl::StatusCode::kInvalidArgument, absl::StrCat(__VA_ARGS__))); \
    }                                                                                \
  } while (0)

namespace {
absl::Status CheckPair(const OpContext& ctx, const ConstBuffer& send, const Buffer& recv) {
  if (send.dtype != recv.dtype) {
    return ctx.Error(absl::StatusCode::kInvalidArgument,
                     absl::StrCat("send dtype ", DataTypeName(send.dtype), " != recv dtype ",
                                  DataTypeName(recv.dtype)));
  }
  if (send.device != recv.device) {
    return ctx.Error(absl::StatusCode::kInvalidArgument,
                     absl::StrCat("send buffer on ", DeviceName(send.device),
                                  " but recv buffer on ", DeviceName(recv.device)));
  }
  return absl::OkStatus();
}

absl::Status CheckReduceOp(const OpContext& ctx, ReduceOp op, DataType dtype) {
  if (!ValidReduceOp(op)) {
    return ctx.Error(absl::StatusCode::kInvalidArgument,
                     absl::StrCat("invalid reduce op ", static_cast<int>(op)));
  }
  if (op == ReduceOp::kAvg && !IsFloatingPoint(dtype)) {
    return ctx.Error(absl::StatusCode::kInvalidArgument,
                     absl::StrCat("avg is defined for floating-point dtypes only, got ",
                                  DataTypeName(dtype)));
  }
  return absl::OkStatus();
}
}  // namespace

Work Communicator::AllReduce(ConstBuffer send, Buffer recv, ReduceOp op, const OpOptions& opts) {
  absl::MutexLock lock(&mu_);
  OpContext ctx = MakeContext(OpType::kAllReduce, collective_seq_ + 1, opts);
  FS_COMM_CHECK(CheckBuffer(ctx, "send", send.data, send.count, send.dtype, send.device));
  FS_COMM_CHECK(CheckBuffer(ctx, "recv", recv.data, recv.count, recv.dtype, recv.device));
  FS_COMM_CHECK(CheckPair(ctx, send, recv));
  FS_COMM_CHECK(CheckReduceOp(ctx, op, send.dtype));
  FS_COMM_REQUIRE(send.count == recv.count, "send count ", send.count, " != recv count ",
                  recv.count);
  FS_COMM_REQUIRE(send.data == recv.data || !Overlaps(send.data, send.bytes(), recv.data,
                                                      recv.bytes()),
                  "send and recv buffers partially overlap (in-place needs send == recv)");
  ctx = NextCollective(OpType::kAllReduce, opts);
  ctx.signature = MakeSignature(&send.dtype, &op);
  return DoAllReduce(ctx, send, recv, op);
}

Work Communicator::ReduceScatter(ConstBuffer send, Buffer recv, ReduceOp op,
                                 const OpOptions& opts) {
  absl::MutexLock lock(&mu_);
  OpContext ctx = MakeContext(OpType::kReduceScatter, collective_seq_ + 1, opts);
  FS_COMM_CHECK(CheckBuffer(ctx, "send", send.data, send.count, send.dtype, send.device));
  FS_COMM_CHECK(CheckBuffer(ctx, "recv", recv.data, recv.count, recv.dtype, recv.device));
  FS_COMM_CHECK(CheckPair(ctx, send, recv));
  FS_COMM_CHECK(CheckReduceOp(ctx, op, send.dtype));
  FS_COMM_REQUIRE(send.count == recv.count * static_cast<size_t>(size_), "send count ",
                  send.count, " != size ", size_, " * recv count ", recv.count);
  const void* in_place = static_cast<const char*>(send.data) + rank_ * recv.bytes();
  FS_COMM_REQUIRE(recv.data == in_place ||
                      !Overlaps(send.data, send.bytes(), recv.data, recv.bytes()),
                  "send and recv overlap but recv is not block ", rank_,
                  " of send (the in-place layout)");
  ctx = NextCollective(OpType::kReduceScatter, opts);
  ctx.signature = MakeSignature(&send.dtype, &op);
  return DoReduceScatter(ctx, send, recv, op);
}

Work Communicator::AllGather(ConstBuffer send, Buffer recv, const OpOptions& opts) {
  absl::MutexLock lock(&mu_);
  OpContext ctx = MakeContext(OpType::kAllGather, collective_seq_ + 1, opts);
  FS_COMM_CHECK(CheckBuffer(ctx, "send", send.data, send.count, send.dtype, send.device));
  FS_COMM_CHECK(CheckBuffer(ctx, "recv", recv.data, recv.count, recv.dtype, recv.device));
  FS_COMM_CHECK(CheckPair(ctx, send, recv));
  FS_COMM_REQUIRE(recv.count == send.count * static_cast<size_t>(size_), "recv count ",
                  recv.count, " != size ", size_, " * send count ", send.count);
  const void* in_place = static_cast<const char*>(recv.data) + rank_ * send.bytes();
  FS_COMM_REQUIRE(send.data == in_place ||
                      !Overlaps(send.data, send.bytes(), recv.data, recv.bytes()),
                  "send and recv overlap but send is not block ", rank_,
                  " of recv (the in-place layout)");
  ctx = NextCollective(OpType::kAllGather, opts);
  ctx.signature = MakeSignature(&send.dtype);
  return DoAllGather(ctx, send, recv);
}

Work Communicator::Broadcast(Buffer buffer, int root, const OpOptions& opts) {
  absl::MutexLock lock(&mu_);
  OpContext ctx = MakeContext(OpType::kBroadcast, collective_seq_ + 1, opts);
  FS_COMM_CHECK(CheckBuffer(ctx, "", buffer.data, buffer.count, buffer.dtype, buffer.device));
  FS_COMM_REQUIRE(root >= 0 && root < size_, "root ", root, " is not in [0, ", size_, ")");
  ctx = NextCollective(OpType::kBroadcast, opts);
  ctx.signature = MakeSignature(&buffer.dtype, nullptr, root);
  return DoBroadcast(ctx, buffer, root);
}

Work Communicator::Reduce(ConstBuffer send, Buffer recv, ReduceOp op, int root,
                          const OpOptions& opts) {
  absl::MutexLock lock(&mu_);
  OpContext ctx = MakeContext(OpType::kReduce, collective_seq_ + 1, opts);
  FS_COMM_REQUIRE(root >= 0 && root < size_, "root ", root, " is not in [0, ", size_, ")");
  FS_COMM_CHECK(CheckBuffer(ctx, "send", send.data, send.count, send.dtype, send.device));
  FS_COMM_CHECK(CheckReduceOp(ctx, op, send.dtype));
  if (rank_ == root) {
    FS_COMM_CHECK(CheckBuffer(ctx, "recv", recv.data, recv.count, recv.dtype, recv.device));
    FS_COMM_CHECK(CheckPair(ctx, send, recv));
    FS_COMM_REQUIRE(send.count == recv.count, "send count ", send.count,
                    " != recv count ", recv.count, " on the root");
    FS_COMM_REQUIRE(send.data == recv.data ||
                        !Overlaps(send.data, send.bytes(), recv.data, recv.bytes()),
                    "send and recv buffers partially overlap (in-place needs send == recv)");
  } else {
    recv = Buffer{nullptr, 0, send.dtype, send.device};
  }
  ctx = NextCollective(OpType::kReduce, opts);
  ctx.signature = MakeSignature(&send.dtype, &op, root);
  return DoReduce(ctx, send, recv, op, root);
}

Work Communicator::AllToAll(ConstBuffer send, Buffer recv, const OpOptions& opts) {
  absl::MutexLock lock(&mu_);
  OpContext ctx = MakeContext(OpType::kAllToAll, collective_seq_ + 1, opts);
  FS_COMM_CHECK(CheckBuffer(ctx, "send", send.data, send.count, send.dtype, send.device));
  FS_COMM_CHECK(CheckBuffer(ctx, "recv", recv.data, recv.count, recv.dtype, recv.device));
  FS_COMM_CHECK(CheckPair(ctx, send, recv));
  FS_COMM_REQUIRE(send.count == recv.count, "send count ", send.count, " != recv count ",
                  recv.count);
  FS_COMM_REQUIRE(send.count % static_cast<size_t>(size_) == 0, "count ", send.count,
                  " is not divisible by size ", size_);
  FS_COMM_REQUIRE(!Overlaps(send.data, send.bytes(), recv.data, recv.bytes()),
                  "all_to_all cannot run in place: send and recv overlap");
  ctx = NextCollective(OpType::kAllToAll, opts);
  ctx.signature = MakeSignature(&send.dtype);
  return DoAllToAll(ctx, send, recv);
}

Work Communicator::Send(ConstBuffer buffer, int peer, const OpOptions& opts) {
  return PointToPoint(OpType::kSend, Buffer{const_cast<void*>(buffer.data), buffer.count,
                                            buffer.dtype, buffer.device},
                      peer, opts);
}

Work Communicator::Recv(Buffer buffer, int peer, const OpOptions& opts) {
  return PointToPoint(OpType::kRecv, buffer, peer, opts);
}

Work Communicator::PointToPoint(OpType type, Buffer buffer, int peer, const OpOptions& opts) {
  absl::MutexLock lock(&mu_);
  std::vector<uint64_t>& seqs = type == OpType::kSend ? send_seq_ : recv_seq_;
  const bool peer_ok = peer >= 0 && peer < size_ && peer != rank_;
  OpContext ctx = MakeContext(type, peer_ok ? seqs[peer] + 1 : 0, opts);
  FS_COMM_REQUIRE(peer_ok, "peer ", peer, " is not another rank in [0, ", size_, ")");
  FS_COMM_CHECK(CheckBuffer(ctx, "", buffer.data, buffer.count, buffer.dtype, buffer.device));
  ctx.seq = ++seqs[peer];
  ctx.signature = MakeSignature(&buffer.dtype);
  return type == OpType::kSend ? DoSend(ctx, buffer, peer) : DoRecv(ctx, buffer, peer);
}

Work Communicator::BatchP2P(const std::vector<P2POp>& ops, const OpOptions& opts) {
  absl::MutexLock lock(&mu_);
  OpContext ctx = MakeContext(OpType::kBatchP2P, 0, opts);
  if (ops.empty()) return Work();
  for (size_t i = 0; i < ops.size(); ++i) {
    const P2POp& op = ops[i];
    FS_COMM_REQUIRE(op.peer >= 0 && op.peer < size_ && op.peer != rank_, "batch item ", i,
                    ": peer ", op.peer, " is not another rank in [0, ", size_, ")");
    FS_COMM_CHECK(CheckBuffer(ctx, absl::StrCat("batch item ", i), op.buffer.data,
                              op.buffer.count, op.buffer.dtype, op.buffer.device));
    for (size_t j = 0; j < i; ++j) {
      const P2POp& other = ops[j];
      const bool writes = !op.is_send || !other.is_send;
      FS_COMM_REQUIRE(!writes || !Overlaps(op.buffer.data, op.buffer.bytes(), other.buffer.data,
                                           other.buffer.bytes()),
                      "batch items ", j, " and ", i, " overlap and one of them receives");
    }
  }
  std::vector<P2PItem> items;
  items.reserve(ops.size());
  for (const P2POp& op : ops) {
    uint64_t& seq = op.is_send ? send_seq_[op.peer] : recv_seq_[op.peer];
    items.push_back({op, ++seq});
  }
  return DoBatchP2P(ctx, std::move(items));
}

Work Communicator::Barrier(const OpOptions& opts) {
  absl::MutexLock lock(&mu_);
  return DoBarrier(NextCollective(OpType::kBarrier, opts));
}

absl::StatusOr<std::shared_ptr<Communicator>> Communicator::Split(int color, int key,
                                                                   const OpOptions& opts) {
  absl::MutexLock lock(&mu_);
  OpContext ctx = NextCollective(OpType::kSplit, opts);
  // Every rank takes part in the exchange, including those that leave (color < 0).
  return DoSplit(ctx, color < 0 ? kNoColor : color, key);
}

#undef FS_COMM_CHECK
#undef FS_COMM_REQUIRE

}  // namespace fairscale::comm
