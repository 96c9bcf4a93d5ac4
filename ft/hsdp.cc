#include "ft/hsdp.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <set>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/torch_error.h"
#include "comm/torch/tensor_buffer.h"

namespace fairscale::ft {
namespace {

// The tensors whose values are the model's state: what the optimizer steps, then the buffers.
std::vector<at::Tensor> StateTensors(fsdp::FullyShardedDataParallel& model) {
  std::vector<at::Tensor> out = model->parameters();
  for (at::Tensor& b : model->buffers()) out.push_back(b);
  return out;
}

}  // namespace

FaultTolerantHsdp::FaultTolerantHsdp(fsdp::FullyShardedDataParallel model,
                                     torch::optim::Optimizer& optimizer, Membership& membership,
                                     HsdpOptions options)
    : model_(std::move(model)),
      optimizer_(optimizer),
      membership_(membership),
      options_(std::move(options)) {
  const Membership::Options& m = membership_.options();
  quorum_.group = m.group;
  quorum_.shard = m.shard;
  if (model_->world_size() != m.group_size || model_->rank() != m.shard ||
      model_->replicate_world_size() != 1) {
    Fail(absl::InvalidArgumentError(absl::StrCat(
             "the model must shard over this rank's group alone: its FSDP rank ", model_->rank(),
             "/", model_->world_size(), " (replicate world size ", model_->replicate_world_size(),
             "), the membership's shard ", m.shard, "/", m.group_size)),
         "construction");
  }
}

void FaultTolerantHsdp::Fail(const absl::Status& status, const std::string& what) const {
  const Membership::Options& m = membership_.options();
  base::ThrowIfError(status, absl::StrCat("ft::FaultTolerantHsdp group ", m.group, " rank ",
                                          m.shard, "/", m.group_size, " step ", step_, ": ", what));
  std::abort();  // unreachable: status is never OK here
}

const Quorum& FaultTolerantHsdp::begin_step() {
  if (in_step_) {
    Fail(absl::FailedPreconditionError("begin_step twice without end_step"), "begin_step");
  }
  HsdpStepRecord record;
  const absl::Time start = absl::Now();
  absl::StatusOr<Quorum> q = membership_.quorum(step_, options_.quorum_timeout());
  if (!q.ok()) Fail(q.status(), "quorum");
  quorum_ = *std::move(q);
  if (quorum_.changed || replicate_ == nullptr) {
    absl::StatusOr<std::shared_ptr<comm::Communicator>> next = membership_.replicate_communicator(
        quorum_, std::move(replicate_), options_.backend(), options_.comm_config());
    if (!next.ok()) Fail(next.status(), absl::StrCat("replicate communicator, epoch ", quorum_.epoch));
    replicate_ = *std::move(next);
  }
  record.quorum_wait = absl::Now() - start;
  if (!quorum_.joiners.empty()) {
    const absl::Time t = absl::Now();
    Transfer();
    record.transfer_time = absl::Now() - t;
    record.received_state = quorum_.joining;
    record.source_group = quorum_.source_group;
  }
  record.step = step_;
  record.epoch = quorum_.epoch;
  record.groups = quorum_.groups;
  history_.push_back(std::move(record));
  in_step_ = true;
  return quorum_;
}

void FaultTolerantHsdp::Transfer() {
  at::NoGradGuard no_grad;
  const absl::Duration timeout = options_.collective_timeout();
  std::set<int> sources;
  for (int s : quorum_.sources) {
    if (s >= 0) sources.insert(s);
  }
  if (quorum_.joining && quorum_.source_group < 0) {
    Fail(absl::UnavailableError("no group of the previous round is left to copy the state from"),
         "state transfer");
  }
  for (int source : sources) {
    auto it = std::find(quorum_.groups.begin(), quorum_.groups.end(), source);
    if (it == quorum_.groups.end()) {
      Fail(absl::InternalError(absl::StrCat("source group ", source, " is not in the quorum")),
           "state transfer");
    }
    const int root = static_cast<int>(it - quorum_.groups.begin());
    const bool sender = quorum_.group == source;
    const bool receiver = quorum_.joining && quorum_.source_group == source;
    const std::string what = absl::StrCat("state transfer from group ", source, " (replicate rank ",
                                          root, "/", quorum_.replicate_size, ", epoch ",
                                          quorum_.epoch, ")");
    auto broadcast = [&](const at::Tensor& t, const std::string& name) {
      absl::StatusOr<comm::Buffer> buffer = comm::ToBuffer(t);
      if (!buffer.ok()) Fail(buffer.status(), absl::StrCat(what, ": ", name));
      // The operation carries the timeout and Wait() has no deadline of its own: a Wait(timeout)
      // could return while the operation still runs and then free a buffer it writes into.
      comm::OpOptions op;
      op.timeout = timeout;
      absl::Status s = replicate_->Broadcast(*buffer, root, op).Wait();
      if (!s.ok()) Fail(s, absl::StrCat(what, ": ", name));
    };
    // (1) the step counter and the size of the serialized optimizer.
    std::string optimizer_bytes;
    if (sender) {
      torch::serialize::OutputArchive archive;
      optimizer_.save(archive);
      std::ostringstream os;
      archive.save_to(os);
      optimizer_bytes = os.str();
    }
    at::Tensor header = at::empty({2}, at::kLong);
    header[0] = step_;
    header[1] = static_cast<int64_t>(optimizer_bytes.size());
    broadcast(header, "step counter");
    const int64_t source_step = header[0].item<int64_t>();
    const int64_t num_bytes = header[1].item<int64_t>();
    // (2) parameters (flat shards) and buffers, in place on the receiver and the sender.
    int index = 0;
    for (at::Tensor& t : StateTensors(model_)) {
      const std::string name = absl::StrCat("state tensor ", index++);
      if (receiver || sender) {
        if (t.is_contiguous()) {
          broadcast(t, name);
        } else {
          at::Tensor tmp = t.contiguous();
          broadcast(tmp, name);
          if (receiver) t.copy_(tmp);
        }
      } else {
        broadcast(at::empty_like(t, at::MemoryFormat::Contiguous), name);
      }
    }
    // (3) the optimizer: state and param groups.
    at::Tensor bytes = at::empty({num_bytes}, at::kByte);
    if (sender && num_bytes > 0) std::memcpy(bytes.data_ptr(), optimizer_bytes.data(), num_bytes);
    broadcast(bytes, "optimizer state");
    if (receiver) {
      std::istringstream is(std::string(static_cast<const char*>(bytes.data_ptr()), num_bytes));
      torch::serialize::InputArchive archive;
      archive.load_from(is);
      optimizer_.load(archive);
      step_ = source_step;
    }
  }
}

bool FaultTolerantHsdp::end_step() {
  if (!in_step_) Fail(absl::FailedPreconditionError("end_step without begin_step"), "end_step");
  in_step_ = false;
  HsdpStepRecord& record = history_.back();
  absl::Status status;
  const absl::Time start = absl::Now();
  {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> params = model_->parameters();
    for (at::Tensor& p : params) {
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    }
    const int groups = static_cast<int>(quorum_.groups.size());
    if (quorum_.replicate_size > 1) {
      std::vector<comm::Work> works;
      std::vector<at::Tensor> grads;
      // Bounded by each operation's own timeout (see the state transfer's broadcast).
      comm::OpOptions op;
      op.timeout = options_.collective_timeout();
      for (at::Tensor& p : params) {
        at::Tensor g = p.grad().is_contiguous() ? p.grad() : p.grad().contiguous();
        absl::StatusOr<comm::Buffer> buffer = comm::ToBuffer(g);
        if (!buffer.ok()) {
          status = buffer.status();
          break;
        }
        works.push_back(replicate_->AllReduce(*buffer, *buffer, comm::ReduceOp::kSum, op));
        grads.push_back(g);
      }
      for (comm::Work& w : works) {
        absl::Status s = w.Wait();
        if (status.ok() && !s.ok()) status = s;
      }
      if (status.ok()) {
        for (size_t i = 0; i < params.size(); ++i) {
          grads[i].div_(groups);
          if (!grads[i].is_same(params[i].grad())) params[i].mutable_grad().copy_(grads[i]);
        }
      }
    }
  }
  record.reduce_time = absl::Now() - start;
  if (!status.ok()) record.error = status.ToString();
  absl::StatusOr<bool> commit =
      membership_.should_commit(quorum_, status.ok(), options_.commit_timeout());
  if (!commit.ok()) Fail(commit.status(), "should_commit");
  record.committed = *commit;
  if (*commit) {
    optimizer_.step();
    ++step_;
  } else {
    optimizer_.zero_grad();
  }
  return *commit;
}

}  // namespace fairscale::ft
