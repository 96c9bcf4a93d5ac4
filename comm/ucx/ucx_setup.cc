// UcxTransport's setup: Create, Init (UCX context, worker, endpoints to every peer, with or
// without UCX error handling) and the connection Handshake. The data path, failure handling and
// Shutdown are in ucx_transport.cc.
#include <ucs/debug/log_def.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>

#include <unistd.h>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "comm/ucx/ucx_internal.h"
#include "comm/ucx/ucx_transport.h"

namespace fairscale::comm {
namespace ucx_internal {
namespace {

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

}  // namespace

void InstallLogFilter() {
  static std::once_flag once;
  std::call_once(once, [] { ucs_log_push_handler(&FilterExpectedUcxLogs); });
}

}  // namespace ucx_internal

using ucx_internal::kMaxRanks;
using ucx_internal::kControlBytes;
using ucx_internal::HelloTag;
using ucx_internal::BootId;
using ucx_internal::ReadProcess;
using ucx_internal::UcsError;
using ucx_internal::UcxError;
using ucx_internal::InstallLogFilter;
using ucx_internal::Backoff;

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
  // FS_SOCKET_IFNAME (CommConfig::network_interface) names the interface the job's ranks reach
  // each other on; UCX's own UCX_NET_DEVICES, when set, wins.
  if (!config.network_interface.empty() && std::getenv("UCX_NET_DEVICES") == nullptr) {
    st = ucp_config_modify(ucp_config, "NET_DEVICES", config.network_interface.c_str());
    if (st != UCS_OK) {
      ucp_config_release(ucp_config);
      return absl::InvalidArgumentError(
          absl::StrCat("[ucx] FS_SOCKET_IFNAME='", config.network_interface,
                       "' rejected by UCX as UCX_NET_DEVICES: ", UcsError(st)));
    }
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
  const std::string boot_id = BootId();
  const int pid = static_cast<int>(::getpid());
  const std::string mine = ucx_internal::FormatAddressRecord(
      {std::string(reinterpret_cast<const char*>(address), address_bytes), boot_id, pid,
       ReadProcess(pid).start_time});
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
    absl::StatusOr<ucx_internal::AddressRecord> record = ucx_internal::ParseAddressRecord(*hex);
    if (!record.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("[ucx] rank ", rank_,
                                                     ": malformed address record of peer ", p,
                                                     ": ", record.status().message()));
    }
    const std::string& remote = record->worker_address;
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
      if (record->boot_id == boot_id && !boot_id.empty() && record->pid != pid) {
        peers_[p].pid = record->pid;
        peers_[p].start_time = record->start_time;
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
      static auto* kept ABSL_PT_GUARDED_BY(kept_mu) =
          new std::vector<std::pair<ucp_worker_h, ucp_context_h>>();
      absl::MutexLock lock(&kept_mu);
      kept->emplace_back(worker_, context_);
      return;
    }
  }
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
}

}  // namespace fairscale::comm
