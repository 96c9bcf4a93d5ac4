// The public entry points of //comm/algorithms: pick the algorithm, handle size 1, finish kAvg.
#include <algorithm>
#include <cctype>
#include <cstring>

#include "absl/algorithm/container.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "comm/algorithms/algorithms.h"
#include "comm/algorithms/pairwise.h"
#include "comm/algorithms/reduce.h"
#include "comm/algorithms/ring.h"
#include "comm/algorithms/schedule.h"
#include "comm/algorithms/tree.h"

namespace fairscale::comm::algo {

namespace {

// Large enough for any sane setting; keeps a typo from allocating terabytes of scratch.
constexpr size_t kMaxOptionBytes = size_t{1} << 30;

absl::StatusOr<size_t> ParseBytes(absl::string_view key, absl::string_view value, size_t min) {
  uint64_t v = 0;
  if (value.empty() || !absl::c_all_of(value, [](char c) { return std::isdigit(c) != 0; }) ||
      !absl::SimpleAtoi(value, &v) || v < min || v > kMaxOptionBytes) {
    return absl::InvalidArgumentError(absl::StrCat("option ", key, "='", value,
                                                   "' is not a byte count in [", min, ", ",
                                                   kMaxOptionBytes, "]"));
  }
  return static_cast<size_t>(v);
}

void CopyIfDistinct(void* dst, const void* src, size_t bytes) {
  if (bytes > 0 && dst != src) std::memcpy(dst, src, bytes);
}

int Size(const Context& ctx) { return ctx.transport->size(); }
int Rank(const Context& ctx) { return ctx.transport->rank(); }

}  // namespace

absl::StatusOr<Options> ParseOptions(const absl::flat_hash_map<std::string, std::string>& options) {
  Options out;
  for (const auto& [key, value] : options) {
    if (!absl::StartsWith(key, "algo.")) continue;
    if (key == "algo.chunk_bytes") {
      FS_ASSIGN_OR_RETURN(out.chunk_bytes, ParseBytes(key, value, 1));
    } else if (key == "algo.small_bytes") {
      FS_ASSIGN_OR_RETURN(out.small_bytes, ParseBytes(key, value, 0));
    } else if (key == "algo.heartbeat_ms") {
      FS_ASSIGN_OR_RETURN(out.heartbeat_ms, ParseBytes(key, value, 0));
    } else if (key == "algo.stall_timeout_ms") {
      FS_ASSIGN_OR_RETURN(out.stall_timeout_ms, ParseBytes(key, value, 100));
      out.stall_timeout_given = true;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown option ", key,
          " (known: algo.chunk_bytes, algo.small_bytes, algo.heartbeat_ms, "
          "algo.stall_timeout_ms)"));
    }
  }
  if (out.heartbeat_ms > 0 && out.stall_timeout_ms < 4 * out.heartbeat_ms) {
    return absl::InvalidArgumentError(absl::StrCat(
        "option algo.stall_timeout_ms=", out.stall_timeout_ms,
        " must be at least 4 x algo.heartbeat_ms=", out.heartbeat_ms,
        " (a rank is declared silent after half the stall timeout without a beat)"));
  }
  return out;
}

absl::Duration EffectiveStallTimeout(const Options& options, absl::Duration op_timeout) {
  const absl::Duration given = absl::Milliseconds(options.stall_timeout_ms);
  if (options.stall_timeout_given) return given;
  return std::max(std::min(given, op_timeout / 2),
                  absl::Milliseconds(4 * options.heartbeat_ms));
}

char* Scratch::Get(size_t bytes) {
  if (data_ == nullptr || bytes > size_) {
    data_.reset();  // free first: the old contents are not needed
    size_ = std::max<size_t>(bytes, 1);
    data_.reset(new char[size_]);
  }
  return data_.get();
}

absl::Status AllReduce(const Context& ctx, ConstBuffer send, Buffer recv, ReduceOp op) {
  const int n = Size(ctx);
  if (n == 1) {
    CopyIfDistinct(recv.data, send.data, recv.bytes());
    return absl::OkStatus();
  }
  if (recv.bytes() <= ctx.options.small_bytes) {
    FS_RETURN_IF_ERROR(DirectAllReduce(ctx, send.data, recv.data, recv.count, recv.dtype, op));
    if (op == ReduceOp::kAvg) DivideBy(recv.dtype, recv.data, recv.count, n);
    return absl::OkStatus();
  }
  // Reduce-scatter leaves block r final on rank r; the all-gather circulates the final blocks, so
  // every rank ends with the same bits.
  const Blocks blocks = Blocks::Balanced(n, recv.count);
  const int r = Rank(ctx);
  Buffer mine = recv.Slice(blocks.offset[r], blocks.length[r]);
  FS_RETURN_IF_ERROR(RingReduceScatter(ctx, send.data, blocks, mine.data, recv.dtype, op));
  if (op == ReduceOp::kAvg) DivideBy(recv.dtype, mine.data, mine.count, n);
  return RingAllGather(ctx, recv.data, blocks, recv.dtype);
}

absl::Status ReduceScatter(const Context& ctx, ConstBuffer send, Buffer recv, ReduceOp op) {
  const int n = Size(ctx);
  if (n == 1) {
    CopyIfDistinct(recv.data, send.data, recv.bytes());
    return absl::OkStatus();
  }
  if (send.bytes() <= ctx.options.small_bytes) {
    FS_RETURN_IF_ERROR(DirectReduceScatter(ctx, send.data, recv.data, recv.count, recv.dtype, op));
  } else {
    FS_RETURN_IF_ERROR(
        RingReduceScatter(ctx, send.data, Blocks::Equal(n, recv.count), recv.data, recv.dtype, op));
  }
  if (op == ReduceOp::kAvg) DivideBy(recv.dtype, recv.data, recv.count, n);
  return absl::OkStatus();
}

absl::Status AllGather(const Context& ctx, ConstBuffer send, Buffer recv) {
  const int n = Size(ctx);
  if (n == 1) {
    CopyIfDistinct(recv.data, send.data, recv.bytes());
    return absl::OkStatus();
  }
  if (recv.bytes() <= ctx.options.small_bytes) {
    return DirectAllGather(ctx, send.data, recv.data, send.count, send.dtype);
  }
  CopyIfDistinct(recv.Slice(Rank(ctx) * send.count, send.count).data, send.data, send.bytes());
  return RingAllGather(ctx, recv.data, Blocks::Equal(n, send.count), recv.dtype);
}

absl::Status Broadcast(const Context& ctx, Buffer buffer, int root) {
  if (Size(ctx) == 1) return absl::OkStatus();
  return TreeBroadcast(ctx, buffer.data, buffer.count, buffer.dtype, root);
}

absl::Status Reduce(const Context& ctx, ConstBuffer send, Buffer recv, ReduceOp op, int root) {
  const int n = Size(ctx);
  if (n == 1) {
    CopyIfDistinct(recv.data, send.data, send.bytes());
    return absl::OkStatus();
  }
  FS_RETURN_IF_ERROR(TreeReduce(ctx, send.data, recv.data, send.count, send.dtype, op, root));
  if (op == ReduceOp::kAvg && Rank(ctx) == root) DivideBy(recv.dtype, recv.data, recv.count, n);
  return absl::OkStatus();
}

absl::Status AllToAll(const Context& ctx, ConstBuffer send, Buffer recv) {
  const int n = Size(ctx);
  return PairwiseAllToAll(ctx, send.data, recv.data, send.count / n, send.dtype);
}

absl::Status Send(const Context& ctx, ConstBuffer buffer, int peer) {
  return SendTo(ctx, buffer.data, buffer.count, buffer.dtype, peer);
}

absl::Status Recv(const Context& ctx, Buffer buffer, int peer) {
  return RecvFrom(ctx, buffer.data, buffer.count, buffer.dtype, peer);
}

absl::Status BatchP2P(const Context& ctx, const std::vector<P2PItem>& items) {
  return BatchedSendRecv(ctx, items);
}

absl::Status Barrier(const Context& ctx) {
  if (Size(ctx) == 1) return absl::OkStatus();
  return DisseminationBarrier(ctx);
}

}  // namespace fairscale::comm::algo
