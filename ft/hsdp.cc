#include "ft/hsdp.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
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

absl::Status Annotate(const absl::Status& s, absl::string_view what) {
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
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

void FaultTolerantHsdp::add_state(std::string name, std::function<std::string()> save,
                                  std::function<void(const std::string&)> load) {
  if (name.empty() || !save || !load) {
    Fail(absl::InvalidArgumentError("add_state needs a name and both functions"), "add_state");
  }
  for (const AddedState& a : added_) {
    if (a.name == name) {
      Fail(absl::InvalidArgumentError(absl::StrCat("state '", name, "' added twice")), "add_state");
    }
  }
  added_.push_back({std::move(name), std::move(save), std::move(load)});
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
  transfer_status_ = absl::OkStatus();
  if (!quorum_.joiners.empty()) {
    const absl::Time t = absl::Now();
    transfer_status_ = Transfer();
    if (!transfer_status_.ok()) {
      if (quorum_.joining) Fail(transfer_status_, "state transfer (this group is joining)");
      record.error = transfer_status_.ToString();
    }
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

std::string FaultTolerantHsdp::SaveArchive() {
  torch::serialize::OutputArchive archive;
  torch::serialize::OutputArchive optimizer;
  optimizer_.save(optimizer);
  archive.write("optimizer", optimizer);
  if (options_.transfer_rng()) {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    archive.write("rng", gen.get_state());
  }
  std::vector<std::string> names;
  for (const AddedState& a : added_) {
    const std::string bytes = a.save();
    at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    if (!bytes.empty()) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
    archive.write(absl::StrCat("state/", a.name), t);
    names.push_back(a.name);
  }
  // The names, so that a receiver with other names fails naming both lists.
  const std::string joined = absl::StrJoin(names, ",");
  at::Tensor t = at::empty({static_cast<int64_t>(joined.size())}, at::kByte);
  if (!joined.empty()) std::memcpy(t.data_ptr(), joined.data(), joined.size());
  archive.write("state_names", t);
  std::ostringstream os;
  archive.save_to(os);
  return os.str();
}

absl::Status FaultTolerantHsdp::LoadArchive(const std::string& bytes, int source) {
  auto as_string = [](const at::Tensor& t) {
    return std::string(static_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.numel()));
  };
  std::vector<std::string> names;
  for (const AddedState& a : added_) names.push_back(a.name);
  try {
    std::istringstream is(bytes);
    torch::serialize::InputArchive archive;
    archive.load_from(is);
    at::Tensor t;
    archive.read("state_names", t);
    const std::string theirs = as_string(t);
    if (theirs != absl::StrJoin(names, ",")) {
      return absl::FailedPreconditionError(absl::StrCat(
          "group ", source, " added the states [", theirs, "], this rank [",
          absl::StrJoin(names, ","), "]: every rank must call add_state with the same names"));
    }
    torch::serialize::InputArchive optimizer;
    archive.read("optimizer", optimizer);
    optimizer_.load(optimizer);
    if (options_.transfer_rng()) {
      if (!archive.try_read("rng", t)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "group ", source, " sent no generator state (its transfer_rng is off, this rank's on)"));
      }
      at::Generator gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(t);
    }
    for (const AddedState& a : added_) {
      archive.read(absl::StrCat("state/", a.name), t);
      a.load(as_string(t));
    }
  } catch (const c10::Error& e) {
    return absl::DataLossError(absl::StrCat("the state archive from group ", source, ": ",
                                            e.what_without_backtrace()));
  }
  return absl::OkStatus();
}

absl::Status FaultTolerantHsdp::Transfer() {
  at::NoGradGuard no_grad;
  const absl::Duration timeout = options_.collective_timeout();
  std::set<int> sources;
  for (int s : quorum_.sources) {
    if (s >= 0) sources.insert(s);
  }
  if (quorum_.joining && quorum_.source_group < 0) {
    bool all_left = !quorum_.dropped_reasons.empty();
    for (const std::string& why : quorum_.dropped_reasons) {
      all_left = all_left && absl::EndsWith(why, " left");
    }
    const std::string reasons =
        quorum_.dropped_reasons.empty()
            ? ""
            : absl::StrCat("; ", absl::StrJoin(quorum_.dropped_reasons, "; "));
    if (all_left) {
      const Membership::Options& m = membership_.options();
      throw NothingToRejoin(absl::StrCat(
          "ft::FaultTolerantHsdp group ", m.group, " rank ", m.shard, "/", m.group_size,
          ": nothing to rejoin: every other group finished and left while this group was away",
          reasons));
    }
    Fail(absl::UnavailableError(absl::StrCat(
             "no group of the previous round is left to copy the state from (every replica group "
             "died: the live state is lost; restart the job from a checkpoint",
             reasons, ")")),
         "state transfer");
  }
  for (int source : sources) {
    auto it = std::find(quorum_.groups.begin(), quorum_.groups.end(), source);
    if (it == quorum_.groups.end()) {
      return absl::InternalError(absl::StrCat("source group ", source, " is not in the quorum"));
    }
    const int root = static_cast<int>(it - quorum_.groups.begin());
    const bool sender = quorum_.group == source;
    const bool receiver = quorum_.joining && quorum_.source_group == source;
    const std::string what = absl::StrCat("state transfer from group ", source, " (replicate rank ",
                                          root, "/", quorum_.replicate_size, ", epoch ",
                                          quorum_.epoch, ")");
    auto broadcast = [&](const at::Tensor& t, const std::string& name) -> absl::Status {
      absl::StatusOr<comm::Buffer> buffer = comm::ToBuffer(t);
      if (!buffer.ok()) return Annotate(buffer.status(), absl::StrCat(what, ": ", name));
      // The operation carries the timeout and Wait() has no deadline of its own: a Wait(timeout)
      // could return while the operation still runs and then free a buffer it writes into.
      comm::OpOptions op;
      op.timeout = timeout;
      absl::Status s = replicate_->Broadcast(*buffer, root, op).Wait();
      return s.ok() ? s : Annotate(s, absl::StrCat(what, ": ", name));
    };
    // (1) the step counter.
    at::Tensor header = at::empty({1}, at::kLong);
    header[0] = step_;
    FS_RETURN_IF_ERROR(broadcast(header, "step counter"));
    const int64_t source_step = header[0].item<int64_t>();
    // (2) parameters (flat shards) and buffers, in place on the receiver and the sender.
    int index = 0;
    for (at::Tensor& t : StateTensors(model_)) {
      const std::string name = absl::StrCat("state tensor ", index++);
      if (receiver || sender) {
        if (t.is_contiguous()) {
          FS_RETURN_IF_ERROR(broadcast(t, name));
        } else {
          at::Tensor tmp = t.contiguous();
          FS_RETURN_IF_ERROR(broadcast(tmp, name));
          if (receiver) t.copy_(tmp);
        }
      } else {
        FS_RETURN_IF_ERROR(broadcast(at::empty_like(t, at::MemoryFormat::Contiguous), name));
      }
    }
    // (3) one archive: the optimizer, the generator, the added states (saved after the tensors
    // went, so a save() that dies interrupts the transfer half-way), size first.
    const std::string archive = sender ? SaveArchive() : std::string();
    at::Tensor size = at::empty({1}, at::kLong);
    size[0] = static_cast<int64_t>(archive.size());
    FS_RETURN_IF_ERROR(broadcast(size, "archive size"));
    const int64_t num_bytes = size[0].item<int64_t>();
    if (num_bytes < 0 || num_bytes > (int64_t{1} << 40)) {
      return absl::DataLossError(absl::StrCat(what, ": archive size ", num_bytes));
    }
    at::Tensor bytes = at::empty({num_bytes}, at::kByte);
    if (sender && num_bytes > 0) std::memcpy(bytes.data_ptr(), archive.data(), num_bytes);
    FS_RETURN_IF_ERROR(broadcast(bytes, "optimizer, generator and added states"));
    if (receiver) {
      FS_RETURN_IF_ERROR(LoadArchive(
          std::string(static_cast<const char*>(bytes.data_ptr()), num_bytes), source));
      step_ = source_step;
    }
  }
  return absl::OkStatus();
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
    status = transfer_status_;  // a failed transfer: the communicator is broken, vote false
    if (status.ok() && quorum_.replicate_size > 1) {
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
  if (!status.ok() && record.error.empty()) record.error = status.ToString();
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
