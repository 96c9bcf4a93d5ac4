#include "trace/tracing_communicator.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fairscale::trace {

TracingCommunicator::TracingCommunicator(std::shared_ptr<comm::Communicator> inner,
                                         std::shared_ptr<Recorder> recorder)
    : comm::ForwardingCommunicator(inner, std::string(inner->backend())),
      recorder_(std::move(recorder)) {}

std::shared_ptr<comm::Communicator> TracingCommunicator::WrapChild(
    std::shared_ptr<comm::Communicator> child) {
  return std::make_shared<TracingCommunicator>(std::move(child), recorder_);
}

comm::Work TracingCommunicator::Forward(const comm::OpContext& ctx, const OpInfo& info,
                                        const std::function<comm::Work()>& issue) {
  if (!recorder_->enabled()) return issue();
  const int lane = recorder_->AcquireLane();
  const int64_t start_ns = recorder_->Now();
  comm::Work work = issue();
  // The span's arguments (README: seq, bytes, count, dtype, group, backend, and per op type).
  std::vector<Arg> args;
  args.reserve(9);
  args.emplace_back("seq", ctx.seq);
  args.emplace_back("bytes", info.bytes);
  if (ctx.type == comm::OpType::kBatchP2P) {
    args.emplace_back("sends", info.sends);
    args.emplace_back("recvs", info.recvs);
  } else {
    args.emplace_back("count", info.count);
    args.emplace_back("dtype", comm::DataTypeName(info.dtype));
  }
  args.emplace_back("group", absl::StrCat(ctx.rank, "/", ctx.size));
  args.emplace_back("backend", ctx.backend);
  if (info.reduce_op.has_value()) args.emplace_back("op", comm::ReduceOpName(*info.reduce_op));
  if (info.root >= 0) args.emplace_back("root", info.root);
  if (info.peer >= 0) args.emplace_back("peer", info.peer);
  if (ctx.type == comm::OpType::kSplit) {
    args.emplace_back("color", info.color);
    args.emplace_back("key", info.key);
  }

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
  work.OnDone([recorder, lane, start_ns, name, args = std::move(args)](
                  const absl::Status& status) mutable {
    const int64_t end_ns = recorder->Now();
    if (!status.ok()) args.emplace_back("error", status.ToString());
    recorder->Complete(name, kCategoryComm, start_ns, end_ns, std::move(args), lane);
    recorder->ReleaseLane(lane);
  });
  return work;
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
