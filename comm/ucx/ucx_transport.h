// UcxTransport: the Transport of the ucx backend (//comm/ucx:ucx_transport), over UCX's ucp tag
// API (Debian libucx 1.13). //comm/ucx turns it into a Communicator through
// CreateTransportCommunicator, so the collective algorithms are those of //comm/algorithms.
//
// Design (see transport.h for the contract it implements):
// * Setup: one ucp context and one worker per transport (i.e. per communicator and Split child).
//   Each rank publishes its worker address in the store and creates an endpoint to every peer
//   with UCP_ERR_HANDLING_MODE_PEER and an error callback, then exchanges one message with every
//   peer so that all endpoints are wired up before Create returns. Which UCX transports carry
//   the bytes (tcp, shared memory, ...) is UCX's choice, steered by its own environment (UCX_TLS)
//   or the option "ucx.tls".
// * Tags: a data message carries the ucp tag (sender rank << 48) | (op tag & 0xffff'ffff'ffff),
//   i.e. the op type, the 24-bit signature and the low 16 bits of the sequence number. A receive
//   matches on the sender rank only, so the k-th receive from a peer takes the k-th message that
//   peer sent here (UCX matches tagged messages of one endpoint in order); the full 48 bits and the
//   length are then compared with what the receive expected, so a mismatch is kInvalidArgument
//   naming the peer and both ops, and a message longer than the buffer is truncated by UCX
//   (nothing is written past the buffer) and reported the same way.
// * Control messages (bit 63 set): one receive per peer is always posted for them. Shutdown()
//   sends "bye" (clean) or "failed: <reason>" to every peer, so peers fail fast naming the reason.
// * Progress: single-threaded. The communicator's worker thread is the progress thread: Wait()
//   and Poll() call ucp_worker_progress (worker in UCS_THREAD_MODE_SINGLE); every ucp call
//   happens on that thread. Wait spins, then yields, then naps (tens of microseconds), checking
//   the deadline and Cancel()'s flag on every round, so Cancel() takes effect within
//   microseconds to a millisecond.
// * Failure: an endpoint error callback (a peer that died: connection reset over tcp), the exit of
//   a peer process on this host (watched through /proc where UCX cannot handle peer failures:
//   its shared-memory transports in 1.13), or a "failed" control message marks the peer
//   departed. Wait() fails with kUnavailable naming the peer when the requests it waits for
//   cannot complete; Poll() at once. A peer that said "bye" fails this rank only when it sends
//   to it, or waits for a message the peer never sent. Shutdown cancels every outstanding
//   request and closes the endpoints (flush when clean, force otherwise) before it returns, so
//   no buffer is touched afterwards. See README.md in this directory.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/node_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "comm/algorithms/transport.h"
#include "comm/config.h"
#include "comm/store/store.h"

namespace fairscale::comm {

class UcxTransport final : public Transport {
 public:
  // Creates the context and worker, exchanges addresses through `store` (blocking, collective,
  // bounded by config.timeout) and creates the endpoints. `store` should be private to this
  // communicator (TransportCommunicator passes a PrefixStore). config.options may hold "algo.*"
  // keys and "ucx.tls": the UCX transports of this communicator, overriding UCX_TLS (e.g. "tcp",
  // "posix,sysv,self"; used by the benchmark to run both in one process).
  static absl::StatusOr<std::unique_ptr<UcxTransport>> Create(std::shared_ptr<Store> store,
                                                              int rank, int size,
                                                              const CommConfig& config);
  ~UcxTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Request Isend(int peer, uint64_t tag, const void* data, size_t bytes) override;
  Request Irecv(int peer, uint64_t tag, void* data, size_t bytes) override;
  absl::Status Wait(absl::Span<const Request> requests, absl::Time deadline) override;
  absl::Status Poll() override;
  void Cancel(const absl::Status& reason) override;
  void Shutdown(const absl::Status& reason) override;

  // The UCX transports the worker may use, e.g. "tcp" or "posix,sysv,self" (for logs/benchmarks).
  const std::string& transports() const { return transports_; }

 private:
  // Filled by the receive callback (UCX calls it from ucp_worker_progress on our thread).
  struct RecvResult {
    bool completed = false;
    ucs_status_t status = UCS_OK;
    size_t length = 0;
    uint64_t sender_tag = 0;
  };
  struct Op {
    int peer;
    bool recv;
    uint64_t tag;
    size_t bytes;
    void* ucx = nullptr;  // the ucp request while in flight
    bool done = false;
    RecvResult result;
  };
  enum class Departure { kNone, kShutDown, kFailed, kVanished };
  struct Peer {
    ucp_ep_h ep = nullptr;
    Departure departed = Departure::kNone;
    std::string detail;
    // The posted receive for this peer's control messages.
    void* control = nullptr;
    RecvResult control_result;
    std::vector<char> control_buffer;
    // UCX 1.13's shared-memory transports cannot detect a failed peer (no
    // UCP_ERR_HANDLING_MODE_PEER: ucp_ep_create says "no peer failure handler"). Such endpoints
    // are created without error handling, and a peer process on this host is watched through
    // /proc instead (pid and start time, published with its address).
    bool error_handling = true;
    int pid = 0;
    uint64_t start_time = 0;
  };
  struct ErrArg {
    UcxTransport* self;
    int peer;
  };

  UcxTransport(int rank, int size);
  absl::Status Init(Store* store, const CommConfig& config);  // store: null when size is 1
  absl::Status Handshake(absl::Time deadline);

  void Fail(absl::Status status);
  void CheckCancel();
  Op& AddOp(Request* id, Op op, void* status_ptr);
  // Progresses the worker once and handles what completed; returns the number of events.
  unsigned Progress();
  void UpdateOp(Request id, Op& op);
  void PostControlRecv(int p);
  void HandleControl(int p, ucs_status_t status, size_t length);
  void HandleEndpointErrors();
  // Checks (at most every 100 ms) the peers without error handling: a failure notice in the store
  // ("ucx/failed/<rank>") or, on this host, the exit of their process.
  void CheckWatchedPeers();
  absl::Status DepartureError(int p) const;
  absl::Status DeadlineError(absl::Span<const Request> requests) const;
  static void OnRecv(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                     void* user_data);
  void* PostRecv(void* data, size_t bytes, uint64_t tag, uint64_t mask, RecvResult* result);
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);

  const int rank_;
  const int size_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string transports_;
  std::vector<Peer> peers_;
  std::vector<std::unique_ptr<ErrArg>> err_args_;
  std::vector<std::pair<int, ucs_status_t>> endpoint_errors_;  // from the error callback
  absl::node_hash_map<Request, Op> ops_;  // nodes: stable addresses for the callbacks
  Request next_request_ = 1;
  absl::Status broken_;
  bool shut_down_ = false;
  bool departures_ = false;  // some peer failed or vanished
  bool watching_ = false;    // some peer has no error handling: watched through /proc and store
  std::shared_ptr<Store> store_;  // this communicator's namespace
  absl::Time next_watch_ = absl::InfinitePast();

  std::atomic<bool> cancelled_{false};
  absl::Mutex cancel_mu_;
  absl::Status cancel_reason_ ABSL_GUARDED_BY(cancel_mu_);
};

// TransportFactory for CreateTransportCommunicator (see transport_communicator.h).
absl::StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(std::shared_ptr<Store> store,
                                                              int rank, int size,
                                                              const CommConfig& config);

}  // namespace fairscale::comm
