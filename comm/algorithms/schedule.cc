#include "comm/algorithms/schedule.h"

#include <algorithm>
#include <cstdint>
#include <deque>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "comm/algorithms/reduce.h"

namespace fairscale::comm::algo {
namespace {

// Receives posted at once (the one waited for plus look-ahead). Two ahead keep a transport busy
// while the current segment is being reduced.
constexpr size_t kRecvsInFlight = 3;

// Zero-byte messages never pass a null pointer to a transport.
char g_empty_message;

class Runner {
 public:
  Runner(const Schedule& s, const Context& ctx)
      : s_(s), ctx_(ctx), t_(*ctx.transport), n_(static_cast<int>(s.steps.size())) {}

  absl::Status Run() {
    FS_RETURN_IF_ERROR(Validate());
    if (s_.slots > 0) {
      slot_mem_ = ctx_.scratch->Get(static_cast<size_t>(s_.slots) * s_.slot_bytes);
      for (int i = s_.slots - 1; i >= 0; --i) free_.push_back(i);
    }
    slot_.assign(n_, -1);
    recv_done_.assign(n_, 0);
    for (int cur = NextRecv(0); cur < n_; cur = NextRecv(cur + 1)) {
      FS_RETURN_IF_ERROR(PostReadySends());
      FS_RETURN_IF_ERROR(PostRecvs(cur));
      if (recvs_.empty() || recvs_.front().step != cur) {
        return absl::InternalError(absl::StrCat("schedule: receive of step ", cur, " not posted"));
      }
      const Transport::Request req = recvs_.front().req;
      FS_RETURN_IF_ERROR(t_.Wait({req}, ctx_.deadline));
      recvs_.pop_front();
      CompleteRecv(cur);
    }
    FS_RETURN_IF_ERROR(PostReadySends());
    if (next_send_ != n_) {
      return absl::InternalError(absl::StrCat("schedule: send of step ", next_send_,
                                              " waits for a receive that never happens"));
    }
    if (sends_.empty()) return absl::OkStatus();
    std::vector<Transport::Request> reqs;
    reqs.reserve(sends_.size());
    for (const Pending& p : sends_) reqs.push_back(p.req);
    return t_.Wait(reqs, ctx_.deadline);
  }

 private:
  struct Pending {
    int step;
    Transport::Request req;
  };

  static absl::Status Bad(int step, absl::string_view what) {
    return absl::InternalError(absl::StrCat("schedule step ", step, ": ", what));
  }

  // Checks the builder's rules and counts, per slot, the steps that read it.
  absl::Status Validate() {
    const int size = t_.size();
    const int rank = t_.rank();
    refs_.assign(n_, 0);
    auto peer_ok = [&](int p) { return p >= 0 && p < size && p != rank; };
    auto check_slot_ref = [&](int k, const Loc& loc, bool own_ok) -> absl::Status {
      if (!loc.is_slot()) return absl::OkStatus();
      const int j = loc.slot_of;
      if (j > k || (j == k && !own_ok)) return Bad(k, "reads a later step's slot");
      if (!s_.steps[j].recv_dst.is_slot()) return Bad(k, "reads a step that has no slot");
      return absl::OkStatus();
    };
    for (int k = 0; k < n_; ++k) {
      const Step& st = s_.steps[k];
      if (st.send_peer >= 0) {
        if (!peer_ok(st.send_peer)) return Bad(k, absl::StrCat("bad send peer ", st.send_peer));
        if (st.send_after >= n_) return Bad(k, "send_after out of range");
        FS_RETURN_IF_ERROR(check_slot_ref(k, st.send_src, true));
        if (st.send_src.is_slot()) {
          if (st.send_after < st.send_src.slot_of)
            return Bad(k, "sends a slot before it is filled");
          ++refs_[st.send_src.slot_of];
        }
      }
      if (st.recv_peer < 0) continue;
      if (!peer_ok(st.recv_peer)) return Bad(k, absl::StrCat("bad recv peer ", st.recv_peer));
      if (st.recv_dst.is_slot()) {
        if (st.recv_dst.slot_of != k) return Bad(k, "receives into another step's slot");
        if (s_.slots <= 0 || st.recv_bytes > s_.slot_bytes) return Bad(k, "message exceeds slot");
      }
      int distinct[3];
      const int nd = RecvSlots(st, distinct);
      for (int i = 0; i < nd; ++i) ++refs_[distinct[i]];
      if (st.reduce) {
        FS_RETURN_IF_ERROR(check_slot_ref(k, st.reduce_out, true));
        FS_RETURN_IF_ERROR(check_slot_ref(k, st.reduce_a, true));
        if (st.recv_bytes % SizeOf(s_.dtype) != 0) return Bad(k, "partial element");
      }
    }
    return absl::OkStatus();
  }

  // The distinct slots the receive part of `st` touches (its own and those it reduces with).
  static int RecvSlots(const Step& st, int out[3]) {
    int n = 0;
    auto add = [&](const Loc& loc) {
      if (!loc.is_slot()) return;
      for (int i = 0; i < n; ++i) {
        if (out[i] == loc.slot_of) return;
      }
      out[n++] = loc.slot_of;
    };
    add(st.recv_dst);
    if (st.reduce) {
      add(st.reduce_out);
      add(st.reduce_a);
    }
    return n;
  }

  int NextRecv(int from) const {
    while (from < n_ && s_.steps[from].recv_peer < 0) ++from;
    return from;
  }

  char* Resolve(const Loc& loc, size_t bytes) const {
    char* p = loc.is_slot() ? slot_mem_ + static_cast<size_t>(slot_[loc.slot_of]) * s_.slot_bytes
                            : loc.ptr;
    return (p == nullptr && bytes == 0) ? &g_empty_message : p;
  }

  void Release(int slot_step) {
    if (--refs_[slot_step] == 0) free_.push_back(slot_[slot_step]);
  }

  // Posts, in step order, every send whose input is ready.
  absl::Status PostReadySends() {
    for (; next_send_ < n_; ++next_send_) {
      const Step& st = s_.steps[next_send_];
      if (st.send_peer < 0) continue;
      if (st.send_after >= 0 && !recv_done_[st.send_after]) break;
      const Transport::Request req =
          t_.Isend(st.send_peer, st.tag ? st.tag : ctx_.tag, Resolve(st.send_src, st.send_bytes), st.send_bytes);
      sends_.push_back({next_send_, req});
    }
    return absl::OkStatus();
  }

  // Waits for the oldest posted send, freeing what it read. Only sends of steps before `cur`
  // are waited for here: their receivers have, by the schedule rules, posted (or will post
  // without waiting on this rank) the matching receives, so this cannot close a cycle.
  absl::Status WaitOldestSend(int cur, bool* waited) {
    *waited = false;
    if (sends_.empty() || sends_.front().step >= cur) return absl::OkStatus();
    const Pending p = sends_.front();
    sends_.pop_front();
    FS_RETURN_IF_ERROR(t_.Wait({p.req}, ctx_.deadline));
    const Loc& src = s_.steps[p.step].send_src;
    if (src.is_slot()) Release(src.slot_of);
    *waited = true;
    return absl::OkStatus();
  }

  // Posts the receive of `cur` (reclaiming a slot if it needs one) and then up to
  // kRecvsInFlight - 1 later receives.
  absl::Status PostRecvs(int cur) {
    while (recvs_.size() < kRecvsInFlight) {
      next_recv_post_ = NextRecv(next_recv_post_);
      if (next_recv_post_ >= n_) break;
      const int k = next_recv_post_;
      const Step& st = s_.steps[k];
      if (st.recv_dst.is_slot()) {
        while (free_.empty()) {
          bool waited = false;
          FS_RETURN_IF_ERROR(WaitOldestSend(cur, &waited));
          if (waited) continue;
          if (k != cur) return absl::OkStatus();  // look-ahead waits for a later turn
          return absl::InternalError(absl::StrCat("schedule: no scratch slot free for step ", cur,
                                                  " (", s_.slots, " slots)"));
        }
        slot_[k] = free_.back();
        free_.pop_back();
      }
      const Transport::Request req =
          t_.Irecv(st.recv_peer, st.tag ? st.tag : ctx_.tag, Resolve(st.recv_dst, st.recv_bytes), st.recv_bytes);
      recvs_.push_back({k, req});
      ++next_recv_post_;
    }
    return absl::OkStatus();
  }

  void CompleteRecv(int k) {
    const Step& st = s_.steps[k];
    if (st.reduce) {
      const size_t count = st.recv_bytes / SizeOf(s_.dtype);
      ReduceTo(s_.op, s_.dtype, Resolve(st.reduce_out, st.recv_bytes),
               Resolve(st.reduce_a, st.recv_bytes), Resolve(st.recv_dst, st.recv_bytes), count);
    }
    recv_done_[k] = 1;
    int distinct[3];
    const int nd = RecvSlots(st, distinct);
    for (int i = 0; i < nd; ++i) Release(distinct[i]);
  }

  const Schedule& s_;
  const Context& ctx_;
  Transport& t_;
  const int n_;
  char* slot_mem_ = nullptr;
  std::vector<int> refs_;  // per step: steps still to read its slot
  std::vector<int> slot_;  // per step: its slot while it holds one
  std::vector<int> free_;
  std::vector<char> recv_done_;
  int next_send_ = 0;
  int next_recv_post_ = 0;
  std::deque<Pending> sends_;
  std::deque<Pending> recvs_;
};

}  // namespace

absl::Status RunSchedule(const Schedule& schedule, const Context& ctx) {
  return Runner(schedule, ctx).Run();
}

Blocks Blocks::Equal(int n, size_t block_count) {
  Blocks b;
  for (int i = 0; i < n; ++i) {
    b.offset.push_back(i * block_count);
    b.length.push_back(block_count);
  }
  return b;
}

Blocks Blocks::Balanced(int n, size_t count) {
  Blocks b;
  const size_t base = count / n;
  const size_t extra = count % n;
  size_t off = 0;
  for (int i = 0; i < n; ++i) {
    const size_t len = base + (static_cast<size_t>(i) < extra ? 1 : 0);
    b.offset.push_back(off);
    b.length.push_back(len);
    off += len;
  }
  return b;
}

size_t SegmentElems(const Context& ctx, DataType dtype) {
  return std::max<size_t>(1, ctx.options.chunk_bytes / SizeOf(dtype));
}

size_t NumSegments(size_t count, size_t segment_elems) {
  return std::max<size_t>(1, (count + segment_elems - 1) / segment_elems);
}

}  // namespace fairscale::comm::algo
