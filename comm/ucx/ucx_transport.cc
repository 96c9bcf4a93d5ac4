#include "comm/ucx/ucx_transport.h"

#include <sched.h>
#include <time.h>
#include <ucs/debug/log_def.h>

#include <cstdarg>
#include <cstdio>
#include <mutex>

#include <unistd.h>

#include <algorithm>
#include <fstream>
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

namespace fairscale::comm {
namespace {

constexpr int kRankShift = 48;
constexpr uint64_t kLowMask = (uint64_t{1} << kRankShift) - 1;
constexpr uint64_t kControlBit = uint64_t{1} << 63;
constexpr uint64_t kRankMask = ~kLowMask;  // control bit + sender rank
constexpr int kMaxRanks = 1 << 15;
constexpr size_t kControlBytes = 1024;
constexpr char kBye = 'B';
constexpr char kFailed = 'F';
// Bounds of Shutdown: the failure notices and a clean flush of every endpoint.
constexpr absl::Duration kNoticeBudget = absl::Milliseconds(200);
constexpr absl::Duration kFlushBudget = absl::Seconds(2);
constexpr absl::Duration kForceBudget = absl::Seconds(2);

uint64_t DataTag(int sender, uint64_t tag) {
  return (static_cast<uint64_t>(sender) << kRankShift) | (tag & kLowMask);
}
uint64_t ControlTag(int sender) {
  return kControlBit | (static_cast<uint64_t>(sender) << kRankShift);
}
// The connection handshake of Init (never matched by the control receives: low bit set).
uint64_t HelloTag(int sender) { return ControlTag(sender) | 1; }

// This boot's id: two processes share /proc (and shared memory) only when it matches.
std::string BootId() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

// State and start time (clock ticks since boot) of a process, from /proc/<pid>/stat; state 0 when
// the process does not exist.
struct ProcessInfo {
  char state = 0;
  uint64_t start_time = 0;
};
ProcessInfo ReadProcess(int pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat;
  std::getline(in, stat);
  ProcessInfo info;
  const size_t paren = stat.rfind(')');  // the command name may contain spaces and parens
  if (paren == std::string::npos) return info;
  std::vector<absl::string_view> fields =
      absl::StrSplit(absl::string_view(stat).substr(paren + 1), ' ', absl::SkipEmpty());
  // After the name: state is field 3 of stat(5), starttime field 22.
  if (fields.size() < 20 || fields[0].empty()) return info;
  if (!absl::SimpleAtoi(fields[19], &info.start_time)) return info;
  info.state = fields[0][0];
  return info;
}

std::string UcsError(ucs_status_t status) { return ucs_status_string(status); }

absl::Status UcxError(absl::string_view what, ucs_status_t status) {
  return absl::InternalError(absl::StrCat("[ucx] ", what, ": ", UcsError(status)));
}

// UCX logs two messages that are expected here and would only alarm a reader:
// * "no active messages transport to ...: posix/memory - no peer failure handler, ..." when the
//   first ucp_ep_create (with UCP_ERR_HANDLING_MODE_PEER) meets shared memory; the endpoint is
//   then created without error handling (see Init).
// * "unexpected tag-receive descriptor ... was not matched" at ucp_worker_destroy, for messages
//   nobody will receive: a peer's goodbye arriving after our own shutdown, or the rest of an op
//   that failed.
// Everything else reaches UCX's default handler.
ucs_log_func_rc_t FilterExpectedUcxLogs(const char*, unsigned, const char*, ucs_log_level_t,
                                        const ucs_log_component_config_t*, const char* format,
                                        va_list ap) {
  // Only warnings and errors reach here at UCX's default log level: formatting them is cheap.
  char text[2048];
  va_list copy;
  va_copy(copy, ap);
  std::vsnprintf(text, sizeof(text), format, copy);
  va_end(copy);
  if (absl::StrContains(text, "was not matched")) return UCS_LOG_FUNC_RC_STOP;
  // Without error handling (the retry) this reason cannot appear: a failing retry still logs.
  if (absl::StrContains(text, "no peer failure handler")) return UCS_LOG_FUNC_RC_STOP;
  return UCS_LOG_FUNC_RC_CONTINUE;
}

void InstallLogFilter() {
  static std::once_flag once;
  std::call_once(once, [] { ucs_log_push_handler(&FilterExpectedUcxLogs); });
}

// Backoff of the progress loops: spin (a reply often arrives within microseconds), then yield,
// then nap 20 us per round. (Napping from the start, 50 us after 128 spins, was tried: it tripled
// small-message latency over shared memory on the loaded 2-core VM and won nothing measurable.)
class Backoff {
 public:
  void Reset() { idle_ = 0; }
  void Idle() {
    ++idle_;
    if (idle_ < 256) return;
    if (idle_ < 4096) {
      sched_yield();
      return;
    }
    const timespec nap{0, 20'000};  // 20 us
    nanosleep(&nap, nullptr);
  }

 private:
  int idle_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<UcxTransport>> UcxTransport::Create(std::shared_ptr<Store> store,
                                                                   int rank, int size,
                                                                   const CommConfig& config) {
  if (store == nullptr && size > 1) {
    return absl::InvalidArgumentError("[ucx] the ucx backend needs CommConfig::store");
  }
  if (size < 1 || size > kMaxRanks || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("[ucx] rank ", rank, " / size ", size, " out of range (size <= 32768)"));
  }
  for (const auto& [key, value] : config.options) {
    if (!absl::StartsWith(key, "algo.") && key != "ucx.tls") {
      return absl::InvalidArgumentError(absl::StrCat(
          "[ucx] unknown option '", key, "'; the ucx backend accepts ucx.tls and algo.*"));
    }
  }
  std::unique_ptr<UcxTransport> t(new UcxTransport(rank, size));
  t->store_ = store;
  FS_RETURN_IF_ERROR(t->Init(store.get(), config));
  return t;
}

UcxTransport::UcxTransport(int rank, int size) : rank_(rank), size_(size), peers_(size) {}

absl::Status UcxTransport::Init(Store* store, const CommConfig& config) {
  InstallLogFilter();
  ucp_config_t* ucp_config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &ucp_config);
  if (st != UCS_OK) return UcxError("ucp_config_read", st);
  // A peer whose host dies without closing its tcp connections is found by UCX's keepalive
  // (endpoints with error handling only); its default round (20 s in 1.13) is as long as a
  // typical op timeout.
  if (std::getenv("UCX_KEEPALIVE_INTERVAL") == nullptr) {
    (void)ucp_config_modify(ucp_config, "KEEPALIVE_INTERVAL", "1s");
  }
  const char* tls = std::getenv("UCX_TLS");
  transports_ = tls != nullptr ? tls : "all";
  if (auto it = config.options.find("ucx.tls"); it != config.options.end()) {
    st = ucp_config_modify(ucp_config, "TLS", it->second.c_str());
    if (st != UCS_OK) {
      ucp_config_release(ucp_config);
      return absl::InvalidArgumentError(absl::StrCat("[ucx] option ucx.tls='", it->second,
                                                     "' rejected by UCX: ", UcsError(st)));
    }
    transports_ = it->second;
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG;
  st = ucp_init(&params, ucp_config, &context_);
  ucp_config_release(ucp_config);
  if (st != UCS_OK) {
    return UcxError(absl::StrCat("ucp_init (UCX_TLS=", transports_, ")"), st);
  }
  ucp_worker_params_t wparams{};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
  st = ucp_worker_create(context_, &wparams, &worker_);
  if (st != UCS_OK) return UcxError("ucp_worker_create", st);
  if (size_ == 1) return absl::OkStatus();

  ucp_address_t* address = nullptr;
  size_t address_bytes = 0;
  st = ucp_worker_get_address(worker_, &address, &address_bytes);
  if (st != UCS_OK) return UcxError("ucp_worker_get_address", st);
  // "<address hex> <boot id> <pid> <start time>".
  const std::string boot_id = BootId();
  const int pid = static_cast<int>(::getpid());
  const std::string mine = absl::StrCat(
      absl::BytesToHexString(
          absl::string_view(reinterpret_cast<const char*>(address), address_bytes)),
      " ", boot_id.empty() ? "-" : boot_id, " ", pid, " ", ReadProcess(pid).start_time);
  ucp_worker_release_address(worker_, address);
  FS_RETURN_IF_ERROR(store->Set(absl::StrCat("ucx/address/", rank_), mine));

  const absl::Time deadline = absl::Now() + config.timeout;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    absl::StatusOr<std::string> hex = store->Get(
        absl::StrCat("ucx/address/", p), std::max(deadline - absl::Now(), absl::ZeroDuration()));
    if (!hex.ok()) {
      return absl::Status(hex.status().code(),
                          absl::StrCat("[ucx] rank ", rank_, " waiting for the address of peer ",
                                       p, ": ", hex.status().message()));
    }
    const std::vector<std::string> parts = absl::StrSplit(*hex, ' ');
    int peer_pid = 0;
    uint64_t peer_start = 0;
    if (parts.size() != 4 || !absl::SimpleAtoi(parts[2], &peer_pid) ||
        !absl::SimpleAtoi(parts[3], &peer_start)) {
      return absl::InvalidArgumentError(absl::StrCat("[ucx] rank ", rank_,
                                                     ": malformed address record of peer ", p));
    }
    const std::string remote = absl::HexStringToBytes(parts[0]);
    err_args_.push_back(std::make_unique<ErrArg>(ErrArg{this, p}));
    ucp_ep_params_t ep_params{};
    ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                           UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep_params.address = reinterpret_cast<const ucp_address_t*>(remote.data());
    ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep_params.err_handler.cb = &UcxTransport::OnEndpointError;
    ep_params.err_handler.arg = err_args_.back().get();
    st = ucp_ep_create(worker_, &ep_params, &peers_[p].ep);
    if (st == UCS_ERR_UNREACHABLE) {
      // The transports reaching this peer cannot report its failure (shared memory): connect
      // without error handling and watch its process instead, when it runs on this host.
      ep_params.field_mask &=
          ~(UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER);
      st = ucp_ep_create(worker_, &ep_params, &peers_[p].ep);
      peers_[p].error_handling = false;
      watching_ = true;
      if (parts[1] == boot_id && !boot_id.empty() && peer_pid != pid) {
        peers_[p].pid = peer_pid;
        peers_[p].start_time = peer_start;
      }
    }
    if (st != UCS_OK) {
      return UcxError(absl::StrCat("ucp_ep_create to peer ", p, " (UCX_TLS=", transports_, ")"),
                      st);
    }
    peers_[p].control_buffer.resize(kControlBytes);
    PostControlRecv(p);
  }
  return Handshake(deadline);
}

// UCX connects endpoints lazily: the first message to a peer runs a wireup exchange. A wireup
// reply still pending on a shared-memory endpoint to a peer that died trips an assertion in UCX
// 1.13's ucp_worker_destroy (ucp_request.c:684 "got REP message"). So every pair exchanges one
// message here, which completes all wireups while every rank is alive: our send completes once
// the peer answered our wireup, and the peer's message arrives once it had our answer.
absl::Status UcxTransport::Handshake(absl::Time deadline) {
  const char hello = 'H';
  std::vector<char> in(size_);
  std::vector<RecvResult> results(size_);
  std::vector<void*> sends(size_, nullptr), recvs(size_, nullptr);
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    ucp_request_param_t param{};
    void* s = ucp_tag_send_nbx(peers_[p].ep, &hello, 1, HelloTag(rank_), &param);
    void* r = PostRecv(&in[p], 1, HelloTag(p), ~uint64_t{0}, &results[p]);
    if (UCS_PTR_IS_ERR(s) || UCS_PTR_IS_ERR(r)) {
      Fail(UcxError(absl::StrCat("handshake with peer ", p),
                    UCS_PTR_STATUS(UCS_PTR_IS_ERR(s) ? s : r)));
    }
    if (UCS_PTR_IS_PTR(s)) sends[p] = s;
    if (UCS_PTR_IS_PTR(r)) recvs[p] = r;
  }
  Backoff backoff;
  while (broken_.ok()) {
    const unsigned events = Progress();
    std::vector<int> waiting;
    for (int p = 0; p < size_; ++p) {
      if (sends[p] != nullptr && ucp_request_check_status(sends[p]) != UCS_INPROGRESS) {
        const ucs_status_t st = ucp_request_check_status(sends[p]);
        ucp_request_free(sends[p]);
        sends[p] = nullptr;
        if (st != UCS_OK) Fail(UcxError(absl::StrCat("handshake send to peer ", p), st));
      }
      if (recvs[p] != nullptr && results[p].completed) {
        ucp_request_free(recvs[p]);
        recvs[p] = nullptr;
        if (results[p].status != UCS_OK) {
          Fail(UcxError(absl::StrCat("handshake receive from peer ", p), results[p].status));
        }
      }
      if (sends[p] != nullptr || recvs[p] != nullptr) waiting.push_back(p);
    }
    if (waiting.empty()) break;
    for (int p : waiting) {
      if (peers_[p].departed != Departure::kNone) Fail(DepartureError(p));
    }
    if (broken_.ok() && absl::Now() >= deadline) {
      Fail(absl::DeadlineExceededError(
          absl::StrCat("[ucx] rank ", rank_, ": connection handshake timed out waiting for peer ",
                       absl::StrJoin(waiting, ", peer "), " (UCX_TLS=", transports_, ")")));
    }
    if (events > 0) {
      backoff.Reset();
    } else {
      backoff.Idle();
    }
  }
  // On failure the requests still in flight are cancelled (receives) or released to UCX.
  for (int p = 0; p < size_; ++p) {
    if (recvs[p] != nullptr) {
      ucp_request_cancel(worker_, recvs[p]);
      while (!results[p].completed) ucp_worker_progress(worker_);
      ucp_request_free(recvs[p]);
    }
    if (sends[p] != nullptr) ucp_request_free(sends[p]);
  }
  return broken_;
}

UcxTransport::~UcxTransport() {
  if (!shut_down_ && worker_ != nullptr) Shutdown(absl::OkStatus());
  // An endpoint without error handling (shared memory) to a peer that died may hold a wireup
  // message UCX can no longer send; ucp_worker_destroy in UCX 1.13 then aborts the process
  // (ucp_request.c:684 "got REP message"). Such a worker is kept (reachable, so not a leak to
  // LeakSanitizer) instead: a process whose peer was killed trades its memory for not crashing.
  for (const Peer& peer : peers_) {
    if (!peer.error_handling && peer.departed == Departure::kVanished) {
      static absl::Mutex kept_mu(absl::kConstInit);
      static auto* kept = new std::vector<std::pair<ucp_worker_h, ucp_context_h>>();
      absl::MutexLock lock(&kept_mu);
      kept->emplace_back(worker_, context_);
      return;
    }
  }
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
}

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
  const char* data = peer.control_buffer.data();
  if (length >= 1 && data[0] == kBye) {
    peer.departed = Departure::kShutDown;
  } else {
    peer.departed = Departure::kFailed;
    peer.detail = length >= 1 ? std::string(data + 1, std::min(length, kControlBytes) - 1)
                              : "(no reason given)";
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
    const RecvResult& info = op.result;
    if (op.recv &&
        (info.length != op.bytes || (info.sender_tag & kLowMask) != (op.tag & kLowMask))) {
      const uint64_t theirs = (op.tag & ~kLowMask) | (info.sender_tag & kLowMask);
      Fail(absl::InvalidArgumentError(absl::StrCat(
          "message mismatch with peer ", op.peer, ": it sent ", DescribeTag(theirs), " (",
          info.length, " bytes), this rank expected ", DescribeTag(op.tag), " (", op.bytes,
          " bytes)")));
    }
    return;
  }
  if (st == UCS_ERR_MESSAGE_TRUNCATED) {
    Fail(absl::InvalidArgumentError(
        absl::StrCat("message mismatch with peer ", op.peer, ": it sent more than the ", op.bytes,
                     " bytes this rank expected for ", DescribeTag(op.tag))));
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
  std::string notice(1, reason.ok() ? kBye : kFailed);
  if (!reason.ok()) {
    absl::StrAppend(&notice, absl::StatusCodeToString(reason.code()), ": ",
                    reason.message().substr(0, kControlBytes - 64));
  }
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
