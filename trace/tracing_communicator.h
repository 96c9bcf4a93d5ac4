// TracingCommunicator: a Communicator that forwards every operation to another one and records
// each as a "comm" span in a Recorder (//trace). The training job wraps its communicator once,
// before handing it to FSDP / OSS / ...:
//
//   std::shared_ptr<comm::Communicator> comm = ...;               // tcp, inproc, ...
//   auto recorder = std::make_shared<trace::Recorder>(comm->rank());
//   comm = std::make_shared<trace::TracingCommunicator>(comm, recorder);
//
// Results, errors (same messages: the wrapper reports the inner backend's name) and ordering are
// the inner communicator's. Split() returns a TracingCommunicator around the child, recording into
// the same recorder.
//
// Each operation becomes one complete event, category "comm", named after the op ("all_reduce",
// "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all", "send", "recv",
// "barrier", "batch_p2p", "split"), spanning from the moment it was issued to the moment its Work
// completed (Work::OnDone; queueing behind earlier operations is included). It lies on a "comm"
// lane (Recorder::AcquireLane), so concurrent collectives appear on "comm", "comm 2", ... tracks
// and never overlap on one track. Args:
//   seq      the op's sequence number (collectives: the same on every rank; send/recv: per peer)
//   bytes    payload: all_gather / all_to_all the receive buffer (the full tensor); all_reduce,
//            reduce_scatter, reduce and broadcast the send buffer; send/recv their buffer;
//            batch_p2p the sum of its items; barrier/split 0 (the definition CountingCommunicator
//            in fsdp/testing uses)
//   count, dtype   of that buffer
//   op       reduce op ("sum", ...) where there is one;  root / peer where there is one
//   group    "<rank>/<size>" in this communicator;  backend  the inner backend's name
//   error    the status, only if the operation failed
// Every Wait() on the returned Work that blocks is recorded too (Work::OnWait): a span of
// category "wait" named "wait <op>" (args: seq, error) on the waiting thread, so the profile can
// tell time blocked on the network from compute even inside a compute Scope.
// Operations rejected by argument checks (already-failed Works) are not recorded.
// With the recorder disabled every operation costs one relaxed atomic load more than the inner
// one.
#pragma once

#include <functional>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/forwarding_communicator.h"
#include "trace/recorder.h"

namespace fairscale::trace {

class TracingCommunicator : public comm::ForwardingCommunicator {
 public:
  // `inner` and `recorder` must not be null.
  TracingCommunicator(std::shared_ptr<comm::Communicator> inner,
                      std::shared_ptr<Recorder> recorder);

  const std::shared_ptr<Recorder>& recorder() const { return recorder_; }

 protected:
  comm::Work Forward(const comm::OpContext& ctx, const OpInfo& info,
                     const std::function<comm::Work()>& issue) override;
  // Split's child is traced into the same recorder.
  std::shared_ptr<comm::Communicator> WrapChild(std::shared_ptr<comm::Communicator> child) override;

 private:
  const std::shared_ptr<Recorder> recorder_;
};

// Aligns `recorder`'s clock with rank 0's: a barrier on `comm`, then every rank reads
// CLOCK_MONOTONIC and the readings are all-gathered; the offset rank0 - mine is set on the
// recorder and returned. Collective: every rank of `comm` must call it. Only needed when the
// ranks run on several hosts (processes on one host already share CLOCK_MONOTONIC); accuracy is
// the spread of the ranks' barrier exit times (about one network latency). Call it before
// recording (events recorded earlier keep their old timestamps). Pass the untraced communicator
// to keep these two operations out of the trace.
absl::StatusOr<int64_t> AlignClocks(comm::Communicator& comm, Recorder& recorder,
                                    absl::Duration timeout = absl::Seconds(60));

}  // namespace fairscale::trace
