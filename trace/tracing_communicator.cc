#include "trace/tracing_communicator.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fairscale::trace {
namespace {

comm::OpOptions Options(const comm::OpContext& ctx) { return {ctx.timeout}; }

}  // namespace

TracingCommunicator::TracingCommunicator(std::shared_ptr<comm::Communicator> inner,
                                         std::shared_ptr<Recorder> recorder)
    : comm::Communicator(inner->rank(), inner->size(), std::string(inner->backend()),
                         inner->default_timeout()),
      inner_(std::move(inner)),
      recorder_(std::move(recorder)) {}

TracingCommunicator::Issue TracingCommunicator::Begin() const {
  if (!recorder_->enabled()) return {};
  Issue issue;
  issue.lane = recorder_->AcquireLane();
  issue.start_ns = recorder_->Now();
  return issue;
}

std::vector<Arg> TracingCommunicator::CommonArgs(const comm::OpContext& ctx, size_t bytes,
                                                 size_t count, comm::DataType dtype) const {
  std::vector<Arg> args;
  args.reserve(9);
  args.emplace_back("seq", ctx.seq);
  args.emplace_back("bytes", bytes);
  args.emplace_back("count", count);
  args.emplace_back("dtype", comm::DataTypeName(dtype));
  args.emplace_back("group", absl::StrCat(ctx.rank, "/", ctx.size));
  args.emplace_back("backend", ctx.backend);
  return args;
}

comm::Work TracingCommunicator::Finish(const comm::OpContext& ctx, const Issue& issue,
                                       comm::Work work, std::vector<Arg> args) const {
  if (issue.lane < 0) return work;  // recording was off when the op was issued
  std::shared_ptr<Recorder> recorder = recorder_;
  const std::string name(comm::OpTypeName(ctx.type));
  // The caller's blocking waits on this op, on the waiting thread (category "wait").
  work.OnWait([recorder, wait_name = absl::StrCat("wait ", name), seq = ctx.seq](
                  absl::Duration waited, const absl::Status& status) {
    const int64_t end_ns = recorder->Now();
    std::vector<Arg> wait_args = {Arg("seq", seq)};
    if (!status.ok()) wait_args.emplace_back("error", status.ToString());
    recorder->Complete(wait_name, kCategoryWait, end_ns - absl::ToInt64Nanoseconds(waited), end_ns,
                       std::move(wait_args));
  });
  work.OnDone([recorder, issue, name, args = std::move(args)](const absl::Status& status) mutable {
    const int64_t end_ns = recorder->Now();
    if (!status.ok()) args.emplace_back("error", status.ToString());
    recorder->Complete(name, kCategoryComm, issue.start_ns, end_ns, std::move(args), issue.lane);
    recorder->ReleaseLane(issue.lane);
  });
  return work;
}

comm::Work TracingCommunicator::DoAllReduce(const comm::OpContext& ctx, comm::ConstBuffer send,
                                            comm::Buffer recv, comm::ReduceOp op) {
  const Issue issue = Begin();
  comm::Work work = inner_->AllReduce(send, recv, op, Options(ctx));
  if (issue.lane < 0) return work;
  std::vector<Arg> args = CommonArgs(ctx, send.bytes(), send.count, send.dtype);
  args.emplace_back("op", comm::ReduceOpName(op));
  return Finish(ctx, issue, std::move(work), std::move(args));
}

comm::Work TracingCommunicator::DoReduceScatter(const comm::OpContext& ctx, comm::ConstBuffer send,
                                                comm::Buffer recv, comm::ReduceOp op) {
  const Issue issue = Begin();
  comm::Work work = inner_->ReduceScatter(send, recv, op, Options(ctx));
  if (issue.lane < 0) return work;
  std::vector<Arg> args = CommonArgs(ctx, send.bytes(), send.count, send.dtype);
  args.emplace_back("op", comm::ReduceOpName(op));
  return Finish(ctx, issue, std::move(work), std::move(args));
}

comm::Work TracingCommunicator::DoAllGather(const comm::OpContext& ctx, comm::ConstBuffer send,
                                            comm::Buffer recv) {
  const Issue issue = Begin();
  comm::Work work = inner_->AllGather(send, recv, Options(ctx));
  if (issue.lane < 0) return work;
  return Finish(ctx, issue, std::move(work),
                CommonArgs(ctx, recv.bytes(), recv.count, recv.dtype));
}

comm::Work TracingCommunicator::DoBroadcast(const comm::OpContext& ctx, comm::Buffer buffer,
                                            int root) {
  const Issue issue = Begin();
  comm::Work work = inner_->Broadcast(buffer, root, Options(ctx));
  if (issue.lane < 0) return work;
  std::vector<Arg> args = CommonArgs(ctx, buffer.bytes(), buffer.count, buffer.dtype);
  args.emplace_back("root", root);
  return Finish(ctx, issue, std::move(work), std::move(args));
}

comm::Work TracingCommunicator::DoReduce(const comm::OpContext& ctx, comm::ConstBuffer send,
                                         comm::Buffer recv, comm::ReduceOp op, int root) {
  const Issue issue = Begin();
  comm::Work work = inner_->Reduce(send, recv, op, root, Options(ctx));
  if (issue.lane < 0) return work;
  std::vector<Arg> args = CommonArgs(ctx, send.bytes(), send.count, send.dtype);
  args.emplace_back("op", comm::ReduceOpName(op));
  args.emplace_back("root", root);
  return Finish(ctx, issue, std::move(work), std::move(args));
}

comm::Work TracingCommunicator::DoAllToAll(const comm::OpContext& ctx, comm::ConstBuffer send,
                                           comm::Buffer recv) {
  const Issue issue = Begin();
  comm::Work work = inner_->AllToAll(send, recv, Options(ctx));
  if (issue.lane < 0) return work;
  return Finish(ctx, issue, std::move(work),
                CommonArgs(ctx, recv.bytes(), recv.count, recv.dtype));
}

comm::Work TracingCommunicator::DoSend(const comm::OpContext& ctx, comm::ConstBuffer buffer,
                                       int peer) {
  const Issue issue = Begin();
  comm::Work work = inner_->Send(buffer, peer, Options(ctx));
  if (issue.lane < 0) return work;
  std::vector<Arg> args = CommonArgs(ctx, buffer.bytes(), buffer.count, buffer.dtype);
  args.emplace_back("peer", peer);
  return Finish(ctx, issue, std::move(work), std::move(args));
}

comm::Work TracingCommunicator::DoRecv(const comm::OpContext& ctx, comm::Buffer buffer, int peer) {
  const Issue issue = Begin();
  comm::Work work = inner_->Recv(buffer, peer, Options(ctx));
  if (issue.lane < 0) return work;
  std::vector<Arg> args = CommonArgs(ctx, buffer.bytes(), buffer.count, buffer.dtype);
  args.emplace_back("peer", peer);
  return Finish(ctx, issue, std::move(work), std::move(args));
}

comm::Work TracingCommunicator::DoBarrier(const comm::OpContext& ctx) {
  const Issue issue = Begin();
  comm::Work work = inner_->Barrier(Options(ctx));
  if (issue.lane < 0) return work;
  return Finish(ctx, issue, std::move(work), CommonArgs(ctx, 0, 0, comm::DataType::kU8));
}

comm::Work TracingCommunicator::DoBatchP2P(const comm::OpContext& ctx,
                                           std::vector<comm::P2PItem> items) {
  std::vector<comm::P2POp> ops;
  ops.reserve(items.size());
  size_t bytes = 0, sends = 0;
  for (const comm::P2PItem& item : items) {
    ops.push_back(item.op);
    bytes += item.op.buffer.bytes();
    sends += item.op.is_send ? 1 : 0;
  }
  const Issue issue = Begin();
  comm::Work work = inner_->BatchP2P(ops, Options(ctx));
  if (issue.lane < 0) return work;
  std::vector<Arg> args;
  args.emplace_back("bytes", bytes);
  args.emplace_back("sends", sends);
  args.emplace_back("recvs", items.size() - sends);
  args.emplace_back("group", absl::StrCat(ctx.rank, "/", ctx.size));
  args.emplace_back("backend", ctx.backend);
  return Finish(ctx, issue, std::move(work), std::move(args));
}

absl::StatusOr<std::shared_ptr<comm::Communicator>> TracingCommunicator::DoSplit(
    const comm::OpContext& ctx, int color, int key) {
  const Issue issue = Begin();
  absl::StatusOr<std::shared_ptr<comm::Communicator>> child =
      inner_->Split(color, key, Options(ctx));
  if (issue.lane >= 0) {
    std::vector<Arg> args = CommonArgs(ctx, 0, 0, comm::DataType::kU8);
    args.emplace_back("color", color);
    args.emplace_back("key", key);
    // Split is blocking: its span ends now.
    (void)Finish(ctx, issue, comm::Work::Done(child.status()), std::move(args));
  }
  if (!child.ok() || *child == nullptr) return child;
  return std::shared_ptr<comm::Communicator>(
      std::make_shared<TracingCommunicator>(*std::move(child), recorder_));
}

absl::StatusOr<int64_t> AlignClocks(comm::Communicator& comm, Recorder& recorder,
                                    absl::Duration timeout) {
  comm::OpOptions opts;
  opts.timeout = timeout;
  absl::Status barrier = comm.Barrier(opts).Wait();
  if (!barrier.ok()) return barrier;
  const int64_t mine = Recorder::MonotonicNs();
  std::vector<int64_t> all(static_cast<size_t>(comm.size()), 0);
  absl::Status gather =
      comm.AllGather(comm::MakeConstBuffer(&mine, 1), comm::MakeBuffer(all.data(), all.size()),
                     opts)
          .Wait();
  if (!gather.ok()) return gather;
  const int64_t offset = all[0] - mine;
  recorder.set_clock_offset_ns(offset);
  return offset;
}

}  // namespace fairscale::trace
