// UcxTransport's data path (Isend / Irecv / Wait / Poll over tagged ucp messages, driven by
// Progress), peer failure handling (endpoint errors, control messages, watched shared-memory
// peers) and Shutdown. Setup (Create, Init, Handshake) is in ucx_setup.cc.
#include "comm/ucx/ucx_transport.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "comm/ucx/ucx_internal.h"

namespace fairscale::comm {

using ucx_internal::kRankMask;
using ucx_internal::kControlBytes;
using ucx_internal::kNoticeBudget;
using ucx_internal::kFlushBudget;
using ucx_internal::kForceBudget;
using ucx_internal::DataTag;
using ucx_internal::ControlTag;
using ucx_internal::ProcessInfo;
using ucx_internal::ReadProcess;
using ucx_internal::UcsError;
using ucx_internal::Backoff;

void UcxTransport::OnEndpointError(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* a = static_cast<ErrArg*>(arg);
  a->self->endpoint_errors_.emplace_back(a->peer, status);
}

void UcxTransport::Fail(absl::Status status) {
  if (broken_.ok()) broken_ = std::move(status);
}

void UcxTransport::CheckCancel() {
  if (!cancelled_.load(std::memory_order_acquire)) return;
  absl::MutexLock lock(&cancel_mu_);
  Fail(cancel_reason_);
}

void UcxTransport::Cancel(const absl::Status& reason) {
  {
    absl::MutexLock lock(&cancel_mu_);
    if (cancel_reason_.ok()) {
      cancel_reason_ = reason.ok() ? absl::AbortedError("transport cancelled") : reason;
    }
  }
  cancelled_.store(true, std::memory_order_release);
}

void UcxTransport::OnRecv(void*, ucs_status_t status, const ucp_tag_recv_info_t* info,
                          void* user_data) {
  auto* result = static_cast<RecvResult*>(user_data);
  result->completed = true;
  result->status = status;
  if (info != nullptr) {
    result->length = info->length;
    result->sender_tag = info->sender_tag;
  }
}

// Every completion, even an immediate one, goes through OnRecv (UCP_OP_ATTR_FLAG_NO_IMM_CMPL).
void* UcxTransport::PostRecv(void* data, size_t bytes, uint64_t tag, uint64_t mask,
                             RecvResult* result) {
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  param.cb.recv = &UcxTransport::OnRecv;
  param.user_data = result;
  return ucp_tag_recv_nbx(worker_, data, bytes, tag, mask, &param);
}

void UcxTransport::PostControlRecv(int p) {
  Peer& peer = peers_[p];
  peer.control_result = RecvResult();
  void* r = PostRecv(peer.control_buffer.data(), kControlBytes, ControlTag(p), ~uint64_t{0},
                     &peer.control_result);
  if (UCS_PTR_IS_ERR(r)) {
    HandleControl(p, UCS_PTR_STATUS(r), 0);
  } else {
    peer.control = r;
  }
}

void UcxTransport::HandleControl(int p, ucs_status_t status, size_t length) {
  Peer& peer = peers_[p];
  if (status == UCS_ERR_CANCELED || peer.departed != Departure::kNone) return;
  if (status != UCS_OK && status != UCS_ERR_MESSAGE_TRUNCATED) {
    peer.departed = Departure::kVanished;
    peer.detail = UcsError(status);
    departures_ = true;
    return;
  }
  ucx_internal::ControlNotice notice = ucx_internal::DecodeControlNotice(
      absl::string_view(peer.control_buffer.data(), peer.control_buffer.size()), length);
  if (notice.bye) {
    peer.departed = Departure::kShutDown;
  } else {
    peer.departed = Departure::kFailed;
    peer.detail = std::move(notice.reason);
    departures_ = true;
  }
}

void UcxTransport::HandleEndpointErrors() {
  for (const auto& [p, status] : endpoint_errors_) {
    Peer& peer = peers_[p];
    if (peer.departed != Departure::kNone) continue;
    peer.departed = Departure::kVanished;
    peer.detail = UcsError(status);
    departures_ = true;
  }
  endpoint_errors_.clear();
}

void UcxTransport::CheckWatchedPeers() {
  if (!watching_) return;
  const absl::Time now = absl::Now();
  if (now < next_watch_) return;
  next_watch_ = now + absl::Milliseconds(100);
  for (int p = 0; p < size_; ++p) {
    Peer& peer = peers_[p];
    if (peer.error_handling || peer.departed != Departure::kNone) continue;
    // A peer's failure notice can be stuck behind an undeliverable message in UCX's shared-memory
    // FIFO (one from a dead third rank): Shutdown also leaves it in the store.
    if (absl::StatusOr<bool> has = store_->Check(absl::StrCat("ucx/failed/", p));
        has.ok() && *has) {
      absl::StatusOr<std::string> why =
          store_->Get(absl::StrCat("ucx/failed/", p), absl::ZeroDuration());
      peer.departed = Departure::kFailed;
      peer.detail = why.ok() ? *why : "(reason not readable from the store)";
      departures_ = true;
      continue;
    }
    if (peer.pid == 0) continue;
    const ProcessInfo info = ReadProcess(peer.pid);
    if (info.state == 0 || info.state == 'Z' || info.state == 'X' ||
        info.start_time != peer.start_time) {
      peer.departed = Departure::kVanished;
      peer.detail = absl::StrCat("its process ", peer.pid, " on this host has exited");
      departures_ = true;
    }
  }
}

unsigned UcxTransport::Progress() {
  unsigned events = 0;
  while (unsigned n = ucp_worker_progress(worker_)) {
    events += n;
    if (events > 64) break;
  }
  // Control messages first: a peer that said goodbye and then closed is not a failure.
  for (int p = 0; p < size_; ++p) {
    Peer& peer = peers_[p];
    if (peer.control == nullptr) continue;
    if (!peer.control_result.completed) continue;
    ucp_request_free(peer.control);
    peer.control = nullptr;
    HandleControl(p, peer.control_result.status, peer.control_result.length);
  }
  HandleEndpointErrors();
  CheckWatchedPeers();
  return events;
}

UcxTransport::Op& UcxTransport::AddOp(Request* id, Op op, void* status_ptr) {
  *id = next_request_++;
  Op& added = ops_.emplace(*id, op).first->second;
  if (status_ptr == nullptr) {
    added.done = true;
  } else if (UCS_PTR_IS_ERR(status_ptr)) {
    added.done = true;
    const ucs_status_t st = UCS_PTR_STATUS(status_ptr);
    Fail(absl::UnavailableError(absl::StrCat(op.recv ? "receive of " : "send of ",
                                             DescribeTag(op.tag), op.recv ? " from" : " to",
                                             " peer ", op.peer, " failed: ", UcsError(st))));
  } else {
    added.ucx = status_ptr;
  }
  return added;
}

Transport::Request UcxTransport::Isend(int peer, uint64_t tag, const void* data, size_t bytes) {
  Op op{peer, /*recv=*/false, tag, bytes};
  Request id = 0;
  if (peer < 0 || peer >= size_ || peer == rank_) {
    Fail(absl::InvalidArgumentError(
        absl::StrCat("send of ", DescribeTag(tag), " to invalid peer ", peer)));
    AddOp(&id, op, nullptr);
    return id;
  }
  if (!broken_.ok() || shut_down_) {
    AddOp(&id, op, nullptr);
    return id;
  }
  if (peers_[peer].departed != Departure::kNone) {
    Fail(DepartureError(peer));
    AddOp(&id, op, nullptr);
    return id;
  }
  ucp_request_param_t param{};
  AddOp(&id, op, ucp_tag_send_nbx(peers_[peer].ep, data, bytes, DataTag(rank_, tag), &param));
  return id;
}

Transport::Request UcxTransport::Irecv(int peer, uint64_t tag, void* data, size_t bytes) {
  Op op{peer, /*recv=*/true, tag, bytes};
  Request id = 0;
  if (peer < 0 || peer >= size_ || peer == rank_) {
    Fail(absl::InvalidArgumentError(
        absl::StrCat("receive of ", DescribeTag(tag), " from invalid peer ", peer)));
    AddOp(&id, op, nullptr);
    return id;
  }
  if (!broken_.ok() || shut_down_) {
    AddOp(&id, op, nullptr);
    return id;
  }
  Op& added = AddOp(&id, op, nullptr);
  added.done = false;
  void* r = PostRecv(data, bytes, DataTag(peer, 0), kRankMask, &added.result);
  if (UCS_PTR_IS_ERR(r)) {
    added.done = true;
    Fail(absl::UnavailableError(absl::StrCat("receive of ", DescribeTag(tag), " from peer ", peer,
                                             " failed: ", UcsError(UCS_PTR_STATUS(r)))));
  } else {
    added.ucx = r;
  }
  return id;
}

void UcxTransport::UpdateOp(Request, Op& op) {
  if (op.done || op.ucx == nullptr) return;
  ucs_status_t st;
  if (op.recv) {
    if (!op.result.completed) return;
    st = op.result.status;
  } else {
    st = ucp_request_check_status(op.ucx);
    if (st == UCS_INPROGRESS) return;
  }
  ucp_request_free(op.ucx);
  op.ucx = nullptr;
  op.done = true;
  if (st == UCS_OK) {
    if (op.recv) {
      absl::Status s = ucx_internal::CheckReceived(op.peer, op.tag, op.bytes, op.result.length,
                                                   op.result.sender_tag);
      if (!s.ok()) Fail(std::move(s));
    }
    return;
  }
  if (st == UCS_ERR_MESSAGE_TRUNCATED) {
    Fail(ucx_internal::TruncatedError(op.peer, op.tag, op.bytes));
    return;
  }
  if (st == UCS_ERR_CANCELED) {
    Fail(absl::AbortedError(absl::StrCat(op.recv ? "receive of " : "send of ", DescribeTag(op.tag),
                                         " cancelled")));
    return;
  }
  HandleEndpointErrors();
  if (peers_[op.peer].departed != Departure::kNone) {
    Fail(DepartureError(op.peer));
  } else {
    Fail(absl::UnavailableError(absl::StrCat(op.recv ? "receive of " : "send of ",
                                             DescribeTag(op.tag), op.recv ? " from" : " to",
                                             " peer ", op.peer, " failed: ", UcsError(st))));
  }
}

absl::Status UcxTransport::DepartureError(int p) const {
  const Peer& peer = peers_[p];
  switch (peer.departed) {
    case Departure::kShutDown:
      return absl::UnavailableError(
          absl::StrCat("peer ", p,
                       " has shut down its communicator (it finished or was destroyed)"));
    case Departure::kFailed:
      return absl::UnavailableError(absl::StrCat("peer ", p, " failed: ", peer.detail));
    case Departure::kVanished:
      return absl::UnavailableError(
          absl::StrCat("peer ", p, " is unreachable (died or closed its endpoint): ", peer.detail));
    case Departure::kNone:
      break;
  }
  return absl::InternalError(absl::StrCat("peer ", p, " has not departed"));
}

absl::Status UcxTransport::DeadlineError(absl::Span<const Request> requests) const {
  std::vector<int> to, from;
  for (const Request r : requests) {
    auto it = ops_.find(r);
    if (it == ops_.end() || it->second.done) continue;
    (it->second.recv ? from : to).push_back(it->second.peer);
  }
  std::sort(to.begin(), to.end());
  to.erase(std::unique(to.begin(), to.end()), to.end());
  std::sort(from.begin(), from.end());
  from.erase(std::unique(from.begin(), from.end()), from.end());
  std::string message = "deadline exceeded";
  if (!from.empty()) {
    absl::StrAppend(&message, "; still receiving from peer ", absl::StrJoin(from, ", peer "));
  }
  if (!to.empty()) {
    absl::StrAppend(&message, "; still sending to peer ", absl::StrJoin(to, ", peer "));
  }
  return absl::DeadlineExceededError(message);
}

absl::Status UcxTransport::Wait(absl::Span<const Request> requests, absl::Time deadline) {
  CheckCancel();
  if (!broken_.ok()) return broken_;
  if (shut_down_) return absl::FailedPreconditionError("[ucx] transport already shut down");
  for (const Request r : requests) {
    if (!ops_.contains(r)) {
      Fail(absl::InternalError(absl::StrCat("Wait on unknown request ", r)));
      return broken_;
    }
  }
  Backoff backoff;
  while (true) {
    const unsigned events = Progress();
    bool all_done = true;
    for (const Request r : requests) {
      Op& op = ops_.at(r);
      UpdateOp(r, op);
      all_done = all_done && op.done;
    }
    CheckCancel();
    if (!broken_.ok()) return broken_;
    if (all_done) {
      for (const Request r : requests) ops_.erase(r);
      return absl::OkStatus();
    }
    // Requests that can no longer complete: a peer failed or vanished, or a peer that shut down
    // cleanly (everything it sent has arrived before its goodbye) still owes a message.
    for (const Request r : requests) {
      const Op& op = ops_.at(r);
      if (op.done) continue;
      const Departure d = peers_[op.peer].departed;
      if (d == Departure::kFailed || d == Departure::kVanished ||
          (d == Departure::kShutDown && events == 0)) {
        Fail(DepartureError(op.peer));
        return broken_;
      }
    }
    if (absl::Now() >= deadline) {
      Fail(DeadlineError(requests));
      return broken_;
    }
    if (events > 0) {
      backoff.Reset();
    } else {
      backoff.Idle();
    }
  }
}

absl::Status UcxTransport::Poll() {
  CheckCancel();
  if (!broken_.ok() || shut_down_) return broken_;
  Progress();
  if (departures_) {
    for (int p = 0; p < size_; ++p) {
      const Departure d = peers_[p].departed;
      if (d == Departure::kFailed || d == Departure::kVanished) {
        Fail(DepartureError(p));
        break;
      }
    }
  }
  return broken_;
}

void UcxTransport::Shutdown(const absl::Status& reason) {
  if (shut_down_ || worker_ == nullptr) return;
  shut_down_ = true;
  // 1. Tell the peers (bounded): "bye" or the reason of the failure.
  const std::string notice = ucx_internal::EncodeControlNotice(reason);
  if (!reason.ok() && watching_ && store_ != nullptr) {
    (void)store_->Set(absl::StrCat("ucx/failed/", rank_), notice.substr(1));
  }
  std::vector<void*> pending;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_ || peers_[p].ep == nullptr || peers_[p].departed != Departure::kNone) continue;
    ucp_request_param_t param{};
    void* r = ucp_tag_send_nbx(peers_[p].ep, notice.data(), notice.size(), ControlTag(rank_),
                               &param);
    if (UCS_PTR_IS_PTR(r)) pending.push_back(r);
  }
  // 2. Cancel every posted receive: nothing may write into the caller's buffers after we return.
  for (auto& [id, op] : ops_) {
    if (op.recv && op.ucx != nullptr) ucp_request_cancel(worker_, op.ucx);
  }
  for (Peer& peer : peers_) {
    if (peer.control != nullptr) ucp_request_cancel(worker_, peer.control);
  }
  const auto drain = [&](absl::Duration budget) {
    const absl::Time until = absl::Now() + budget;
    Backoff backoff;
    while (true) {
      ucp_worker_progress(worker_);
      pending.erase(std::remove_if(pending.begin(), pending.end(),
                                   [](void* r) {
                                     if (ucp_request_check_status(r) == UCS_INPROGRESS) {
                                       return false;
                                     }
                                     ucp_request_free(r);
                                     return true;
                                   }),
                    pending.end());
      if (pending.empty() || absl::Now() >= until) return pending.empty();
      backoff.Idle();
    }
  };
  // Requests that did not complete in time are released to UCX (it frees them when they do, or
  // when the worker is destroyed).
  const auto release_rest = [&] {
    for (void* r : pending) ucp_request_free(r);
    pending.clear();
  };
  // Without error handling a peer learns of our failure from this notice only: give it time to
  // get out behind the data queued before it (progress also moves that data).
  bool unguarded = false;
  for (const Peer& peer : peers_) {
    unguarded = unguarded || (peer.ep != nullptr && !peer.error_handling);
  }
  drain(unguarded && !reason.ok() ? kFlushBudget : kNoticeBudget);
  release_rest();
  // 3. Close the endpoints: flush when clean (the goodbye and our last messages arrive), force
  //    otherwise. Force completes every send still in flight with an error. An endpoint without
  //    error handling cannot be forced, and a flush to a dead peer never ends: those are left to
  //    ucp_worker_destroy.
  //    Likewise on a failure: its pending requests are released without waiting (a live peer has
  //    the failure notice and stops too).
  const auto abandon = [&](int p) {
    return !peers_[p].error_handling &&
           (peers_[p].departed == Departure::kVanished || !reason.ok());
  };
  for (int p = 0; p < size_; ++p) {
    Peer& peer = peers_[p];
    if (peer.ep == nullptr || abandon(p)) continue;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = (reason.ok() && peer.departed == Departure::kNone) || !peer.error_handling
                      ? 0
                      : UCP_EP_CLOSE_FLAG_FORCE;
    void* r = ucp_ep_close_nbx(peer.ep, &param);
    if (UCS_PTR_IS_PTR(r)) pending.push_back(r);
    peer.ep = nullptr;
  }
  drain(reason.ok() ? kFlushBudget : kForceBudget);
  release_rest();
  // 4. Collect every data request (receives are cancelled, closed endpoints completed their
  //    sends). Requests of abandoned endpoints are released at once.
  for (auto& [id, op] : ops_) {
    if (op.ucx == nullptr) continue;
    if (!abandon(op.peer)) {
      pending.push_back(op.ucx);
    } else {
      ucp_request_free(op.ucx);
    }
    op.ucx = nullptr;
  }
  drain(kForceBudget);
  release_rest();
  for (Peer& peer : peers_) {
    if (peer.control == nullptr) continue;
    ucp_request_free(peer.control);  // cancelled above; UCX frees it when that completes
    peer.control = nullptr;
  }
  Fail(reason.ok() ? absl::FailedPreconditionError("[ucx] transport shut down") : reason);
}

absl::StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(std::shared_ptr<Store> store,
                                                              int rank, int size,
                                                              const CommConfig& config) {
  FS_ASSIGN_OR_RETURN(std::unique_ptr<UcxTransport> t,
                      UcxTransport::Create(std::move(store), rank, size, config));
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace fairscale::comm
