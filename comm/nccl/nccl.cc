// The "nccl" backend (//comm/nccl, built under --config=cuda): NCCL's own collectives over CUDA
// device buffers. Our ring/tree code (//comm/algorithms) is not used here; NCCL owns the
// algorithms, the transports and the kernels.
//
// One ncclComm_t and one CUDA stream per communicator. Creation: rank 0 makes the ncclUniqueId and
// publishes it in the store under "nccl/<name>/unique_id"; every rank then calls
// ncclCommInitRankConfig in non-blocking mode (blocking = 0), so that init, collectives and Split
// can be bounded by the timeout and aborted. Every operation joins a queue in issue order; its
// NCCL call is made in that order (at once, or by the completion thread when NCCL was still
// enqueuing an earlier call: ncclInProgress) and a CUDA event recorded after it; the completion
// thread polls the oldest event (the stream completes in order) and ncclCommGetAsyncError:
//   * the event fires                    -> the Work completes OK;
//   * ncclRemoteError / ncclSystemError  -> kUnavailable naming the op and rank (a peer died or
//                                           its connection broke), ncclCommAbort;
//   * the op runs past its timeout       -> kDeadlineExceeded, ncclCommAbort.
// Either error breaks the communicator (every pending and later op fails with it), as the
// interface demands. Abort() calls ncclCommAbort. Split is ncclCommSplit.
//
// Stream order: an op's NCCL call waits (cudaStreamWaitEvent) for everything the caller issued
// before it on the legacy default stream (cudaMemcpy, kernels launched without a stream), as
// PyTorch's ProcessGroupNCCL waits for the current stream: a buffer filled by cudaMemcpy just
// before the op is read complete (a pageable cudaMemcpy may return before its DMA finishes).
// Work issued on other streams must be synchronized by the caller first.
//
// Buffers must be on this communicator's CUDA device (CommConfig::options["nccl.device"], else
// rank % cudaGetDeviceCount()); host buffers are kInvalidArgument naming the op (the base class
// asks SupportsDevice()). The library needs only cuda_runtime_api.h and nccl.h: gcc builds it,
// no nvcc.
//
// Network interface: FS_SOCKET_IFNAME (CommConfig::network_interface) becomes
// NCCL_SOCKET_IFNAME, unless that is set, before the first NCCL call (ncclGetUniqueId / init),
// so NCCL's bootstrap and socket transport use the interface the job's ranks reach each other on,
// as the tcp and ucx backends do. NCCL reads it once per process, so the first communicator's
// interface holds for the process.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/const_init.h"
#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/config.h"
#include "comm/registry.h"
#include "comm/store/store.h"

namespace fairscale::comm {
namespace {

constexpr char kBackend[] = "nccl";
constexpr char kDeviceOption[] = "nccl.device";

std::string CudaError(cudaError_t e) {
  return absl::StrCat(cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

// What an NCCL failure means in the interface's codes.
absl::StatusCode CodeOf(ncclResult_t r) {
  switch (r) {
    case ncclRemoteError:
    case ncclSystemError:
      return absl::StatusCode::kUnavailable;  // a peer died or a connection broke
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::StatusCode::kInvalidArgument;
    default:
      return absl::StatusCode::kInternal;
  }
}

std::string NcclError(ncclResult_t r, ncclComm_t comm) {
  std::string out = absl::StrCat("NCCL error ", static_cast<int>(r), " (", ncclGetErrorString(r),
                                 ")");
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') absl::StrAppend(&out, ": ", last);
  if (r == ncclRemoteError || r == ncclSystemError) {
    absl::StrAppend(&out, "; a peer failed or its connection broke");
  }
  return out;
}

ncclDataType_t ToNccl(DataType t) {
  switch (t) {
    case DataType::kF32: return ncclFloat32;
    case DataType::kF64: return ncclFloat64;
    case DataType::kF16: return ncclFloat16;
    case DataType::kBF16: return ncclBfloat16;
    case DataType::kI8: return ncclInt8;
    case DataType::kU8: return ncclUint8;
    case DataType::kI32: return ncclInt32;
    case DataType::kI64: return ncclInt64;
  }
  return ncclFloat32;  // unreachable: the base class validated the dtype
}

ncclRedOp_t ToNccl(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kProduct: return ncclProd;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kAvg: return ncclAvg;  // floating point only (the base class checks)
  }
  return ncclSum;
}

// Makes `device` current on this thread for the guard's lifetime (NCCL and the CUDA runtime
// act on the current device; the calling thread may be any user thread).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// Polls a non-blocking communicator until its pending NCCL call finishes or `deadline` passes.
// Returns the final state; ncclInProgress means the deadline passed.
ncclResult_t PollUntilDone(ncclComm_t comm, absl::Time deadline) {
  absl::Duration nap = absl::Microseconds(20);
  while (true) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclInProgress) return state;
    if (absl::Now() >= deadline) return ncclInProgress;
    absl::SleepFor(nap);
    nap = std::min(nap * 2, absl::Milliseconds(1));
  }
}

// NCCL_SOCKET_IFNAME := `interface` when that is non-empty and NCCL_SOCKET_IFNAME is unset
// (the user's own NCCL setting wins). Serialized: ranks may be threads of one process.
void SetNcclSocketIfname(const std::string& interface) {
  if (interface.empty()) return;
  static absl::Mutex mu(absl::kConstInit);
  absl::MutexLock lock(&mu);
  if (std::getenv("NCCL_SOCKET_IFNAME") == nullptr) {
    setenv("NCCL_SOCKET_IFNAME", interface.c_str(), /*overwrite=*/0);
  }
}

ncclConfig_t NonBlockingConfig() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(int rank, int size, absl::Duration timeout, int device, ncclComm_t comm,
                   cudaStream_t stream, void* scratch)
      : Communicator(rank, size, kBackend, timeout),
        device_(device),
        stream_(stream),
        scratch_(scratch),
        comm_(comm) {
    poller_ = std::thread([this] { PollLoop(); });
  }

  ~NcclCommunicator() override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    // Returns once every pending op completed (each has a timeout). As with every backend, a
    // Work callback must not drop the last reference to its communicator.
    poller_.join();
    absl::MutexLock lock(&mu_);
    DeviceGuard guard(device_);
    if (comm_ != nullptr) {
      // Healthy and idle: finalize (flushes NCCL's own work), bounded; else abort.
      bool finalized = false;
      ncclResult_t r = ncclCommFinalize(comm_);
      if (r == ncclSuccess || r == ncclInProgress) {
        finalized = PollUntilDone(comm_, absl::Now() + absl::Seconds(30)) == ncclSuccess;
      }
      if (finalized) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
      comm_ = nullptr;
    }
    cudaFree(scratch_);
    cudaStreamDestroy(stream_);
  }

  void Abort(absl::Status reason) override {
    if (reason.ok()) {
      reason = absl::AbortedError(
          absl::StrCat("rank ", rank(), "/", size(), " [", kBackend, "]: aborted"));
    }
    std::vector<std::pair<WorkCompleter, absl::Status>> done;
    {
      absl::MutexLock lock(&mu_);
      BreakLocked(reason, &done);
    }
    for (auto& [completer, status] : done) completer.Complete(status);
  }

  absl::Status status() const override {
    absl::MutexLock lock(&mu_);
    return broken_;
  }

  bool SupportsDevice(Device device) const override {
    return device.type == DeviceType::kCuda && device.index == device_;
  }

 protected:
  // Each op becomes a launch closure (captures by value: it may run later, on the completion
  // thread, if NCCL is still busy enqueuing an earlier op).
  Work DoAllReduce(const OpContext& ctx, ConstBuffer send, Buffer recv, ReduceOp op) override {
    return Enqueue(ctx, send.count, [=](ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(send.data, recv.data, send.count, ToNccl(send.dtype), ToNccl(op), c, s);
    });
  }

  Work DoReduceScatter(const OpContext& ctx, ConstBuffer send, Buffer recv,
                       ReduceOp op) override {
    return Enqueue(ctx, recv.count, [=](ncclComm_t c, cudaStream_t s) {
      return ncclReduceScatter(send.data, recv.data, recv.count, ToNccl(recv.dtype), ToNccl(op), c,
                               s);
    });
  }

  Work DoAllGather(const OpContext& ctx, ConstBuffer send, Buffer recv) override {
    return Enqueue(ctx, send.count, [=](ncclComm_t c, cudaStream_t s) {
      return ncclAllGather(send.data, recv.data, send.count, ToNccl(send.dtype), c, s);
    });
  }

  Work DoBroadcast(const OpContext& ctx, Buffer buffer, int root) override {
    return Enqueue(ctx, buffer.count, [=](ncclComm_t c, cudaStream_t s) {
      return ncclBroadcast(buffer.data, buffer.data, buffer.count, ToNccl(buffer.dtype), root, c,
                           s);
    });
  }

  Work DoReduce(const OpContext& ctx, ConstBuffer send, Buffer recv, ReduceOp op,
                int root) override {
    // recvbuff is only read on the root (NCCL does not check it elsewhere), as our contract says.
    void* out = rank() == root ? recv.data : nullptr;
    return Enqueue(ctx, send.count, [=](ncclComm_t c, cudaStream_t s) {
      return ncclReduce(send.data, out, send.count, ToNccl(send.dtype), ToNccl(op), root, c, s);
    });
  }

  Work DoAllToAll(const OpContext& ctx, ConstBuffer send, Buffer recv) override {
    // Grouped send/recv of block j to/from rank j (a self send/recv within a group is allowed).
    const int n = size();
    const size_t block = send.count / n;
    return Enqueue(ctx, block, [=](ncclComm_t c, cudaStream_t s) {
      ncclResult_t first = ncclGroupStart();
      for (int j = 0; j < n && first == ncclSuccess; ++j) {
        first = ncclSend(send.Slice(j * block, block).data, block, ToNccl(send.dtype), j, c, s);
        if (first == ncclSuccess) {
          first = ncclRecv(recv.Slice(j * block, block).data, block, ToNccl(recv.dtype), j, c, s);
        }
      }
      ncclResult_t end = ncclGroupEnd();
      return first != ncclSuccess ? first : end;
    });
  }

  Work DoSend(const OpContext& ctx, ConstBuffer buffer, int peer) override {
    return Enqueue(ctx, buffer.count, [=](ncclComm_t c, cudaStream_t s) {
      return ncclSend(buffer.data, buffer.count, ToNccl(buffer.dtype), peer, c, s);
    });
  }

  Work DoRecv(const OpContext& ctx, Buffer buffer, int peer) override {
    return Enqueue(ctx, buffer.count, [=](ncclComm_t c, cudaStream_t s) {
      return ncclRecv(buffer.data, buffer.count, ToNccl(buffer.dtype), peer, c, s);
    });
  }

  Work DoBarrier(const OpContext& ctx) override {
    // A one-element all-reduce: its event fires only after every rank contributed.
    void* scratch = scratch_;
    return Enqueue(ctx, 1, [=](ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(scratch, scratch, 1, ncclFloat32, ncclSum, c, s);
    });
  }

  Work DoBatchP2P(const OpContext& ctx, std::vector<P2PItem> items) override {
    size_t total = 0;
    for (const P2PItem& item : items) total += item.op.buffer.count;
    return Enqueue(ctx, total, [items = std::move(items)](ncclComm_t c, cudaStream_t s) {
      ncclResult_t first = ncclGroupStart();
      for (size_t i = 0; i < items.size() && first == ncclSuccess; ++i) {
        const P2POp& op = items[i].op;
        if (op.buffer.count == 0) continue;  // the peer's matching item is empty too
        first = op.is_send ? ncclSend(op.buffer.data, op.buffer.count, ToNccl(op.buffer.dtype),
                                      op.peer, c, s)
                           : ncclRecv(op.buffer.data, op.buffer.count, ToNccl(op.buffer.dtype),
                                      op.peer, c, s);
      }
      ncclResult_t end = ncclGroupEnd();
      return first != ncclSuccess ? first : end;
    });
  }

  absl::StatusOr<std::shared_ptr<Communicator>> DoSplit(const OpContext& ctx, int color,
                                                        int key) override {
    Completions done;
    absl::StatusOr<std::shared_ptr<Communicator>> result;
    {
      absl::MutexLock lock(&mu_);
      result = SplitLocked(ctx, color, key, &done);
    }
    for (auto& [completer, status] : done) completer.Complete(status);
    return result;
  }

 private:
  using Launch = std::function<ncclResult_t(ncclComm_t, cudaStream_t)>;
  using Completions = std::vector<std::pair<WorkCompleter, absl::Status>>;

  // An issued op, in issue order. Its NCCL call is made in that order: at once when NCCL is idle,
  // else by whoever advances the queue once the previous call has been enqueued (in non-blocking
  // mode a call may return ncclInProgress, e.g. while connecting to a peer, and nothing else may
  // be called on the communicator until it is enqueued).
  struct Pending {
    enum class State { kWaiting, kEnqueuing, kRecorded };
    State state = State::kWaiting;
    Launch launch;  // empty for a count-0 op: only its event is recorded
    cudaEvent_t ready = nullptr;  // recorded on the legacy default stream at issue; waited for
    cudaEvent_t event = nullptr;
    WorkCompleter completer;
    std::string label;
    absl::Duration timeout;
    absl::Time started;  // when it became the oldest pending op (the stream runs in order)
  };

  Work Enqueue(const OpContext& ctx, size_t count, Launch launch) {
    Completions done;
    Work work;
    {
      absl::MutexLock lock(&mu_);
      if (!broken_.ok()) return Work::Done(NotRun(ctx.Label()));
      Pending p;
      if (count > 0) {
        // The inputs are ready once the caller's earlier default-stream work is done.
        DeviceGuard guard(device_);
        cudaError_t e = cudaEventCreateWithFlags(&p.ready, cudaEventDisableTiming);
        if (e == cudaSuccess) e = cudaEventRecord(p.ready, cudaStreamLegacy);
        if (e != cudaSuccess) {
          if (p.ready != nullptr) cudaEventDestroy(p.ready);
          return Work::Done(absl::InternalError(absl::StrCat(
              ctx.Label(), ": cannot record a CUDA event on the default stream: ", CudaError(e))));
        }
        p.launch = std::move(launch);
      }
      auto [pending_work, completer] = Work::Pending(ctx.Label());
      work = std::move(pending_work);
      p.completer = std::move(completer);
      p.label = ctx.Label();
      p.timeout = ctx.timeout;
      p.started = absl::Now();
      pending_.push_back(std::move(p));
      AdvanceLocked(&done);  // usually enqueues it right here, on the issuing thread
    }
    for (auto& [completer, status] : done) completer.Complete(status);
    return work;
  }

  // Moves the first ops that are not yet on the stream forward: finishes an in-progress NCCL
  // call, makes the next ones, records their events. Stops at a call still in progress.
  void AdvanceLocked(Completions* done) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    DeviceGuard guard(device_);
    for (size_t i = 0; i < pending_.size() && broken_.ok(); ++i) {
      Pending& p = pending_[i];
      if (p.state == Pending::State::kRecorded) continue;
      ncclResult_t r = ncclSuccess;
      if (p.state == Pending::State::kEnqueuing) {
        ncclCommGetAsyncError(comm_, &r);
      } else if (p.launch) {
        cudaError_t e = cudaStreamWaitEvent(stream_, p.ready, 0);
        cudaEventDestroy(p.ready);  // released once the device is past it
        p.ready = nullptr;
        if (e != cudaSuccess) {
          BreakLocked(absl::InternalError(absl::StrCat(
                          p.label, ": cannot order the op after the default stream: ",
                          CudaError(e))),
                      done);
          return;
        }
        r = p.launch(comm_, stream_);
        p.launch = nullptr;
      }
      if (r == ncclInProgress) {
        p.state = Pending::State::kEnqueuing;
        return;
      }
      if (r != ncclSuccess) {
        BreakLocked(absl::Status(CodeOf(r), absl::StrCat(p.label, ": ", NcclError(r, comm_))),
                    done);
        return;
      }
      cudaError_t e = cudaEventCreateWithFlags(&p.event, cudaEventDisableTiming);
      if (e == cudaSuccess) e = cudaEventRecord(p.event, stream_);
      if (e != cudaSuccess) {
        BreakLocked(absl::InternalError(absl::StrCat(p.label, ": cannot record a CUDA event: ",
                                                     CudaError(e))),
                    done);
        return;
      }
      p.state = Pending::State::kRecorded;
    }
  }

  bool AllOnStreamLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return pending_.empty() || pending_.back().state == Pending::State::kRecorded;
  }

  absl::StatusOr<std::shared_ptr<Communicator>> SplitLocked(const OpContext& ctx, int color,
                                                            int key, Completions* done)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!broken_.ok()) return NotRun(ctx.Label());
    const absl::Time deadline = absl::Now() + ctx.timeout;
    // NCCL takes no new call while an earlier one is still being enqueued: get every issued op
    // onto the stream first (bounded by this op's timeout).
    for (AdvanceLocked(done); broken_.ok() && !AllOnStreamLocked(); AdvanceLocked(done)) {
      if (absl::Now() >= deadline) {
        absl::Status s = ctx.Error(absl::StatusCode::kDeadlineExceeded,
                                   absl::StrCat("timed out after ", absl::FormatDuration(ctx.timeout),
                                                " waiting for earlier ops to be enqueued; "
                                                "ncclCommAbort called"));
        BreakLocked(s, done);
        return s;
      }
      absl::SleepFor(absl::Microseconds(200));
    }
    if (!broken_.ok()) return NotRun(ctx.Label());
    DeviceGuard guard(device_);
    ncclConfig_t config = NonBlockingConfig();
    ncclComm_t child = nullptr;
    ncclResult_t r = ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child,
                                   &config);
    if (r == ncclInProgress || r == ncclSuccess) {
      // The parent takes part in the split; a rank with no color gets no child to poll.
      r = PollUntilDone(comm_, deadline);
      if (r == ncclSuccess && child != nullptr) r = PollUntilDone(child, deadline);
    }
    if (r != ncclSuccess) {
      absl::Status s =
          r == ncclInProgress
              ? ctx.Error(absl::StatusCode::kDeadlineExceeded,
                          absl::StrCat("ncclCommSplit did not finish within ",
                                       absl::FormatDuration(ctx.timeout),
                                       "; ncclCommAbort called"))
              : ctx.Error(CodeOf(r), NcclError(r, child != nullptr ? child : comm_));
      if (child != nullptr) ncclCommAbort(child);
      BreakLocked(s, done);
      return s;
    }
    if (child == nullptr) return std::shared_ptr<Communicator>();
    int child_rank = 0, child_size = 0;
    ncclCommUserRank(child, &child_rank);
    ncclCommCount(child, &child_size);
    absl::StatusOr<std::pair<cudaStream_t, void*>> resources = CreateResources();
    if (!resources.ok()) {
      ncclCommAbort(child);
      return ctx.Error(resources.status().code(), resources.status().message());
    }
    return std::shared_ptr<Communicator>(std::make_shared<NcclCommunicator>(
        child_rank, child_size, default_timeout(), device_, child, resources->first,
        resources->second));
  }

 public:
  // The stream and the 4-byte barrier scratch of one communicator, on the current device.
  static absl::StatusOr<std::pair<cudaStream_t, void*>> CreateResources() {
    cudaStream_t stream = nullptr;
    cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
      return absl::InternalError(absl::StrCat("cudaStreamCreate failed: ", CudaError(e)));
    }
    void* scratch = nullptr;
    e = cudaMalloc(&scratch, sizeof(float));
    if (e != cudaSuccess) {
      cudaStreamDestroy(stream);
      return absl::ResourceExhaustedError(absl::StrCat("cudaMalloc(4) failed: ", CudaError(e)));
    }
    return std::make_pair(stream, scratch);
  }

 private:
  absl::Status NotRun(absl::string_view label) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return absl::Status(broken_.code(), absl::StrCat(label, ": not run, the communicator is broken: ",
                                                     broken_.message()));
  }

  // Records the first error, aborts the NCCL communicator (its kernels stop) and fails every
  // pending op: the one `status` names with it, the others as interrupted. The completions run after the
  // caller drops mu_ (callbacks may issue ops).
  void BreakLocked(const absl::Status& status, Completions* done)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (broken_.ok()) {
      broken_ = status;
      if (comm_ != nullptr) {
        DeviceGuard guard(device_);
        ncclCommAbort(comm_);
        comm_ = nullptr;
      }
    }
    for (Pending& p : pending_) {
      if (p.ready != nullptr) cudaEventDestroy(p.ready);
      if (p.event != nullptr) cudaEventDestroy(p.event);
      // The op that failed carries the error as is; the others name themselves.
      absl::Status s =
          absl::StartsWith(status.message(), p.label)
              ? status
              : absl::Status(status.code(),
                             absl::StrCat(p.label, ": interrupted, the communicator broke: ",
                                          status.message()));
      done->emplace_back(std::move(p.completer), std::move(s));
    }
    pending_.clear();
  }


  // The completion thread: moves ops onto the stream when NCCL was busy, completes the oldest op
  // when its event fires, and watches NCCL's async error and the oldest op's deadline. Exits
  // when stopping and nothing is pending.
  void PollLoop() {
    DeviceGuard guard(device_);
    absl::Duration nap = absl::Microseconds(20);
    absl::Time next_idle_check = absl::Now();
    while (true) {
      Completions done;
      bool progressed = false;
      {
        absl::MutexLock lock(&mu_);
        if (pending_.empty()) {
          if (stopping_) return;
          // Idle: check NCCL's async error now and then, so status() shows a failed peer.
          if (comm_ != nullptr && absl::Now() >= next_idle_check) {
            next_idle_check = absl::Now() + absl::Milliseconds(100);
            ncclResult_t state = ncclSuccess;
            ncclCommGetAsyncError(comm_, &state);
            if (state != ncclSuccess && state != ncclInProgress) {
              BreakLocked(absl::Status(CodeOf(state),
                                       absl::StrCat("rank ", rank(), "/", size(), " [", kBackend,
                                                    "]: ", NcclError(state, comm_))),
                          &done);
            }
          }
        } else {
          if (!AllOnStreamLocked()) AdvanceLocked(&done);
          Pending* head = pending_.empty() ? nullptr : &pending_.front();
          cudaError_t e = head != nullptr && head->state == Pending::State::kRecorded
                              ? cudaEventQuery(head->event)
                              : cudaErrorNotReady;
          if (head == nullptr) {
            // broken by AdvanceLocked: `done` holds the failures
          } else if (e == cudaSuccess) {
            cudaEventDestroy(head->event);
            done.emplace_back(std::move(head->completer), absl::OkStatus());
            pending_.pop_front();
            if (!pending_.empty()) pending_.front().started = absl::Now();
            progressed = true;
          } else if (e != cudaErrorNotReady) {
            BreakLocked(absl::InternalError(absl::StrCat(head->label,
                                                         ": CUDA error while waiting: ",
                                                         CudaError(e))),
                        &done);
          } else {
            ncclResult_t state = ncclSuccess;
            if (comm_ != nullptr) ncclCommGetAsyncError(comm_, &state);
            if (state != ncclSuccess && state != ncclInProgress) {
              BreakLocked(absl::Status(CodeOf(state),
                                       absl::StrCat(head->label, ": ", NcclError(state, comm_))),
                          &done);
            } else if (absl::Now() - head->started > head->timeout) {
              BreakLocked(absl::DeadlineExceededError(absl::StrCat(
                              head->label, ": timed out after ",
                              absl::FormatDuration(head->timeout), "; ncclCommAbort called")),
                          &done);
            }
          }
        }
      }
      for (auto& [completer, status] : done) completer.Complete(status);
      if (progressed) {
        nap = absl::Microseconds(20);
      } else {
        absl::SleepFor(nap);
        nap = std::min(nap * 2, absl::Milliseconds(1));
      }
    }
  }

  const int device_;
  cudaStream_t stream_;
  void* scratch_;
  std::thread poller_;

  mutable absl::Mutex mu_;
  ncclComm_t comm_ ABSL_GUARDED_BY(mu_);  // null once aborted
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  std::deque<Pending> pending_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

absl::StatusOr<std::shared_ptr<Communicator>> CreateNccl(const CommConfig& config) {
  const std::string where =
      absl::StrCat("[", kBackend, "] rank ", config.rank, "/", config.size);
  int device = -1;
  for (const auto& [key, value] : config.options) {
    if (key != kDeviceOption || !absl::SimpleAtoi(value, &device) || device < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": unknown or invalid option ", key, "=", value, " (known: ", kDeviceOption,
          "=<CUDA ordinal>)"));
    }
  }
  if (config.store == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": CommConfig::store is required"));
  }
  int devices = 0;
  cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, ": no CUDA device: cudaGetDeviceCount returned ",
        e == cudaSuccess ? "0 devices" : CudaError(e)));
  }
  if (device < 0) device = config.rank % devices;
  if (device >= devices) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", kDeviceOption, "=", device,
                                                   " but only ", devices, " CUDA device(s)"));
  }

  SetNcclSocketIfname(config.network_interface);
  // Rank 0 creates the unique id; the others read it from the store.
  const std::string key =
      absl::StrCat("nccl/", config.name.empty() ? "default" : config.name, "/unique_id");
  ncclUniqueId id;
  if (config.rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) {
      return absl::Status(CodeOf(r), absl::StrCat(where, ": ncclGetUniqueId: ",
                                                  NcclError(r, nullptr)));
    }
    absl::Status s = config.store->Set(key, absl::string_view(id.internal, sizeof(id.internal)));
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat(where, ": ", s.message()));
  } else {
    absl::StatusOr<std::string> v = config.store->Get(key, config.timeout);
    if (!v.ok()) {
      return absl::Status(v.status().code(),
                          absl::StrCat(where, ": waiting for rank 0's ncclUniqueId: ",
                                       v.status().message()));
    }
    if (v->size() != sizeof(id.internal)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": store key ", key, " holds ",
                                                     v->size(), " bytes, not an ncclUniqueId"));
    }
    std::memcpy(id.internal, v->data(), sizeof(id.internal));
  }

  DeviceGuard guard(device);
  absl::StatusOr<std::pair<cudaStream_t, void*>> resources = NcclCommunicator::CreateResources();
  if (!resources.ok()) {
    return absl::Status(resources.status().code(),
                        absl::StrCat(where, ": ", resources.status().message()));
  }
  ncclConfig_t nccl_config = NonBlockingConfig();
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, config.size, id, config.rank, &nccl_config);
  if (r == ncclInProgress || (r == ncclSuccess && comm != nullptr)) {
    r = PollUntilDone(comm, absl::Now() + config.timeout);
  }
  if (r != ncclSuccess) {
    absl::Status s =
        r == ncclInProgress
            ? absl::DeadlineExceededError(absl::StrCat(
                  where, ": ncclCommInitRankConfig did not finish within ",
                  absl::FormatDuration(config.timeout), "; ncclCommAbort called"))
            : absl::Status(CodeOf(r), absl::StrCat(where, ": ncclCommInitRankConfig: ",
                                                    NcclError(r, comm)));
    if (comm != nullptr) ncclCommAbort(comm);
    cudaFree(resources->second);
    cudaStreamDestroy(resources->first);
    return s;
  }
  return std::shared_ptr<Communicator>(std::make_shared<NcclCommunicator>(
      config.rank, config.size, config.timeout, device, comm, resources->first,
      resources->second));
}

}  // namespace

// Above tcp (10): a binary that links NCCL wants it for device buffers by default.
const BackendRegistration kRegistration(kBackend, /*priority=*/20, &CreateNccl);

}  // namespace fairscale::comm
