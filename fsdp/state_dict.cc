// Full state dicts of FullyShardedDataParallel models and their optimizers (state_dict.h).
#include "fsdp/state_dict.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/serialize/output-archive.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/atomic_file.h"
#include "comm/torch/tensor_buffer.h"
#include "base/torch_error.h"
#include "fsdp/internal/optim_state.h"
#include "fsdp/internal/state_layout.h"

namespace fairscale::fsdp {

using internal::ModelLayout;
using internal::ShapeString;

namespace {

at::Tensor ToCpuCopy(const at::Tensor& t) {
  return t.detach().to(t.options().device(at::kCPU), /*non_blocking=*/false, /*copy=*/true);
}

std::string What(FullyShardedDataParallel& model, const char* op) {
  return absl::StrCat(op, " rank ", model->rank(), "/", model->world_size());
}

// Reads ranges of the flattened tensors of a map, checking the length.
template <typename Lookup>
internal::RangeReader MapReader(Lookup lookup) {
  return [lookup](const std::string& key, int64_t begin, at::Tensor dst) -> absl::Status {
    const at::Tensor* t = lookup(key);
    if (t == nullptr || !t->defined()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", key, "' is missing"));
    }
    if (begin + dst.numel() > t->numel()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", key, "' has ", t->numel(),
                                                     " elements, expected at least ",
                                                     begin + dst.numel()));
    }
    dst.copy_(t->reshape({-1}).narrow(0, begin, dst.numel()));
    return absl::OkStatus();
  };
}

}  // namespace

StateDict full_state_dict(FullyShardedDataParallel& model, bool rank0_only) {
  const std::string what = What(model, "full_state_dict");
  ModelLayout layout = internal::GetModelLayout(model);
  const bool keep = !rank0_only || layout.rank == 0;
  c10::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> by_name;
  for (size_t f = 0; f < layout.flats.size(); ++f) {
    const internal::FlatRef& flat = layout.flats[f];
    // One flat parameter gathered at a time; `full` is freed before the next.
    at::Tensor full = internal::GatherFlat(layout, f, flat.shard.detach(),
                                           absl::StrCat(what, " unit '", flat.unit->prefix(), "'"));
    if (!keep) continue;
    for (size_t e = 0; e < flat.info.params.size(); ++e) {
      by_name[flat.info.params[e].name] = ToCpuCopy(internal::EntryFromGathered(flat, e, full));
    }
  }
  StateDict out;
  if (!keep) return out;
  for (const std::string& n : layout.param_names) out.insert(n, by_name.at(layout.entry(n).name));
  for (const auto& [n, b] : layout.buffers) out.insert(n, ToCpuCopy(b));
  return out;
}

namespace {

// INVALID_ARGUMENT naming the first tensor of `state` that does not fit the model.
absl::Status CheckFullStateDict(const ModelLayout& layout, const StateDict& state) {
  std::set<std::string> expected;
  auto check = [&](const std::string& n, at::IntArrayRef shape,
                   at::ScalarType dtype) -> absl::Status {
    expected.insert(n);
    const at::Tensor* t = state.find(n);
    if (t == nullptr || !t->defined()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", n, "' is missing"));
    }
    if (t->sizes() != shape) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", n, "' has shape ",
                                                     ShapeString(t->sizes()),
                                                     ", the model's has shape ", ShapeString(shape)));
    }
    if (t->scalar_type() != dtype) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", n, "' is ",
                                                     c10::toString(t->scalar_type()),
                                                     ", the model's is ", c10::toString(dtype)));
    }
    return absl::OkStatus();
  };
  for (const std::string& n : layout.param_names) {
    absl::Status s = check(n, layout.entry(n).shape, layout.dtype(n));
    if (!s.ok()) return s;
  }
  for (const auto& [n, b] : layout.buffers) {
    absl::Status s = check(n, b.sizes(), b.scalar_type());
    if (!s.ok()) return s;
  }
  for (const auto& item : state) {
    if (!expected.count(item.key())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", item.key(), "' is not a parameter or buffer of the model"));
    }
  }
  return absl::OkStatus();
}

void Broadcast(FullyShardedDataParallel& model, const at::Tensor& t, const std::string& context) {
  if (model->world_size() == 1) return;
  base::ThrowIfError(
      model->communicator()->Broadcast(base::ValueOrThrow(comm::ToBuffer(t), context), 0).Wait(),
      context);
}

}  // namespace

void load_full_state_dict(FullyShardedDataParallel& model, const StateDict& state,
                          bool from_rank0) {
  const std::string what = What(model, "load_full_state_dict");
  ModelLayout layout = internal::GetModelLayout(model);
  c10::NoGradGuard no_grad;
  if (!from_rank0) {
    base::ThrowIfError(CheckFullStateDict(layout, state), what);
    const auto reader = MapReader([&state](const std::string& k) { return state.find(k); });
    absl::StatusOr<LocalStateDict> staged = internal::StageShards(layout, reader, reader);
    base::ThrowIfError(staged.status(), what);
    model->load_local_state_dict(*staged);
    return;
  }
  const bool root = layout.rank == 0;
  internal::ThrowIfAnyFailed(model->communicator(),
                             root ? CheckFullStateDict(layout, state) : absl::OkStatus(), what);
  LocalStateDict staged;
  staged.rank = layout.rank;
  staged.world_size = layout.world;
  for (const internal::FlatRef& flat : layout.flats) {
    const FlatParamInfo& info = flat.info;
    // One padded flat parameter at a time: rank 0 assembles it, every rank keeps its shard.
    at::Tensor full = at::zeros({info.padded_numel}, flat.shard.options().requires_grad(false));
    if (root) {
      for (size_t e = 0; e < info.params.size(); ++e) {
        internal::EntryToGathered(flat, e, state[info.params[e].name], full);
      }
    }
    Broadcast(model, full, absl::StrCat(what, ": broadcast of unit '", flat.unit->prefix(), "' ",
                                         info.name));
    staged.shards.push_back({flat.unit->prefix(), flat.unit->options().sharding_strategy(), info,
                             full.narrow(0, info.shard_offset, info.shard_numel).clone()});
  }
  for (const auto& [name, b] : layout.buffers) {
    at::Tensor t = root ? state[name].to(b.options()).contiguous().clone() : at::empty_like(b);
    Broadcast(model, t, absl::StrCat(what, ": broadcast of buffer '", name, "'"));
    staged.buffers.emplace_back(name, std::move(t));
  }
  model->load_local_state_dict(staged);
}

FullOptimState full_optim_state_dict(FullyShardedDataParallel& model,
                                     const torch::optim::Optimizer& optimizer, bool rank0_only) {
  const std::string what = What(model, "full_optim_state_dict");
  ModelLayout layout = internal::GetModelLayout(model);
  absl::StatusOr<FullOptimState> groups = internal::OptimGroups(layout, optimizer);
  base::ThrowIfError(groups.status(), what);
  FullOptimState out = *std::move(groups);
  const bool keep = !rank0_only || layout.rank == 0;
  c10::NoGradGuard no_grad;
  for (size_t f = 0; f < layout.flats.size(); ++f) {
    const internal::FlatRef& flat = layout.flats[f];
    // Every rank steps its shard of every flat parameter (or its rows of every parameter), so
    // all ranks agree on which have state and the gathers below match up.
    const internal::FlatOptimState ps = internal::GetFlatOptimState(flat, optimizer);
    for (size_t e = 0; e < flat.info.params.size(); ++e) {
      if (keep && ps.has[e]) out.state[flat.info.params[e].name].step = ps.step[e];
    }
    for (const auto& [tname, t] : ps.tensors) {
      at::Tensor full = internal::GatherFlat(
          layout, f, t, absl::StrCat(what, " unit '", flat.unit->prefix(), "' ", tname));
      if (!keep) continue;
      for (size_t e = 0; e < flat.info.params.size(); ++e) {
        if (!ps.names[e].count(tname)) continue;
        out.state[flat.info.params[e].name].tensors[tname] =
            ToCpuCopy(internal::EntryFromGathered(flat, e, full));
      }
    }
  }
  if (!keep) return FullOptimState();
  return out;
}

namespace {

absl::Status CheckFullOptimState(const ModelLayout& layout, const FullOptimState& state) {
  for (const auto& [name, ps] : state.state) {
    if (!layout.where.count(name)) {
      return absl::InvalidArgumentError(absl::StrCat("the optimizer state has parameter '", name,
                                                     "', which the model does not"));
    }
    for (const auto& [tname, t] : ps.tensors) {
      if (!t.defined() || t.sizes() != at::IntArrayRef(layout.entry(name).shape)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "optimizer state '", name, "/", tname, "' has shape ",
            t.defined() ? ShapeString(t.sizes()) : "undefined", ", the parameter's is ",
            ShapeString(layout.entry(name).shape)));
      }
    }
  }
  return absl::OkStatus();
}

// Everything of a FullOptimState but the tensor values, for broadcasting it from rank 0.
std::string OptimMetaJson(const FullOptimState& state) {
  nlohmann::json groups = nlohmann::json::array();
  for (const auto& g : state.param_groups) {
    groups.push_back({{"options", g.options}, {"params", g.params}});
  }
  nlohmann::json params = nlohmann::json::object();
  for (const auto& [name, ps] : state.state) {
    std::vector<std::string> tensors;
    for (const auto& [tname, t] : ps.tensors) tensors.push_back(tname);
    params[name] = {{"step", ps.step}, {"tensors", tensors}};
  }
  return nlohmann::json{{"kind", state.kind}, {"param_groups", groups}, {"state", params}}.dump();
}

FullOptimState OptimMetaFromJson(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text);
  FullOptimState meta;
  meta.kind = j.at("kind").get<std::string>();
  for (const auto& g : j.at("param_groups")) {
    meta.param_groups.push_back({g.at("options").get<std::map<std::string, double>>(),
                                 g.at("params").get<std::vector<std::string>>()});
  }
  for (const auto& [name, p] : j.at("state").items()) {
    auto& ps = meta.state[name];
    ps.step = p.at("step").get<int64_t>();
    for (const auto& t : p.at("tensors")) ps.tensors[t.get<std::string>()] = at::Tensor();
  }
  return meta;
}

void BroadcastString(FullyShardedDataParallel& model, std::string* text,
                     const std::string& context) {
  if (model->world_size() == 1) return;
  const auto& comm = model->communicator();
  int64_t size = static_cast<int64_t>(text->size());
  base::ThrowIfError(comm->Broadcast(comm::MakeBuffer(&size, 1), 0).Wait(), context);
  std::vector<uint8_t> bytes(text->begin(), text->end());
  bytes.resize(static_cast<size_t>(size));
  base::ThrowIfError(comm->Broadcast(comm::MakeBuffer(bytes.data(), bytes.size()), 0).Wait(), context);
  text->assign(bytes.begin(), bytes.end());
}

}  // namespace

void load_full_optim_state_dict(FullyShardedDataParallel& model, torch::optim::Optimizer& optimizer,
                                const FullOptimState& state, bool from_rank0) {
  const std::string what = What(model, "load_full_optim_state_dict");
  ModelLayout layout = internal::GetModelLayout(model);
  c10::NoGradGuard no_grad;
  if (!from_rank0) {
    base::ThrowIfError(CheckFullOptimState(layout, state), what);
    const auto reader = MapReader([&state](const std::string& key) -> const at::Tensor* {
      const size_t slash = key.rfind('/');
      auto it = state.state.find(key.substr(0, slash));
      if (it == state.state.end()) return nullptr;
      auto t = it->second.tensors.find(key.substr(slash + 1));
      return t == it->second.tensors.end() ? nullptr : &t->second;
    });
    absl::StatusOr<internal::StagedOptim> staged =
        internal::StageOptim(layout, optimizer, state, reader);
    base::ThrowIfError(staged.status(), what);
    internal::ApplyOptim(optimizer, *std::move(staged));
    return;
  }
  const bool root = layout.rank == 0;
  internal::ThrowIfAnyFailed(model->communicator(),
                             root ? CheckFullOptimState(layout, state) : absl::OkStatus(), what);
  std::string meta_json = root ? OptimMetaJson(state) : std::string();
  BroadcastString(model, &meta_json, what + ": broadcast of the optimizer state's layout");
  const FullOptimState meta = OptimMetaFromJson(meta_json);
  // One padded flat state tensor at a time: rank 0 assembles it, every rank keeps its slice.
  std::map<std::pair<size_t, std::string>, at::Tensor> slices;
  for (size_t f = 0; f < layout.flats.size(); ++f) {
    const internal::FlatRef& flat = layout.flats[f];
    const FlatParamInfo& info = flat.info;
    // The state tensors any of its parameters has (all of them share one with the flat layout).
    std::set<std::string> tnames;
    for (const FlatParamInfo::Entry& e : info.params) {
      const auto it = meta.state.find(e.name);
      if (it == meta.state.end()) continue;
      for (const auto& [tname, unused] : it->second.tensors) tnames.insert(tname);
    }
    for (const std::string& tname : tnames) {
      at::Tensor full = at::zeros({info.padded_numel}, flat.shard.options().requires_grad(false));
      for (size_t e = 0; e < info.params.size(); ++e) {
        auto p = root ? state.state.find(info.params[e].name) : state.state.end();
        if (p == state.state.end()) continue;
        auto t = p->second.tensors.find(tname);
        if (t != p->second.tensors.end()) internal::EntryToGathered(flat, e, t->second, full);
      }
      Broadcast(model, full, absl::StrCat(what, ": broadcast of unit '", flat.unit->prefix(),
                                          "' ", info.name, " ", tname));
      slices[{f, tname}] = full.narrow(0, info.shard_offset, info.shard_numel).clone();
    }
  }
  const internal::RangeReader reader = [&](const std::string& key, int64_t begin,
                                           at::Tensor dst) -> absl::Status {
    const size_t slash = key.rfind('/');
    const auto [f, e] = layout.where.at(key.substr(0, slash));
    auto slice = slices.find({f, key.substr(slash + 1)});
    if (slice == slices.end()) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer state '", key, "' is missing"));
    }
    dst.copy_(slice->second.narrow(0, internal::ShardPosition(layout.flats[f], e, begin),
                                   dst.numel()));
    return absl::OkStatus();
  };
  absl::StatusOr<internal::StagedOptim> staged =
      internal::StageOptim(layout, optimizer, meta, reader);
  base::ThrowIfError(staged.status(), what);
  internal::ApplyOptim(optimizer, *std::move(staged));
}

// ---- plain LibTorch files -----------------------------------------------------------------

namespace {

// Module::save's layout: a module's tensors by their own name, each child in a nested archive.
struct ArchiveNode {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::vector<std::pair<std::string, ArchiveNode>> children;
  ArchiveNode& child(const std::string& key) {
    for (auto& [k, c] : children) {
      if (k == key) return c;
    }
    return children.emplace_back(key, ArchiveNode()).second;
  }
  void write(torch::serialize::OutputArchive& archive) const {
    for (const auto& [k, t] : tensors) archive.write(k, t);
    for (const auto& [k, c] : children) {
      torch::serialize::OutputArchive nested(archive.compilation_unit());
      c.write(nested);
      archive.write(k, nested);
    }
  }
};

// The archive is streamed into a base::AtomicFileWriter (tmp, fsync, rename, fsync of the
// directory), so a failed write is reported with the file's name and the OS error.
void SaveArchive(torch::serialize::OutputArchive& archive, const std::string& path,
                 const std::string& what) {
  base::AtomicFileWriter file = base::ValueOrThrow(base::AtomicFileWriter::Open(path), what);
  try {
    // A short count makes LibTorch raise "failed writing"; the writer keeps the reason.
    archive.save_to([&file](const void* data, size_t n) -> size_t {
      return file.Append(absl::string_view(static_cast<const char*>(data), n)).ok() ? n : 0;
    });
  } catch (const c10::Error& e) {
    base::ThrowIfError(file.status(), what);
    TORCH_CHECK(false, what, ": cannot write '", file.tmp_path(), "': ",
                e.what_without_backtrace());
  }
  base::ThrowIfError(file.Commit(), what);
}

}  // namespace

void save_module_state_dict(const StateDict& state, const std::string& path) {
  ArchiveNode root;
  for (const auto& item : state) {
    ArchiveNode* node = &root;
    std::string name = item.key();
    for (size_t dot = name.find('.'); dot != std::string::npos; dot = name.find('.')) {
      node = &node->child(name.substr(0, dot));
      name = name.substr(dot + 1);
    }
    node->tensors.emplace_back(name, item.value());
  }
  torch::serialize::OutputArchive archive;
  root.write(archive);
  SaveArchive(archive, path, absl::StrCat("save_module_state_dict('", path, "')"));
}

void save_torch_optimizer(const FullOptimState& state, const std::string& path) {
  const std::string what = absl::StrCat("save_torch_optimizer('", path, "')");
  // Stand-ins for the unwrapped module's parameters; Optimizer::save records only their order.
  std::vector<std::vector<at::Tensor>> groups;
  std::vector<std::map<std::string, double>> options;
  std::vector<std::pair<at::Tensor, const FullOptimState::Param*>> with_state;
  for (const FullOptimState::Group& g : state.param_groups) {
    auto& params = groups.emplace_back();
    for (const std::string& n : g.params) {
      params.push_back(at::empty({0}));
      auto it = state.state.find(n);
      if (it != state.state.end()) with_state.emplace_back(params.back(), &it->second);
    }
    options.push_back(g.options);
  }
  auto opt = internal::MakePlainOptimizer(state.kind, groups, options);
  base::ThrowIfError(opt.status(), what);
  for (const auto& [p, ps] : with_state) {
    internal::ParamState s;
    s.step = ps->step;
    s.tensors = ps->tensors;
    (*opt)->state()[internal::StateKey(p)] = internal::MakeParamState(state.kind, s);
  }
  torch::serialize::OutputArchive archive;
  (*opt)->save(archive);
  SaveArchive(archive, path, what);
}

}  // namespace fairscale::fsdp
