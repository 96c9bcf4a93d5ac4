// ForwardingCommunicator: a Communicator that forwards every operation to an inner one (same
// rank, size and default timeout; Abort, status and SupportsDevice are the inner one's) and lets
// a subclass act around each operation's issue. The span tracer (//trace) and the byte counter of
// the fsdp tests are such wrappers; each overrides Forward (and WrapChild for Split) only.
//
// The wrapper's own argument checks run first (the Communicator base class), then Forward with
// the operation's summary; `issue()` issues it on the inner communicator with the caller's
// timeout and returns the inner Work (for Split: a completed Work with Split's status; the child
// is then passed through WrapChild).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/communicator.h"

namespace fairscale::comm {

class ForwardingCommunicator : public Communicator {
 public:
  // What an operation moves, for observers. bytes / count / dtype describe one buffer:
  // all_gather and all_to_all their receive buffer (the full result); all_reduce,
  // reduce_scatter and reduce their send buffer; broadcast, send and recv their buffer;
  // batch_p2p the sum over its items (count 0); barrier and split nothing.
  struct OpInfo {
    size_t bytes = 0;
    size_t count = 0;
    DataType dtype = DataType::kU8;
    std::optional<ReduceOp> reduce_op;  // all_reduce, reduce_scatter, reduce
    int root = -1;                      // broadcast, reduce
    int peer = -1;                      // send, recv
    size_t sends = 0, recvs = 0;        // batch_p2p
    int color = 0, key = 0;             // split
  };

  // `backend` is the name this communicator reports (the inner one's, or the wrapper's own).
  ForwardingCommunicator(std::shared_ptr<Communicator> inner, std::string backend);

  void Abort(absl::Status reason) override { inner_->Abort(std::move(reason)); }
  absl::Status status() const override { return inner_->status(); }
  bool SupportsDevice(Device device) const override { return inner_->SupportsDevice(device); }

  const std::shared_ptr<Communicator>& inner() const { return inner_; }

 protected:
  // Called for every operation; must call `issue` exactly once and return its Work (or one
  // derived from it, e.g. with OnDone callbacks). The default returns issue().
  virtual Work Forward(const OpContext& ctx, const OpInfo& info,
                       const std::function<Work()>& issue);
  // The communicator Split returns for the inner one's child (not null). The default: the child.
  virtual std::shared_ptr<Communicator> WrapChild(std::shared_ptr<Communicator> child);

  Work DoAllReduce(const OpContext& ctx, ConstBuffer send, Buffer recv, ReduceOp op) final;
  Work DoReduceScatter(const OpContext& ctx, ConstBuffer send, Buffer recv, ReduceOp op) final;
  Work DoAllGather(const OpContext& ctx, ConstBuffer send, Buffer recv) final;
  Work DoBroadcast(const OpContext& ctx, Buffer buffer, int root) final;
  Work DoReduce(const OpContext& ctx, ConstBuffer send, Buffer recv, ReduceOp op,
                int root) final;
  Work DoAllToAll(const OpContext& ctx, ConstBuffer send, Buffer recv) final;
  Work DoSend(const OpContext& ctx, ConstBuffer buffer, int peer) final;
  Work DoRecv(const OpContext& ctx, Buffer buffer, int peer) final;
  Work DoBarrier(const OpContext& ctx) final;
  Work DoBatchP2P(const OpContext& ctx, std::vector<P2PItem> items) final;
  absl::StatusOr<std::shared_ptr<Communicator>> DoSplit(const OpContext& ctx, int color,
                                                        int key) final;

 private:
  const std::shared_ptr<Communicator> inner_;
};

}  // namespace fairscale::comm
