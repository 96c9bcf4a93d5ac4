#include "fsdp/internal/state_layout.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/torch/tensor_buffer.h"
#include "base/torch_error.h"
#include "fsdp/internal/optim_state.h"
#include "fsdp/internal/param_ranges.h"

namespace fairscale::fsdp::internal {
namespace {

// Walks the wrapped modules as the unwrapped module's named_parameters() would: a module's own
// parameters, then its children in order, entering nested units' wrapped modules in place.
// What `unit` (the unit whose module `m` is in) ignores (FsdpOptions::ignored_modules) is left
// out.
void WalkUnwrapped(const FullyShardedDataParallelImpl& unit,
                   const std::shared_ptr<torch::nn::Module>& m, const std::string& path,
                   std::vector<std::string>& params,
                   std::vector<std::pair<std::string, at::Tensor>>& buffers) {
  for (const auto& item : m->named_parameters(/*recurse=*/false)) {
    if (!unit.ignores(item.value())) params.push_back(path + item.key());
  }
  for (const auto& item : m->named_buffers(/*recurse=*/false)) {
    if (item.value().defined()) buffers.emplace_back(path + item.key(), item.value());
  }
  for (const auto& child : m->named_children()) {
    const std::string child_path = path + child.key() + ".";
    if (auto nested = std::dynamic_pointer_cast<FullyShardedDataParallelImpl>(child.value())) {
      WalkUnwrapped(*nested, nested->module(), child_path, params, buffers);
    } else if (!unit.ignores(*child.value())) {
      WalkUnwrapped(unit, child.value(), child_path, params, buffers);
    }
  }
}

int ShardRank(const FlatParamInfo& info) {
  return info.shard_numel > 0 ? static_cast<int>(info.shard_offset / info.shard_numel) : 0;
}

// The world size of the gathered (padded) layout: 1 when unsharded.
int GatheredWorld(const FlatParamInfo& info) {
  return info.shard_numel > 0 ? static_cast<int>(info.padded_numel / info.shard_numel) : 1;
}

// The flat parameter the optimizer's `p` is (entry -1), or the per-parameter entry it is;
// {nullptr, -1} if neither.
std::pair<const FlatRef*, int> FindStepped(const ModelLayout& layout, const at::Tensor& p) {
  for (const FlatRef& f : layout.flats) {
    if (!f.info.per_parameter) {
      if (f.shard.is_same(p)) return {&f, -1};
      continue;
    }
    for (size_t e = 0; e < f.params.size(); ++e) {
      if (f.params[e].is_same(p)) return {&f, static_cast<int>(e)};
    }
  }
  return {nullptr, -1};
}

}  // namespace

void ForEachShardPiece(const FlatRef& flat,
                       const std::function<void(size_t, int64_t, int64_t, int64_t)>& fn) {
  const FlatParamInfo& info = flat.info;
  if (!info.per_parameter) {
    ForEachOverlap(info.params, info.shard_offset, info.shard_offset + info.shard_numel,
                   [&](size_t i, int64_t entry_begin, int64_t flat_begin, int64_t length) {
                     fn(i, entry_begin, flat_begin - info.shard_offset, length);
                   });
    return;
  }
  const int rank = ShardRank(info);
  for (size_t i = 0; i < info.params.size(); ++i) {
    const FlatParamInfo::Entry& e = info.params[i];
    const int64_t begin = std::min(e.numel, rank * e.rank_numel);
    const int64_t end = std::min(e.numel, begin + e.rank_numel);
    if (begin < end) fn(i, begin, e.shard_offset, end - begin);
  }
}

void ForEachOwnedPiece(const FlatRef& flat, int rank, int world,
                       const std::function<void(size_t, int64_t, int64_t, int64_t)>& fn) {
  const FlatParamInfo& info = flat.info;
  if (info.per_parameter) {
    // A shard held by several ranks (HYBRID_SHARD's replicate group) is written by the first.
    const bool writes = flat.sharded ? flat.unit->replicate_rank() == 0 : rank == 0;
    if (writes) ForEachShardPiece(flat, fn);
    return;
  }
  // Flat layout: the rank's 1/world of an unsharded flat parameter; of a sharded one, the
  // rank's shard (without padding), split further among the ranks holding the same shard
  // (HYBRID_SHARD's replicate group), so that the groups share the writing.
  int64_t lo = 0, hi = 0;
  if (!flat.sharded) {
    std::tie(lo, hi) = OwnedRange(info.numel, rank, world);
  } else {
    const int64_t begin = std::min(info.numel, info.shard_offset);
    const int64_t end = std::min(info.numel, info.shard_offset + info.shard_numel);
    const auto [a, b] = OwnedRange(end - begin, flat.unit->replicate_rank(),
                                   flat.unit->replicate_world_size());
    lo = begin + a;
    hi = begin + b;
  }
  ForEachOverlap(info.params, lo, hi,
                 [&](size_t i, int64_t entry_begin, int64_t flat_begin, int64_t length) {
                   fn(i, entry_begin, flat_begin - info.shard_offset, length);
                 });
}

at::Tensor EntryFromGathered(const FlatRef& flat, size_t e, const at::Tensor& full) {
  const FlatParamInfo& info = flat.info;
  const FlatParamInfo::Entry& entry = info.params[e];
  if (!info.per_parameter) return full.narrow(0, entry.offset, entry.numel).view(entry.shape);
  at::Tensor out = at::empty({entry.numel}, full.options());
  ForEachDim0Piece(entry.numel, entry.rank_numel, GatheredWorld(info),
                   [&](int q, int64_t begin, int64_t length) {
                     out.narrow(0, begin, length)
                         .copy_(full.narrow(0, q * info.shard_numel + entry.shard_offset, length));
                   });
  return out.view(entry.shape);
}

void EntryToGathered(const FlatRef& flat, size_t e, const at::Tensor& value, at::Tensor& full) {
  const FlatParamInfo& info = flat.info;
  const FlatParamInfo::Entry& entry = info.params[e];
  const at::Tensor v = value.reshape({-1});
  if (!info.per_parameter) {
    full.narrow(0, entry.offset, entry.numel).copy_(v);
    return;
  }
  ForEachDim0Piece(entry.numel, entry.rank_numel, GatheredWorld(info),
                   [&](int q, int64_t begin, int64_t length) {
                     full.narrow(0, q * info.shard_numel + entry.shard_offset, length)
                         .copy_(v.narrow(0, begin, length));
                   });
}

int64_t ShardPosition(const FlatRef& flat, size_t e, int64_t entry_begin) {
  const FlatParamInfo& info = flat.info;
  const FlatParamInfo::Entry& entry = info.params[e];
  if (!info.per_parameter) return entry.offset + entry_begin - info.shard_offset;
  return entry.shard_offset + entry_begin -
         std::min(entry.numel, ShardRank(info) * entry.rank_numel);
}

FlatOptimState GetFlatOptimState(const FlatRef& flat, const torch::optim::Optimizer& optimizer) {
  const size_t n = flat.info.params.size();
  FlatOptimState out{std::vector<bool>(n, false), std::vector<int64_t>(n, 0),
                     std::vector<std::set<std::string>>(n), {}};
  if (!flat.info.per_parameter) {
    ParamState ps;
    if (!GetParamState(optimizer, flat.shard, &ps)) return out;
    for (size_t e = 0; e < n; ++e) {
      out.has[e] = true;
      out.step[e] = ps.step;
      for (const auto& [tname, t] : ps.tensors) out.names[e].insert(tname);
    }
    for (auto& [tname, t] : ps.tensors) out.tensors[tname] = t.detach().contiguous();
    return out;
  }
  for (size_t e = 0; e < n; ++e) {
    ParamState ps;
    if (!GetParamState(optimizer, flat.params[e], &ps)) continue;
    out.has[e] = true;
    out.step[e] = ps.step;
    for (const auto& [tname, t] : ps.tensors) {
      out.names[e].insert(tname);
      at::Tensor& dst = out.tensors[tname];
      if (!dst.defined()) dst = at::zeros({flat.info.shard_numel}, t.options());
      dst.narrow(0, flat.info.params[e].shard_offset, t.numel()).copy_(t.detach().reshape({-1}));
    }
  }
  return out;
}

void ThrowIfAnyFailed(const std::shared_ptr<comm::Communicator>& comm, const absl::Status& status,
                      const std::string& what) {
  std::vector<int64_t> flags(comm->size());
  const int64_t mine = status.ok() ? 1 : 0;
  base::ThrowIfError(comm->AllGather(comm::MakeConstBuffer(&mine, 1),
                               comm::MakeBuffer(flags.data(), flags.size()))
                   .Wait(),
               what + ": all_gather of the ranks' status");
  base::ThrowIfError(status, what);
  std::vector<int> failed;
  for (size_t r = 0; r < flags.size(); ++r) {
    if (flags[r] == 0) failed.push_back(static_cast<int>(r));
  }
  TORCH_CHECK(failed.empty(), what, ": rank(s) ", absl::StrJoin(failed, ", "),
              " failed (see their errors); nothing was changed");
}

std::string ShapeString(at::IntArrayRef shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

std::vector<std::string> ModelLayout::primary_names() const {
  std::vector<std::string> out;
  for (const std::string& n : param_names) {
    if (entry(n).name == n) out.push_back(n);
  }
  return out;
}

ModelLayout GetModelLayout(FullyShardedDataParallel& model) {
  ModelLayout out;
  out.rank = model->rank();
  out.world = model->world_size();
  for (FullyShardedDataParallelImpl* u : model->root_units()) {
    const std::vector<FullyShardedDataParallelImpl::FlatShard> shards = u->flat_shards();
    const std::vector<FlatParamInfo> infos = u->flat_param_info();
    for (size_t i = 0; i < infos.size(); ++i) {
      const FlatParamInfo& info = infos[i];
      const size_t f = out.flats.size();
      out.flats.push_back({u, info, shards[i].shard, u->is_sharded(), shards[i].params});
      for (size_t e = 0; e < info.params.size(); ++e) {
        out.where[info.params[e].name] = {f, e};
        for (const std::string& a : info.params[e].aliases) out.where[a] = {f, e};
      }
    }
  }
  WalkUnwrapped(*model, model->module(), "", out.param_names, out.buffers);
  for (const std::string& n : out.param_names) {
    TORCH_CHECK(out.where.count(n), "fsdp state dict: parameter '", n,
                "' of the wrapped module is in no flat parameter");
  }
  return out;
}

at::Tensor GatherFlat(const ModelLayout& layout, size_t f, const at::Tensor& shard,
                      const std::string& context) {
  const FlatRef& flat = layout.flats[f];
  if (!flat.sharded) return shard;
  TORCH_CHECK(shard.is_contiguous() && shard.numel() == flat.info.shard_numel, context,
              ": expected a contiguous shard of ", flat.info.shard_numel, " elements");
  at::Tensor full = at::empty({flat.info.padded_numel}, shard.options());
  // Over the shard group only (HYBRID_SHARD: every group holds the whole flat parameter).
  const auto& comm = flat.unit->shard_communicator();
  base::ThrowIfError(comm->AllGather(base::ValueOrThrow(comm::ToConstBuffer(shard), context),
                               base::ValueOrThrow(comm::ToBuffer(full), context))
                   .Wait(),
               context + ": all_gather");
  return full;
}

absl::StatusOr<LocalStateDict> StageShards(const ModelLayout& layout, const RangeReader& params,
                                           const RangeReader& buffers) {
  c10::NoGradGuard no_grad;
  LocalStateDict out;
  out.rank = layout.rank;
  out.world_size = layout.world;
  for (const FlatRef& flat : layout.flats) {
    const FlatParamInfo& info = flat.info;
    at::Tensor t = at::zeros({info.shard_numel}, flat.shard.options().requires_grad(false));
    absl::Status status;
    ForEachShardPiece(flat, [&](size_t i, int64_t entry_begin, int64_t pos, int64_t length) {
      if (!status.ok()) return;
      status = params(info.params[i].name, entry_begin, t.narrow(0, pos, length));
    });
    if (!status.ok()) return status;
    out.shards.push_back(
        {flat.unit->prefix(), flat.unit->options().sharding_strategy(), info, std::move(t)});
  }
  for (const auto& [name, b] : layout.buffers) {
    at::Tensor t = at::empty_like(b);
    absl::Status status = buffers(name, 0, t);
    if (!status.ok()) return status;
    out.buffers.emplace_back(name, std::move(t));
  }
  return out;
}

absl::StatusOr<FullOptimState> OptimGroups(const ModelLayout& layout,
                                           const torch::optim::Optimizer& optimizer) {
  FullOptimState out;
  absl::StatusOr<std::string> kind = OptimizerKind(optimizer);
  if (!kind.ok()) return kind.status();
  out.kind = *kind;
  std::map<std::string, size_t> order;
  for (const std::string& n : layout.param_names) order.emplace(n, order.size());
  for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    const auto& group = optimizer.param_groups()[g];
    FullOptimState::Group og;
    og.options = GetOptions(out.kind, group.options());
    for (const at::Tensor& p : group.params()) {
      const auto [flat, entry] = FindStepped(layout, p);
      if (flat == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "optimizer param group ", g, " steps a tensor that is not a ",
            layout.flats.empty() || !layout.flats[0].info.per_parameter
                ? "flat parameter"
                : "parameter",
            " of this FSDP model; build the optimizer over model->parameters()"));
      }
      if (entry >= 0) {
        og.params.push_back(flat->info.params[entry].name);
        continue;
      }
      for (const auto& e : flat->info.params) og.params.push_back(e.name);
    }
    std::sort(og.params.begin(), og.params.end(),
              [&](const std::string& a, const std::string& b) { return order[a] < order[b]; });
    out.param_groups.push_back(std::move(og));
  }
  return out;
}

absl::StatusOr<StagedOptim> StageOptim(const ModelLayout& layout,
                                       const torch::optim::Optimizer& optimizer,
                                       const FullOptimState& meta, const RangeReader& read) {
  c10::NoGradGuard no_grad;
  absl::StatusOr<FullOptimState> here = OptimGroups(layout, optimizer);
  if (!here.ok()) return here.status();
  if (here->kind != meta.kind) {
    return absl::InvalidArgumentError(absl::StrCat("the optimizer state is of a '", meta.kind,
                                                   "' optimizer, this optimizer is '",
                                                   here->kind, "'"));
  }
  if (here->param_groups.size() != meta.param_groups.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the optimizer state has ", meta.param_groups.size(),
                     " param groups, this optimizer ", here->param_groups.size()));
  }
  StagedOptim out;
  out.kind = meta.kind;
  for (size_t g = 0; g < meta.param_groups.size(); ++g) {
    const std::set<std::string> saved(meta.param_groups[g].params.begin(),
                                      meta.param_groups[g].params.end());
    for (const std::string& n : here->param_groups[g].params) {
      if (!saved.count(n)) {
        return absl::InvalidArgumentError(
            absl::StrCat("parameter '", n, "' is in param group ", g,
                         " of this optimizer but not in group ", g, " of the optimizer state"));
      }
    }
    if (saved.size() != here->param_groups[g].params.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "param group ", g, " holds ", saved.size(), " parameters in the optimizer state but ",
          here->param_groups[g].params.size(), " here"));
    }
    auto probe = optimizer.param_groups()[g].options().clone();
    absl::Status options_ok = SetOptions(meta.kind, meta.param_groups[g].options, *probe);
    if (!options_ok.ok()) return options_ok;
    out.group_options.push_back(meta.param_groups[g].options);
  }
  for (const auto& group : optimizer.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      const auto [flat, entry] = FindStepped(layout, p);
      const FlatParamInfo& info = flat->info;
      if (entry >= 0) {  // per-parameter layout: the parameter's own state, its rows
        const FlatParamInfo::Entry& e = info.params[entry];
        const auto it = meta.state.find(e.name);
        if (it == meta.state.end()) {
          out.stateless.push_back(p);
          continue;
        }
        ParamState ps;
        ps.step = it->second.step;
        const int64_t begin = std::min(e.numel, ShardRank(info) * e.rank_numel);
        for (const auto& [tname, unused] : it->second.tensors) {
          at::Tensor t = at::zeros(p.sizes(), p.options().requires_grad(false));
          absl::Status status = read(absl::StrCat(e.name, "/", tname), begin, t.view({-1}));
          if (!status.ok()) return status;
          ps.tensors[tname] = std::move(t);
        }
        out.states.emplace_back(p, MakeParamState(meta.kind, ps));
        continue;
      }
      // Every parameter of a flat parameter shares its optimizer state object: all or none
      // of them have state, with one step count.
      const auto first = meta.state.find(info.params.front().name);
      for (const auto& e : info.params) {
        const auto it = meta.state.find(e.name);
        const bool same = (it == meta.state.end()) == (first == meta.state.end()) &&
                          (it == meta.state.end() || (it->second.step == first->second.step &&
                                                      it->second.tensors.size() ==
                                                          first->second.tensors.size()));
        if (!same) {
          return absl::InvalidArgumentError(absl::StrCat(
              "parameters '", info.params.front().name, "' and '", e.name,
              "' share a flat parameter here but have different optimizer states (step or "
              "state tensors) in the saved state"));
        }
      }
      if (first == meta.state.end()) {
        out.stateless.push_back(p);
        continue;
      }
      ParamState ps;
      ps.step = first->second.step;
      for (const auto& [tname, unused] : first->second.tensors) {
        at::Tensor t = at::zeros({info.shard_numel}, p.options().requires_grad(false));
        absl::Status status;
        ForEachShardPiece(*flat, [&](size_t i, int64_t entry_begin, int64_t pos, int64_t length) {
          if (!status.ok()) return;
          status = read(absl::StrCat(info.params[i].name, "/", tname), entry_begin,
                        t.narrow(0, pos, length));
        });
        if (!status.ok()) return status;
        ps.tensors[tname] = std::move(t);
      }
      out.states.emplace_back(p, MakeParamState(meta.kind, ps));
    }
  }
  return out;
}

void ApplyOptim(torch::optim::Optimizer& optimizer, StagedOptim staged) {
  for (size_t g = 0; g < staged.group_options.size(); ++g) {
    base::ThrowIfError(SetOptions(staged.kind, staged.group_options[g],
                            optimizer.param_groups()[g].options()),
                 "load optimizer state");
  }
  for (const at::Tensor& p : staged.stateless) optimizer.state().erase(StateKey(p));
  for (auto& [p, s] : staged.states) optimizer.state()[StateKey(p)] = std::move(s);
}

}  // namespace fairscale::fsdp::internal
