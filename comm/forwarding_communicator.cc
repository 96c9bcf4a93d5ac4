#include "comm/forwarding_communicator.h"

#include <utility>

namespace fairscale::comm {
namespace {

OpOptions Options(const OpContext& ctx) { return {ctx.timeout}; }

ForwardingCommunicator::OpInfo Of(size_t bytes, size_t count, DataType dtype) {
  ForwardingCommunicator::OpInfo info;
  info.bytes = bytes;
  info.count = count;
  info.dtype = dtype;
  return info;
}

}  // namespace

ForwardingCommunicator::ForwardingCommunicator(std::shared_ptr<Communicator> inner,
                                               std::string backend)
    : Communicator(inner->rank(), inner->size(), std::move(backend), inner->default_timeout()),
      inner_(std::move(inner)) {}

Work ForwardingCommunicator::Forward(const OpContext&, const OpInfo&,
                                     const std::function<Work()>& issue) {
  return issue();
}

std::shared_ptr<Communicator> ForwardingCommunicator::WrapChild(
    std::shared_ptr<Communicator> child) {
  return child;
}

Work ForwardingCommunicator::DoAllReduce(const OpContext& ctx, ConstBuffer send, Buffer recv,
                                         ReduceOp op) {
  OpInfo info = Of(send.bytes(), send.count, send.dtype);
  info.reduce_op = op;
  return Forward(ctx, info, [&] { return inner_->AllReduce(send, recv, op, Options(ctx)); });
}

Work ForwardingCommunicator::DoReduceScatter(const OpContext& ctx, ConstBuffer send, Buffer recv,
                                             ReduceOp op) {
  OpInfo info = Of(send.bytes(), send.count, send.dtype);
  info.reduce_op = op;
  return Forward(ctx, info, [&] { return inner_->ReduceScatter(send, recv, op, Options(ctx)); });
}

Work ForwardingCommunicator::DoAllGather(const OpContext& ctx, ConstBuffer send, Buffer recv) {
  return Forward(ctx, Of(recv.bytes(), recv.count, recv.dtype),
                 [&] { return inner_->AllGather(send, recv, Options(ctx)); });
}

Work ForwardingCommunicator::DoBroadcast(const OpContext& ctx, Buffer buffer, int root) {
  OpInfo info = Of(buffer.bytes(), buffer.count, buffer.dtype);
  info.root = root;
  return Forward(ctx, info, [&] { return inner_->Broadcast(buffer, root, Options(ctx)); });
}

Work ForwardingCommunicator::DoReduce(const OpContext& ctx, ConstBuffer send, Buffer recv,
                                      ReduceOp op, int root) {
  OpInfo info = Of(send.bytes(), send.count, send.dtype);
  info.reduce_op = op;
  info.root = root;
  return Forward(ctx, info, [&] { return inner_->Reduce(send, recv, op, root, Options(ctx)); });
}

Work ForwardingCommunicator::DoAllToAll(const OpContext& ctx, ConstBuffer send, Buffer recv) {
  return Forward(ctx, Of(recv.bytes(), recv.count, recv.dtype),
                 [&] { return inner_->AllToAll(send, recv, Options(ctx)); });
}

Work ForwardingCommunicator::DoSend(const OpContext& ctx, ConstBuffer buffer, int peer) {
  OpInfo info = Of(buffer.bytes(), buffer.count, buffer.dtype);
  info.peer = peer;
  return Forward(ctx, info, [&] { return inner_->Send(buffer, peer, Options(ctx)); });
}

Work ForwardingCommunicator::DoRecv(const OpContext& ctx, Buffer buffer, int peer) {
  OpInfo info = Of(buffer.bytes(), buffer.count, buffer.dtype);
  info.peer = peer;
  return Forward(ctx, info, [&] { return inner_->Recv(buffer, peer, Options(ctx)); });
}

Work ForwardingCommunicator::DoBarrier(const OpContext& ctx) {
  return Forward(ctx, OpInfo{}, [&] { return inner_->Barrier(Options(ctx)); });
}

Work ForwardingCommunicator::DoBatchP2P(const OpContext& ctx, std::vector<P2PItem> items) {
  std::vector<P2POp> ops;
  ops.reserve(items.size());
  OpInfo info;
  for (const P2PItem& item : items) {
    ops.push_back(item.op);
    info.bytes += item.op.buffer.bytes();
    (item.op.is_send ? info.sends : info.recvs) += 1;
  }
  return Forward(ctx, info, [&] { return inner_->BatchP2P(ops, Options(ctx)); });
}

absl::StatusOr<std::shared_ptr<Communicator>> ForwardingCommunicator::DoSplit(const OpContext& ctx,
                                                                              int color, int key) {
  OpInfo info;
  info.color = color;
  info.key = key;
  absl::StatusOr<std::shared_ptr<Communicator>> child;
  (void)Forward(ctx, info, [&] {
    child = inner_->Split(color, key, Options(ctx));
    return Work::Done(child.status());  // Split is blocking: done when it returns
  });
  if (!child.ok() || *child == nullptr) return child;
  return WrapChild(*std::move(child));
}

}  // namespace fairscale::comm
