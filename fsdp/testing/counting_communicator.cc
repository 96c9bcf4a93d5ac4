#include "fsdp/testing/counting_communicator.h"

#include <utility>

namespace fairscale::fsdp::testing {

CountingCommunicator::CountingCommunicator(std::shared_ptr<comm::Communicator> inner)
    : comm::Communicator(inner->rank(), inner->size(), "counting", inner->default_timeout()),
      inner_(std::move(inner)) {}

CountingCommunicator::Count CountingCommunicator::count(comm::OpType type) const {
  absl::MutexLock lock(&mu_);
  auto it = counts_.find(type);
  return it == counts_.end() ? Count{} : it->second;
}

void CountingCommunicator::Reset() {
  absl::MutexLock lock(&mu_);
  counts_.clear();
}

void CountingCommunicator::Add(comm::OpType type, size_t bytes) {
  absl::MutexLock lock(&mu_);
  Count& c = counts_[type];
  ++c.ops;
  c.bytes += static_cast<int64_t>(bytes);
}

comm::Work CountingCommunicator::DoAllReduce(const comm::OpContext& ctx, comm::ConstBuffer send,
                                             comm::Buffer recv, comm::ReduceOp op) {
  Add(ctx.type, send.bytes());
  return inner_->AllReduce(send, recv, op, Options(ctx));
}

comm::Work CountingCommunicator::DoReduceScatter(const comm::OpContext& ctx, comm::ConstBuffer send,
                                                 comm::Buffer recv, comm::ReduceOp op) {
  Add(ctx.type, send.bytes());
  return inner_->ReduceScatter(send, recv, op, Options(ctx));
}

comm::Work CountingCommunicator::DoAllGather(const comm::OpContext& ctx, comm::ConstBuffer send,
                                             comm::Buffer recv) {
  Add(ctx.type, recv.bytes());
  return inner_->AllGather(send, recv, Options(ctx));
}

comm::Work CountingCommunicator::DoBroadcast(const comm::OpContext& ctx, comm::Buffer buffer,
                                             int root) {
  Add(ctx.type, buffer.bytes());
  return inner_->Broadcast(buffer, root, Options(ctx));
}

comm::Work CountingCommunicator::DoReduce(const comm::OpContext& ctx, comm::ConstBuffer send,
                                          comm::Buffer recv, comm::ReduceOp op, int root) {
  Add(ctx.type, send.bytes());
  return inner_->Reduce(send, recv, op, root, Options(ctx));
}

comm::Work CountingCommunicator::DoAllToAll(const comm::OpContext& ctx, comm::ConstBuffer send,
                                            comm::Buffer recv) {
  Add(ctx.type, recv.bytes());
  return inner_->AllToAll(send, recv, Options(ctx));
}

comm::Work CountingCommunicator::DoSend(const comm::OpContext& ctx, comm::ConstBuffer buffer,
                                        int peer) {
  Add(ctx.type, buffer.bytes());
  return inner_->Send(buffer, peer, Options(ctx));
}

comm::Work CountingCommunicator::DoRecv(const comm::OpContext& ctx, comm::Buffer buffer, int peer) {
  Add(ctx.type, buffer.bytes());
  return inner_->Recv(buffer, peer, Options(ctx));
}

comm::Work CountingCommunicator::DoBarrier(const comm::OpContext& ctx) {
  Add(ctx.type, 0);
  return inner_->Barrier(Options(ctx));
}

comm::Work CountingCommunicator::DoBatchP2P(const comm::OpContext& ctx,
                                            std::vector<comm::P2PItem> items) {
  std::vector<comm::P2POp> ops;
  size_t bytes = 0;
  for (const comm::P2PItem& item : items) {
    ops.push_back(item.op);
    bytes += item.op.buffer.bytes();
  }
  Add(ctx.type, bytes);
  return inner_->BatchP2P(ops, Options(ctx));
}

absl::StatusOr<std::shared_ptr<comm::Communicator>> CountingCommunicator::DoSplit(
    const comm::OpContext& ctx, int color, int key) {
  Add(ctx.type, 0);
  return inner_->Split(color, key, Options(ctx));
}

}  // namespace fairscale::fsdp::testing
