// CountingCommunicator (testonly): a Communicator that forwards every operation to another one and
// counts operations and bytes per op type. The fsdp tests wrap the inproc communicator in it to
// check that a training step moves exactly the bytes the theory says (FULL_SHARD 3x the parameter
// bytes, SHARD_GRAD_OP 2x, NO_SHARD one all-reduce of the gradients).
//
// Bytes counted per operation: all_gather and all_to_all the receive buffer (the full tensor);
// reduce_scatter, all_reduce, reduce and broadcast the send buffer; send/recv their buffer.
#pragma once

#include <cstdint>
#include <map>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "comm/communicator.h"

namespace fairscale::fsdp::testing {

class CountingCommunicator : public comm::Communicator {
 public:
  struct Count {
    int64_t ops = 0;
    int64_t bytes = 0;
  };

  explicit CountingCommunicator(std::shared_ptr<comm::Communicator> inner);

  Count count(comm::OpType type) const;
  void Reset();

  void Abort(absl::Status reason) override { inner_->Abort(std::move(reason)); }
  absl::Status status() const override { return inner_->status(); }
  bool SupportsDevice(comm::Device device) const override { return inner_->SupportsDevice(device); }

 protected:
  comm::Work DoAllReduce(const comm::OpContext& ctx, comm::ConstBuffer send, comm::Buffer recv,
                         comm::ReduceOp op) override;
  comm::Work DoReduceScatter(const comm::OpContext& ctx, comm::ConstBuffer send, comm::Buffer recv,
                             comm::ReduceOp op) override;
  comm::Work DoAllGather(const comm::OpContext& ctx, comm::ConstBuffer send,
                         comm::Buffer recv) override;
  comm::Work DoBroadcast(const comm::OpContext& ctx, comm::Buffer buffer, int root) override;
  comm::Work DoReduce(const comm::OpContext& ctx, comm::ConstBuffer send, comm::Buffer recv,
                      comm::ReduceOp op, int root) override;
  comm::Work DoAllToAll(const comm::OpContext& ctx, comm::ConstBuffer send,
                        comm::Buffer recv) override;
  comm::Work DoSend(const comm::OpContext& ctx, comm::ConstBuffer buffer, int peer) override;
  comm::Work DoRecv(const comm::OpContext& ctx, comm::Buffer buffer, int peer) override;
  comm::Work DoBarrier(const comm::OpContext& ctx) override;
  comm::Work DoBatchP2P(const comm::OpContext& ctx, std::vector<comm::P2PItem> items) override;
  absl::StatusOr<std::shared_ptr<comm::Communicator>> DoSplit(const comm::OpContext& ctx, int color,
                                                              int key) override;

 private:
  void Add(comm::OpType type, size_t bytes);
  static comm::OpOptions Options(const comm::OpContext& ctx) { return {ctx.timeout}; }

  const std::shared_ptr<comm::Communicator> inner_;
  mutable absl::Mutex mu_;
  std::map<comm::OpType, Count> counts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fairscale::fsdp::testing
