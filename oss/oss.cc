#include "oss/oss.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <sstream>
#include <string>
#include <utility>

#include "base/torch_error.h"
#include "comm/torch/tensor_buffer.h"
#include "deterministic/collectives.h"
#include "deterministic/mode.h"

namespace fairscale::oss {
namespace {

using torch::optim::OptimizerParamGroup;
using torch::optim::OptimizerParamState;

std::string Key(const at::Tensor& t) { return c10::guts::to_string(t.unsafeGetTensorImpl()); }

// The groups' options as the wrapped optimizer fills them in (its defaults for missing ones):
// built over empty groups, so no state is allocated.
std::unique_ptr<torch::optim::Optimizer> Probe(const std::vector<OptimizerParamGroup>& groups,
                                               const OptimizerFactory& factory) {
  TORCH_CHECK(factory, "oss::OSS: no optimizer factory");
  std::vector<OptimizerParamGroup> empty;
  for (const OptimizerParamGroup& g : groups) {
    empty.emplace_back(std::vector<at::Tensor>{});
    if (g.has_options()) empty.back().set_options(g.options().clone());
  }
  std::unique_ptr<torch::optim::Optimizer> probe = factory(std::move(empty));
  TORCH_CHECK(probe != nullptr, "oss::OSS: the optimizer factory returned null");
  TORCH_CHECK(probe->param_groups().size() == groups.size(),
              "oss::OSS: the optimizer factory changed the number of param groups");
  return probe;
}

std::vector<OptimizerParamGroup> WithOptions(const std::vector<OptimizerParamGroup>& groups,
                                             const OptimizerFactory& factory) {
  auto probe = Probe(groups, factory);
  std::vector<OptimizerParamGroup> out;
  for (size_t g = 0; g < groups.size(); ++g) {
    out.emplace_back(groups[g].params(), probe->param_groups()[g].options().clone());
  }
  return out;
}

std::unique_ptr<torch::optim::OptimizerOptions> Defaults(
    const std::vector<OptimizerParamGroup>& groups, const OptimizerFactory& factory) {
  return Probe(groups, factory)->defaults().clone();
}

// A state's fields (tensors and scalars), read back through its own serialization so that any
// optimizer's state type works.
std::vector<std::pair<std::string, c10::IValue>> Fields(const OptimizerParamState& state) {
  torch::serialize::OutputArchive out;
  state.serialize(out);
  std::stringstream stream;
  out.save_to(stream);
  torch::serialize::InputArchive in;
  in.load_from(stream);
  std::vector<std::pair<std::string, c10::IValue>> fields;
  for (const std::string& key : in.keys()) {
    c10::IValue value;
    in.read(key, value);
    fields.emplace_back(key, std::move(value));
  }
  return fields;
}

// A copy of `like` (same state type) with `fields`.
std::unique_ptr<OptimizerParamState> WithFields(
    const OptimizerParamState& like, const std::vector<std::pair<std::string, c10::IValue>>& fields) {
  torch::serialize::OutputArchive out;
  for (const auto& [key, value] : fields) out.write(key, value);
  std::stringstream stream;
  out.save_to(stream);
  torch::serialize::InputArchive in;
  in.load_from(stream);
  std::unique_ptr<OptimizerParamState> state = like.clone();
  state->serialize(in);
  return state;
}

std::string ToBytes(const torch::optim::Optimizer& opt) {
  torch::serialize::OutputArchive out;
  opt.save(out);
  std::ostringstream stream;
  out.save_to(stream);
  return stream.str();
}

void FromBytes(torch::optim::Optimizer& opt, const std::string& bytes) {
  std::istringstream stream(bytes);
  torch::serialize::InputArchive in;
  in.load_from(stream);
  opt.load(in);
}

}  // namespace

OSS::OSS(std::vector<OptimizerParamGroup> param_groups, OptimizerFactory factory,
         std::shared_ptr<comm::Communicator> comm, OssOptions options)
    : Optimizer(WithOptions(param_groups, factory), Defaults(param_groups, factory)),
      factory_(std::move(factory)),
      comm_(std::move(comm)),
      options_(std::move(options)) {
  TORCH_CHECK(comm_ != nullptr, "oss::OSS: null communicator");
  TORCH_CHECK(options_.bucket_numel() > 0, "oss::OSS: bucket_numel must be positive, got ",
              options_.bucket_numel());
  if (options_.broadcast_dtype().has_value()) {
    const c10::ScalarType t = *options_.broadcast_dtype();
    TORCH_CHECK(t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble,
                "oss::OSS: broadcast_dtype must be f16, bf16, f32 or f64, got ", t);
  }
  if (options_.deterministic()) {
    TORCH_CHECK(!options_.broadcast_dtype().has_value(), label("construct"),
                ": deterministic mode needs broadcast_dtype unset (replicas would hold rounded "
                "copies of the owners' values, which a single rank never rounds)");
    TORCH_CHECK(options_.partition() == PartitionMode::kGreedy, label("construct"),
                ": deterministic mode needs PartitionMode::kGreedy (kFlat steps views cut at "
                "world-dependent offsets, whose elementwise kernels may round differently)");
  }
  // Collective, in both modes: a job mixing modes fails here on every rank (at clip_grad_norm
  // the ranks would run different collectives). OSS has no micro-batch count of its own (0).
  deterministic::CheckSameMode(*comm_, options_.deterministic(), 0, label("construct"));
  load_.assign(comm_->size(), 0);
  for (size_t g = 0; g < param_groups_.size(); ++g) partition_group(g);
  local_ = factory_(local_groups(comm_->rank(), true, nullptr));
}

OSS::OSS(std::vector<at::Tensor> params, OptimizerFactory factory,
         std::shared_ptr<comm::Communicator> comm, OssOptions options)
    : OSS(std::vector<OptimizerParamGroup>{OptimizerParamGroup(std::move(params))},
          std::move(factory), std::move(comm), std::move(options)) {}

std::string OSS::label(const std::string& op) const {
  return "oss::OSS::" + op + " rank " + std::to_string(comm_->rank()) + "/" +
         std::to_string(comm_->size());
}

void OSS::partition_group(size_t g) {
  const std::vector<at::Tensor>& params = param_groups_[g].params();
  const int n = comm_->size();
  for (const at::Tensor& p : params) {
    for (const ParamShard& s : shards_) {
      TORCH_CHECK(!s.param.is_same(p), label("partition"), ": a parameter appears twice (group ",
                  s.group, " and group ", g, ")");
    }
  }
  if (options_.partition() == PartitionMode::kGreedy) {
    // Largest first, each to the least-loaded rank (lowest rank on ties). Frozen parameters
    // have no optimizer state: they weigh 1, as in FairScale.
    std::vector<size_t> order(params.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return params[a].numel() > params[b].numel();
    });
    std::vector<int> owner(params.size());
    for (size_t i : order) {
      const int r = static_cast<int>(std::min_element(load_.begin(), load_.end()) - load_.begin());
      owner[i] = r;
      load_[r] += params[i].requires_grad() ? params[i].numel() : 1;
    }
    for (size_t i = 0; i < params.size(); ++i) {
      shards_.push_back({params[i], g, 0, params[i].numel(), owner[i], 0});
    }
    return;
  }
  int64_t total = 0;
  for (const at::Tensor& p : params) {
    TORCH_CHECK(p.is_contiguous(), label("partition"),
                ": kFlat needs contiguous parameters (group ", g, ")");
    total += p.numel();
  }
  const int64_t per_rank = (total + n - 1) / n;
  int64_t start = 0;
  for (const at::Tensor& p : params) {
    const int64_t end = start + p.numel();
    for (int r = 0; r < n && per_rank > 0; ++r) {
      const int64_t lo = std::max(start, r * per_rank);
      const int64_t hi = std::min(end, (r + 1) * per_rank);
      if (lo >= hi) continue;
      shards_.push_back({p, g, lo - start, hi - lo, r, lo});
      load_[r] += hi - lo;
    }
    start = end;
  }
}

OptimizerParamGroup OSS::local_group(int rank, size_t g, bool for_self,
                                     std::vector<size_t>* shard_index) {
  std::vector<at::Tensor> tensors;
  for (size_t i = 0; i < shards_.size(); ++i) {
    const ParamShard& s = shards_[i];
    if (s.rank != rank || s.group != g) continue;
    if (shard_index != nullptr) shard_index->push_back(i);
    if (options_.partition() == PartitionMode::kGreedy) {
      tensors.push_back(s.param);
      continue;
    }
    // A view of the parameter's storage: the wrapped optimizer updates it in place.
    at::Tensor view = s.param.detach().view({-1}).narrow(0, s.offset, s.numel);
    if (for_self) views_.emplace_back(i, view);
    tensors.push_back(view);
  }
  return OptimizerParamGroup(std::move(tensors), param_groups_[g].options().clone());
}

std::vector<OptimizerParamGroup> OSS::local_groups(int rank, bool for_self,
                                                   std::vector<size_t>* shard_index) {
  if (for_self) views_.clear();
  std::vector<OptimizerParamGroup> groups;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    groups.push_back(local_group(rank, g, for_self, shard_index));
  }
  return groups;
}

void OSS::sync_options() {
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    local_->param_groups()[g].set_options(param_groups_[g].options().clone());
  }
}

void OSS::attach_view_grads() {
  for (auto& [index, view] : views_) {
    const ParamShard& s = shards_[index];
    const at::Tensor& grad = s.param.grad();
    view.mutable_grad() =
        grad.defined() ? grad.reshape({-1}).narrow(0, s.offset, s.numel) : at::Tensor();
  }
}

at::Tensor OSS::step(LossClosure closure) {
  if (step_check_) step_check_("step");
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable(true);
    loss = closure();
  }
  sync_options();
  if (options_.partition() == PartitionMode::kFlat) attach_view_grads();
  local_->step();
  if (options_.partition() == PartitionMode::kFlat) {
    for (auto& item : views_) item.second.mutable_grad() = at::Tensor();
  }
  exchange_parameters();
  return loss;
}

void OSS::exchange_parameters() {
  const int n = comm_->size();
  const int me = comm_->rank();
  if (n == 1) return;
  c10::NoGradGuard no_grad;
  const std::optional<c10::ScalarType> wire = options_.broadcast_dtype();
  struct Pending {
    comm::Work work;
    at::Tensor buffer;
    std::vector<size_t> shards;  // kGreedy: the bucket's shards; kFlat: unused
    size_t group = 0;
    int64_t offset = 0;  // kFlat: offset of the piece within each rank's range
    int64_t per_rank = 0;
    at::Tensor send;  // kFlat: what `send` views, alive until the wait
  };
  // Every rank issues the same buckets in the same order; at most kInFlight at a time, so the
  // staging buffers stay bounded by a few buckets whatever the model size.
  constexpr size_t kInFlight = 2;
  std::vector<std::function<Pending()>> jobs;
  if (options_.partition() == PartitionMode::kGreedy) {
    for (int r = 0; r < n; ++r) {
      std::vector<size_t> bucket;
      int64_t numel = 0;
      auto flush = [&] {
        if (bucket.empty()) return;
        jobs.push_back([this, r, me, wire, bucket, numel]() -> Pending {
          const c10::ScalarType dtype = wire.value_or(shards_[bucket[0]].param.scalar_type());
          at::Tensor buffer;
          if (r == me) {
            std::vector<at::Tensor> parts;
            for (size_t i : bucket) parts.push_back(shards_[i].param.detach().reshape({-1}));
            buffer = at::cat(parts).to(dtype);
          } else {
            buffer = at::empty({numel}, shards_[bucket[0]].param.options().dtype(dtype));
          }
          comm::Work work =
              comm_->Broadcast(base::ValueOrThrow(comm::ToBuffer(buffer), label("step")), r);
          return {std::move(work), buffer, bucket, 0, 0, 0, at::Tensor()};
        });
        bucket.clear();
        numel = 0;
      };
      for (size_t i = 0; i < shards_.size(); ++i) {
        const ParamShard& s = shards_[i];
        // Frozen parameters too: an optimizer may still move them (momentum, weight decay on a
        // zero gradient), and then every replica must follow.
        if (s.rank != r) continue;
        if (!bucket.empty() &&
            (numel + s.numel > options_.bucket_numel() ||
             shards_[bucket[0]].param.scalar_type() != s.param.scalar_type())) {
          flush();
        }
        bucket.push_back(i);
        numel += s.numel;
      }
      flush();
    }
  } else {
    for (size_t g = 0; g < param_groups_.size(); ++g) {
      int64_t total = 0;
      for (const at::Tensor& p : param_groups_[g].params()) total += p.numel();
      const int64_t per_rank = (total + n - 1) / n;
      if (per_rank == 0) continue;
      c10::ScalarType dtype = param_groups_[g].params()[0].scalar_type();
      for (const at::Tensor& p : param_groups_[g].params()) {
        TORCH_CHECK(p.scalar_type() == dtype, label("step"),
                    ": kFlat needs one dtype per param group (group ", g, ")");
      }
      if (wire.has_value()) dtype = *wire;
      // This rank's range, zero-padded to per_rank.
      at::Tensor mine = at::zeros({per_rank}, param_groups_[g].params()[0].options().dtype(dtype));
      for (const ParamShard& s : shards_) {
        if (s.group != g || s.rank != me) continue;
        mine.narrow(0, s.flat_offset - me * per_rank, s.numel)
            .copy_(s.param.detach().reshape({-1}).narrow(0, s.offset, s.numel));
      }
      const int64_t piece = std::min(per_rank, options_.bucket_numel());
      for (int64_t off = 0; off < per_rank; off += piece) {
        const int64_t len = std::min(piece, per_rank - off);
        jobs.push_back([this, n, g, off, len, per_rank, mine]() -> Pending {
          at::Tensor send = mine.narrow(0, off, len);
          at::Tensor recv = at::empty({n * len}, mine.options());
          comm::Work work =
              comm_->AllGather(base::ValueOrThrow(comm::ToConstBuffer(send), label("step")),
                               base::ValueOrThrow(comm::ToBuffer(recv), label("step")));
          return {std::move(work), recv, {}, g, off, per_rank, mine};
        });
      }
    }
  }
  auto finish = [&](Pending& p) {
    base::ThrowIfError(p.work.Wait(), label("step"));
    if (options_.partition() == PartitionMode::kGreedy) {
      if (shards_[p.shards[0]].rank == me) return;  // the owner keeps its exact values
      int64_t off = 0;
      for (size_t i : p.shards) {
        const ParamShard& s = shards_[i];
        s.param.detach().view({-1}).copy_(p.buffer.narrow(0, off, s.numel));
        off += s.numel;
      }
      return;
    }
    const int64_t len = p.buffer.numel() / n;
    for (const ParamShard& s : shards_) {
      if (s.group != p.group || s.rank == me) continue;
      // The part of the shard inside [rank start + off, rank start + off + len).
      const int64_t rank_start = s.rank * p.per_rank;
      const int64_t lo = std::max(s.flat_offset, rank_start + p.offset);
      const int64_t hi = std::min(s.flat_offset + s.numel, rank_start + p.offset + len);
      if (lo >= hi) continue;
      s.param.detach()
          .view({-1})
          .narrow(0, s.offset + (lo - s.flat_offset), hi - lo)
          .copy_(p.buffer.narrow(0, s.rank * len + (lo - rank_start - p.offset), hi - lo));
    }
  };
  std::deque<Pending> in_flight;
  size_t next = 0;
  while (next < jobs.size() || !in_flight.empty()) {
    while (next < jobs.size() && in_flight.size() < kInFlight) in_flight.push_back(jobs[next++]());
    try {
      finish(in_flight.front());
    } catch (...) {
      // The communicator is broken: the others fail promptly, and their buffers must outlive them.
      for (Pending& p : in_flight) p.work.Wait().IgnoreError();
      throw;
    }
    in_flight.pop_front();
  }
}

void OSS::zero_grad() { Optimizer::zero_grad(); }

c10::Device OSS::device() const {
  for (const OptimizerParamGroup& group : param_groups_) {
    if (!group.params().empty()) return group.params()[0].device();
  }
  return c10::Device(c10::kCPU);
}

double OSS::clip_grad_norm(double max_norm, double norm_type) {
  c10::NoGradGuard no_grad;
  const bool inf = std::isinf(norm_type);
  TORCH_CHECK(inf || norm_type > 0, label("clip_grad_norm"), ": norm_type must be > 0, got ",
              norm_type);
  if (step_check_) step_check_("clip_grad_norm");
  double total = 0;
  if (options_.deterministic() && !inf) {
    // A float sum of |g|^p depends on the order of the elements, hence on the partition; the
    // exact sum of squares does not (the inf-norm, a max, is exact in the default code below).
    TORCH_CHECK(norm_type == 2.0, label("clip_grad_norm"),
                ": deterministic mode supports norm_type 2 and inf, got ", norm_type);
    deterministic::ExactSquareSum sum;
    for (const ParamShard& s : shards_) {
      if (s.rank != comm_->rank() || !s.param.grad().defined()) continue;
      sum.Add(s.param.grad().detach().reshape({-1}).narrow(0, s.offset, s.numel));
    }
    sum.AllReduce(*comm_, label("clip_grad_norm"));
    total = sum.norm();
  } else {
    total = norm_of_partition(norm_type);
  }
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1) {
    for (const OptimizerParamGroup& group : param_groups_) {
      for (const at::Tensor& p : group.params()) {
        if (p.grad().defined()) p.grad().mul_(coef);
      }
    }
  }
  return total;
}

double OSS::norm_of_partition(double norm_type) {
  const bool inf = std::isinf(norm_type);
  double local = 0;
  for (const ParamShard& s : shards_) {
    if (s.rank != comm_->rank() || !s.param.grad().defined()) continue;
    at::Tensor g = s.param.grad().detach().reshape({-1}).narrow(0, s.offset, s.numel);
    g = g.to(at::kDouble).abs();
    if (inf) {
      if (s.numel > 0) local = std::max(local, g.max().item<double>());
    } else {
      local += g.pow(norm_type).sum().item<double>();
    }
  }
  at::Tensor t = at::empty({1}, at::TensorOptions(at::kDouble).device(device()));
  t.fill_(local);
  comm::Buffer b = base::ValueOrThrow(comm::ToBuffer(t), label("clip_grad_norm"));
  base::ThrowIfError(
      comm_->AllReduce(b, b, inf ? comm::ReduceOp::kMax : comm::ReduceOp::kSum).Wait(),
      label("clip_grad_norm"));
  return inf ? t.item<double>() : std::pow(t.item<double>(), 1.0 / norm_type);
}

void OSS::add_param_group(const OptimizerParamGroup& group) {
  const size_t before = shards_.size();
  Optimizer::add_param_group(group);
  const size_t g = param_groups_.size() - 1;
  try {
    partition_group(g);
  } catch (...) {
    shards_.resize(before);
    param_groups_.pop_back();
    throw;
  }
  local_->add_param_group(local_group(comm_->rank(), g, true, nullptr));
}

void OSS::consolidate_state_dict(int recipient_rank) {
  const int n = comm_->size();
  const int me = comm_->rank();
  TORCH_CHECK(recipient_rank >= 0 && recipient_rank < n, label("consolidate_state_dict"),
              ": recipient_rank ", recipient_rank, " out of range");
  consolidated_.reset();
  const std::string context = label("consolidate_state_dict");
  std::string bytes = ToBytes(*local_);
  if (me != recipient_rank) {
    at::Tensor size = at::empty({1}, at::TensorOptions(at::kLong).device(device()));
    size.fill_(static_cast<int64_t>(bytes.size()));
    at::Tensor data = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    std::memcpy(data.data_ptr(), bytes.data(), bytes.size());
    data = data.to(device());
    base::ThrowIfError(
        comm_->Send(base::ValueOrThrow(comm::ToConstBuffer(size), context), recipient_rank).Wait(),
        context);
    base::ThrowIfError(
        comm_->Send(base::ValueOrThrow(comm::ToConstBuffer(data), context), recipient_rank).Wait(),
        context);
    return;
  }
  std::vector<std::string> all(n);
  all[me] = std::move(bytes);
  for (int r = 0; r < n; ++r) {
    if (r == me) continue;
    at::Tensor size = at::empty({1}, at::TensorOptions(at::kLong).device(device()));
    base::ThrowIfError(comm_->Recv(base::ValueOrThrow(comm::ToBuffer(size), context), r).Wait(),
                       context);
    at::Tensor data =
        at::empty({size.item<int64_t>()}, at::TensorOptions(at::kByte).device(device()));
    base::ThrowIfError(comm_->Recv(base::ValueOrThrow(comm::ToBuffer(data), context), r).Wait(),
                       context);
    data = data.cpu();
    all[r].assign(static_cast<const char*>(data.data_ptr()), data.numel());
  }
  // Rebuild each rank's optimizer over the same tensors (kFlat: fresh views of the same
  // ranges), load its state, then merge the pieces of each parameter.
  std::vector<std::unique_ptr<torch::optim::Optimizer>> replicas;
  std::map<const void*, std::vector<std::pair<size_t, const OptimizerParamState*>>> pieces;
  for (int r = 0; r < n; ++r) {
    std::vector<size_t> index;
    replicas.push_back(factory_(local_groups(r, false, &index)));
    FromBytes(*replicas.back(), all[r]);
    size_t k = 0;
    for (const OptimizerParamGroup& group : replicas.back()->param_groups()) {
      for (const at::Tensor& t : group.params()) {
        const size_t shard = index.at(k++);
        auto it = replicas.back()->state().find(Key(t));
        if (it == replicas.back()->state().end()) continue;
        pieces[shards_[shard].param.unsafeGetTensorImpl()].emplace_back(shard, it->second.get());
      }
    }
  }
  std::vector<OptimizerParamGroup> full;
  for (const OptimizerParamGroup& g : param_groups_) {
    full.emplace_back(g.params(), g.options().clone());
  }
  consolidated_ = factory_(std::move(full));
  for (const OptimizerParamGroup& group : param_groups_) {
    for (const at::Tensor& p : group.params()) {
      auto it = pieces.find(p.unsafeGetTensorImpl());
      if (it == pieces.end()) {
        consolidated_->state().erase(Key(p));
        continue;
      }
      auto& list = it->second;
      std::sort(list.begin(), list.end(), [&](const auto& a, const auto& b) {
        return shards_[a.first].offset < shards_[b.first].offset;
      });
      if (options_.partition() == PartitionMode::kGreedy) {
        consolidated_->state()[Key(p)] = list[0].second->clone();
        continue;
      }
      std::vector<std::vector<std::pair<std::string, c10::IValue>>> fields;
      for (const auto& item : list) fields.push_back(Fields(*item.second));
      std::vector<std::pair<std::string, c10::IValue>> merged;
      for (size_t f = 0; f < fields[0].size(); ++f) {
        const auto& [key, first] = fields[0][f];
        bool split = true;
        std::vector<at::Tensor> parts;
        for (size_t i = 0; i < list.size(); ++i) {
          const c10::IValue& v = fields[i].at(f).second;
          if (!v.isTensor() || v.toTensor().numel() != shards_[list[i].first].numel) {
            split = false;
            break;
          }
          parts.push_back(v.toTensor().reshape({-1}));
        }
        if (split) {
          at::Tensor whole = at::cat(parts);
          TORCH_CHECK(whole.numel() == p.numel(), context, ": state '", key,
                      "' of a parameter with ", p.numel(), " elements has ", whole.numel());
          merged.emplace_back(key, whole.view(p.sizes()));
        } else {
          merged.emplace_back(key, first);
        }
      }
      consolidated_->state()[Key(p)] = WithFields(*list[0].second, merged);
    }
  }
}

torch::optim::Optimizer& OSS::consolidated() {
  TORCH_CHECK(consolidated_ != nullptr, label("consolidated"),
              ": call consolidate_state_dict(recipient) on every rank first; only the "
              "recipient holds the consolidated state");
  return *consolidated_;
}

void OSS::save(torch::serialize::OutputArchive& archive) const {
  TORCH_CHECK(consolidated_ != nullptr, label("save"),
              ": call consolidate_state_dict(recipient) on every rank first and save on the "
              "recipient");
  consolidated_->save(archive);
}

void OSS::load(torch::serialize::InputArchive& archive) {
  std::vector<OptimizerParamGroup> groups;
  for (const OptimizerParamGroup& g : param_groups_) {
    groups.emplace_back(g.params(), g.options().clone());
  }
  std::unique_ptr<torch::optim::Optimizer> full = factory_(std::move(groups));
  full->load(archive);
  TORCH_CHECK(full->param_groups().size() == param_groups_.size(), label("load"),
              ": the archive has ", full->param_groups().size(), " param groups, this has ",
              param_groups_.size());
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    param_groups_[g].set_options(full->param_groups()[g].options().clone());
  }
  std::vector<size_t> index;
  local_ = factory_(local_groups(comm_->rank(), true, &index));
  size_t k = 0;
  for (const OptimizerParamGroup& group : local_->param_groups()) {
    for (const at::Tensor& t : group.params()) {
      const ParamShard& s = shards_[index.at(k++)];
      auto it = full->state().find(Key(s.param));
      if (it == full->state().end()) {
        local_->state().erase(Key(t));
        continue;
      }
      if (options_.partition() == PartitionMode::kGreedy) {
        local_->state()[Key(t)] = it->second->clone();
        continue;
      }
      std::vector<std::pair<std::string, c10::IValue>> fields = Fields(*it->second);
      for (auto& [key, value] : fields) {
        if (value.isTensor() && value.toTensor().numel() == s.param.numel()) {
          value = value.toTensor().reshape({-1}).narrow(0, s.offset, s.numel).clone();
        }
      }
      local_->state()[Key(t)] = WithFields(*it->second, fields);
    }
  }
}

int64_t OSS::local_state_bytes() const {
  int64_t bytes = 0;
  for (const auto& item : local_->state()) {
    for (const auto& field : Fields(*item.second)) {
      if (field.second.isTensor()) bytes += field.second.toTensor().nbytes();
    }
  }
  return bytes;
}

}  // namespace fairscale::oss
