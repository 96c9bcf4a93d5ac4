// local_state_dict / load_local_state_dict of FullyShardedDataParallelImpl and the per-rank
// checkpoint files of local_checkpoint.h (kept out of fully_sharded_data_parallel.cc, which holds
// the training path).
#include <c10/core/GradMode.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/internal/flat_param.h"
#include "fsdp/internal/unit.h"
#include "fsdp/local_checkpoint.h"

namespace fairscale::fsdp {
namespace {

// Buffers of `unit`'s wrapped module `m`, by full name; nested units list their own, and the
// modules `unit` ignores (FsdpOptions::ignored_modules) are left out.
void CollectBuffers(const FullyShardedDataParallelImpl &unit,
                    const std::shared_ptr<torch::nn::Module> &m, const std::string &path,
                    std::vector<std::pair<std::string, at::Tensor>> &out) {
  for (const auto &item : m->named_buffers(/*recurse=*/false)) {
    if (item.value().defined()) out.emplace_back(path + item.key(), item.value());
  }
  for (const auto &child : m->named_children()) {
    if (std::dynamic_pointer_cast<FullyShardedDataParallelImpl>(child.value())) continue;
    if (unit.ignores(*child.value())) continue;
    CollectBuffers(unit, child.value(), path + child.key() + ".", out);
  }
}

std::string Names(const FlatParamInfo &info) {
  std::vector<std::string> names;
  for (const auto &e : info.params) names.push_back(e.name);
  return absl::StrCat("[", absl::StrJoin(names, ", "), "]");
}

std::string Shape(const std::vector<int64_t> &shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

ShardingStrategy StrategyFromName(const std::string &name) {
  for (ShardingStrategy s :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard,
        ShardingStrategy::kHybridShard, ShardingStrategy::kHybridShardZero2}) {
    if (name == ShardingStrategyName(s)) return s;
  }
  TORCH_CHECK(false, "fsdp local state dict: unknown sharding strategy '", name, "'");
  return ShardingStrategy::kFullShard;
}

// Raises unless saved shard #i `s` fits flat parameter `here` of the unit at `prefix` using
// `strategy` (names, shapes, offsets, layout and the shard's size).
void CheckShard(const LocalStateDict::Shard &s, const FlatParamInfo &here, size_t i,
                const std::string &prefix, ShardingStrategy strategy, const std::string &what) {
  const std::string where = absl::StrCat(what, ": unit '", prefix, "' ", here.name);
  TORCH_CHECK(s.unit == prefix && s.info.name == here.name, what,
              ": the model is wrapped differently: flat parameter #", i, " is ", s.info.name,
              " of unit '", s.unit, "' in the state dict but ", here.name, " of unit '",
              prefix, "' here");
  TORCH_CHECK(s.sharding_strategy == strategy, where,
              ": saved with sharding strategy ", ShardingStrategyName(s.sharding_strategy),
              ", this unit uses ", ShardingStrategyName(strategy));
  TORCH_CHECK(s.info.per_parameter == here.per_parameter, where, ": saved with ",
              s.info.per_parameter ? "flatten_parameters(false)" : "flatten_parameters(true)",
              ", this unit uses ",
              here.per_parameter ? "flatten_parameters(false)" : "flatten_parameters(true)",
              "; a full state dict or sharded checkpoint loads across layouts");
  TORCH_CHECK(s.info.params.size() == here.params.size(), where,
              ": holds different parameters: state dict ", Names(s.info), ", here ", Names(here));
  for (size_t p = 0; p < here.params.size(); ++p) {
    const auto &a = s.info.params[p];
    const auto &b = here.params[p];
    TORCH_CHECK(a.name == b.name, where, ": holds different parameters: state dict ",
                Names(s.info), ", here ", Names(here));
    TORCH_CHECK(a.shape == b.shape && a.offset == b.offset && a.numel == b.numel &&
                    a.shard_offset == b.shard_offset && a.rank_numel == b.rank_numel,
                where,
                ": parameter '", b.name, "' has shape ", Shape(a.shape), " at offset ", a.offset,
                " in the state dict but shape ", Shape(b.shape), " at offset ", b.offset,
                " here");
  }
  TORCH_CHECK(
      s.info.numel == here.numel && s.info.padded_numel == here.padded_numel &&
          s.info.shard_numel == here.shard_numel && s.info.shard_offset == here.shard_offset,
      where, ": layout differs: state dict numel ", s.info.numel, " padded ", s.info.padded_numel,
      " shard ", s.info.shard_numel, " at ", s.info.shard_offset, ", here numel ", here.numel,
      " padded ", here.padded_numel, " shard ", here.shard_numel, " at ", here.shard_offset);
  TORCH_CHECK(s.tensor.defined() && s.tensor.dim() == 1 && s.tensor.numel() == here.shard_numel,
              where, ": the saved shard has ", s.tensor.defined() ? s.tensor.numel() : 0,
              " elements, expected ", here.shard_numel);
}

// For each buffer of `buffers`, the saved tensor of the same name and shape in `saved`.
std::vector<const at::Tensor *> MatchBuffers(
    const std::vector<std::pair<std::string, at::Tensor>> &buffers,
    const std::vector<std::pair<std::string, at::Tensor>> &saved, const std::string &what) {
  std::vector<const at::Tensor *> sources;
  for (const auto &[name, b] : buffers) {
    const at::Tensor *found = nullptr;
    for (const auto &[saved_name, t] : saved) {
      if (saved_name == name) found = &t;
    }
    TORCH_CHECK(found != nullptr, what, ": buffer '", name, "' is missing from the state dict");
    TORCH_CHECK(found->sizes() == b.sizes(), what, ": buffer '", name, "' has shape ",
                Shape(found->sizes().vec()), " in the state dict but ", Shape(b.sizes().vec()),
                " here");
    sources.push_back(found);
  }
  TORCH_CHECK(saved.size() == buffers.size(), what, ": the state dict has ", saved.size(),
              " buffers, this model ", buffers.size());
  return sources;
}

constexpr const char *kFormat = "fairscale.fsdp.local_state_dict.v1";

}  // namespace

LocalStateDict FullyShardedDataParallelImpl::local_state_dict() {
  check_root_idle("local_state_dict()");
  c10::NoGradGuard no_grad;
  LocalStateDict out;
  out.rank = rank();
  out.world_size = world_size();
  for (FullyShardedDataParallelImpl *u : fsdp_units()) {
    const std::vector<FlatParamInfo> infos = u->flat_param_info();
    const std::vector<FlatShard> shards = u->flat_shards();
    for (size_t f = 0; f < shards.size(); ++f) {
      out.shards.push_back({u->prefix(), u->options().sharding_strategy(), infos[f],
                            shards[f].shard.detach().clone()});
    }
    CollectBuffers(*u, u->module(), u->prefix(), out.buffers);
  }
  for (auto &b : out.buffers) b.second = b.second.detach().clone();
  return out;
}

void FullyShardedDataParallelImpl::load_local_state_dict(const LocalStateDict &state) {
  check_root_idle("load_local_state_dict");
  const std::string what = label() + ": load_local_state_dict";
  TORCH_CHECK(state.world_size == world_size(), what, ": the state dict was saved at world size ",
              state.world_size, ", this model runs at world size ", world_size(),
              "; a local (sharded) state dict loads only at the world size it "
              "was saved at");
  TORCH_CHECK(state.rank == rank(), what, ": the state dict holds the shards of rank ",
              state.rank, ", this is rank ", rank(), "; each rank loads its own");

  // Validate everything before touching the model.
  struct Target {
    FullyShardedDataParallelImpl *unit;
    size_t flat;
  };
  std::vector<Target> targets;
  std::vector<std::string> here_units;
  const std::vector<FullyShardedDataParallelImpl *> units = fsdp_units();
  for (FullyShardedDataParallelImpl *u : units) {
    here_units.push_back(absl::StrCat("'", u->prefix(), "'"));
    for (size_t f = 0; f < u->unit_->flats().size(); ++f) targets.push_back({u, f});
  }
  std::vector<std::string> saved_units;
  for (const auto &s : state.shards) {
    const std::string quoted = absl::StrCat("'", s.unit, "'");
    if (saved_units.empty() || saved_units.back() != quoted) saved_units.push_back(quoted);
  }
  TORCH_CHECK(state.shards.size() == targets.size(), what,
              ": the model is wrapped differently: the state dict has ", state.shards.size(),
              " flat parameters in units [", absl::StrJoin(saved_units, ", "), "], this model ",
              targets.size(), " in units [", absl::StrJoin(here_units, ", "), "]");
  for (size_t i = 0; i < targets.size(); ++i) {
    FullyShardedDataParallelImpl *u = targets[i].unit;
    CheckShard(state.shards[i], u->flat_param_info()[targets[i].flat], i, u->prefix(),
               u->options().sharding_strategy(), what);
  }
  std::vector<std::pair<std::string, at::Tensor>> buffers;
  for (FullyShardedDataParallelImpl *u : units) {
    CollectBuffers(*u, u->module(), u->prefix(), buffers);
  }
  const std::vector<const at::Tensor *> sources = MatchBuffers(buffers, state.buffers, what);

  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < targets.size(); ++i) {
    targets[i].unit->unit_->LoadShard(targets[i].flat, state.shards[i].tensor);
  }
  for (size_t i = 0; i < buffers.size(); ++i) buffers[i].second.copy_(*sources[i]);
  // Full parameters gathered from the old shards are stale now.
  for (FullyShardedDataParallelImpl *u : units) u->unit_->Reshard();
}

// ---- archives and files --------------------------------------------------------------------

void write_local_state_dict(const LocalStateDict &state, torch::serialize::OutputArchive &ar) {
  ar.write("format", c10::IValue(std::string(kFormat)));
  ar.write("rank", c10::IValue(static_cast<int64_t>(state.rank)));
  ar.write("world_size", c10::IValue(static_cast<int64_t>(state.world_size)));
  ar.write("num_shards", c10::IValue(static_cast<int64_t>(state.shards.size())));
  for (size_t i = 0; i < state.shards.size(); ++i) {
    const LocalStateDict::Shard &s = state.shards[i];
    const std::string k = absl::StrCat("shard_", i, "_");
    ar.write(k + "unit", c10::IValue(s.unit));
    ar.write(k + "strategy", c10::IValue(std::string(ShardingStrategyName(s.sharding_strategy))));
    ar.write(k + "name", c10::IValue(s.info.name));
    ar.write(k + "requires_grad", c10::IValue(s.info.requires_grad));
    ar.write(k + "numel", c10::IValue(s.info.numel));
    ar.write(k + "padded_numel", c10::IValue(s.info.padded_numel));
    ar.write(k + "shard_numel", c10::IValue(s.info.shard_numel));
    ar.write(k + "shard_offset", c10::IValue(s.info.shard_offset));
    ar.write(k + "per_parameter", c10::IValue(s.info.per_parameter));
    ar.write(k + "num_params", c10::IValue(static_cast<int64_t>(s.info.params.size())));
    for (size_t p = 0; p < s.info.params.size(); ++p) {
      const FlatParamInfo::Entry &e = s.info.params[p];
      const std::string kp = absl::StrCat(k, "param_", p, "_");
      ar.write(kp + "name", c10::IValue(e.name));
      ar.write(kp + "aliases", c10::IValue(absl::StrJoin(e.aliases, ",")));
      ar.write(kp + "shape", c10::IValue(e.shape));
      ar.write(kp + "offset", c10::IValue(e.offset));
      ar.write(kp + "shard_offset", c10::IValue(e.shard_offset));
      ar.write(kp + "rank_numel", c10::IValue(e.rank_numel));
      ar.write(kp + "numel", c10::IValue(e.numel));
    }
    ar.write(k + "tensor", s.tensor, /*is_buffer=*/true);
  }
  ar.write("num_buffers", c10::IValue(static_cast<int64_t>(state.buffers.size())));
  for (size_t i = 0; i < state.buffers.size(); ++i) {
    ar.write(absl::StrCat("buffer_", i, "_name"), c10::IValue(state.buffers[i].first));
    ar.write(absl::StrCat("buffer_", i), state.buffers[i].second,
             /*is_buffer=*/true);
  }
}

LocalStateDict read_local_state_dict(torch::serialize::InputArchive &ar) {
  auto read = [&](const std::string &key) {
    c10::IValue v;
    ar.read(key, v);
    return v;
  };
  const c10::IValue format = read("format");
  TORCH_CHECK(format.isString() && format.toStringRef() == kFormat,
              "fsdp local state dict: unknown format (expected ", kFormat, ")");
  LocalStateDict state;
  state.rank = static_cast<int>(read("rank").toInt());
  state.world_size = static_cast<int>(read("world_size").toInt());
  const int64_t num_shards = read("num_shards").toInt();
  for (int64_t i = 0; i < num_shards; ++i) {
    const std::string k = absl::StrCat("shard_", i, "_");
    LocalStateDict::Shard s;
    s.unit = read(k + "unit").toStringRef();
    s.sharding_strategy = StrategyFromName(read(k + "strategy").toStringRef());
    s.info.name = read(k + "name").toStringRef();
    s.info.requires_grad = read(k + "requires_grad").toBool();
    s.info.numel = read(k + "numel").toInt();
    s.info.padded_numel = read(k + "padded_numel").toInt();
    s.info.shard_numel = read(k + "shard_numel").toInt();
    s.info.shard_offset = read(k + "shard_offset").toInt();
    // Absent in files written before the per-parameter layout existed (flat ones).
    c10::IValue v;
    s.info.per_parameter = ar.try_read(k + "per_parameter", v) && v.toBool();
    const int64_t num_params = read(k + "num_params").toInt();
    for (int64_t p = 0; p < num_params; ++p) {
      const std::string kp = absl::StrCat(k, "param_", p, "_");
      FlatParamInfo::Entry e;
      e.name = read(kp + "name").toStringRef();
      const std::string aliases = read(kp + "aliases").toStringRef();
      if (!aliases.empty()) e.aliases = absl::StrSplit(aliases, ',');
      e.shape = read(kp + "shape").toIntVector();
      e.offset = read(kp + "offset").toInt();
      if (ar.try_read(kp + "shard_offset", v)) e.shard_offset = v.toInt();
      if (ar.try_read(kp + "rank_numel", v)) e.rank_numel = v.toInt();
      e.numel = read(kp + "numel").toInt();
      s.info.params.push_back(std::move(e));
    }
    ar.read(k + "tensor", s.tensor, /*is_buffer=*/true);
    state.shards.push_back(std::move(s));
  }
  const int64_t num_buffers = read("num_buffers").toInt();
  for (int64_t i = 0; i < num_buffers; ++i) {
    at::Tensor t;
    ar.read(absl::StrCat("buffer_", i), t, /*is_buffer=*/true);
    state.buffers.emplace_back(read(absl::StrCat("buffer_", i, "_name")).toStringRef(), t);
  }
  return state;
}

void save_local_checkpoint(FullyShardedDataParallel &model,
                           const torch::optim::Optimizer *optimizer, const std::string &path) {
  torch::serialize::OutputArchive archive;
  write_local_state_dict(model->local_state_dict(), archive);
  archive.write("has_optimizer", c10::IValue(optimizer != nullptr));
  if (optimizer != nullptr) {
    torch::serialize::OutputArchive opt_archive;
    optimizer->save(opt_archive);
    archive.write("optimizer", opt_archive);
  }
  const std::string tmp = path + ".tmp";
  try {
    archive.save_to(tmp);
  } catch (...) {
    std::remove(tmp.c_str());
    throw;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    TORCH_CHECK(false, "save_local_checkpoint rank ", model->rank(), "/", model->world_size(),
                ": renaming '", tmp, "' to '", path, "' failed: ", std::strerror(err));
  }
}

void load_local_checkpoint(FullyShardedDataParallel &model, torch::optim::Optimizer *optimizer,
                           const std::string &path) {
  const std::string what = absl::StrCat("load_local_checkpoint('", path, "') rank ", model->rank(),
                                        "/", model->world_size());
  torch::serialize::InputArchive archive;
  LocalStateDict state;
  bool has_optimizer = false;
  try {
    archive.load_from(path);
    state = read_local_state_dict(archive);
    c10::IValue v;
    archive.read("has_optimizer", v);
    has_optimizer = v.toBool();
  } catch (const c10::Error &e) {
    TORCH_CHECK(false, what, ": cannot read the checkpoint: ", e.what_without_backtrace());
  }
  TORCH_CHECK(optimizer == nullptr || has_optimizer, what,
              ": the checkpoint was saved without optimizer state");
  try {
    model->load_local_state_dict(state);
  } catch (const c10::Error &e) {
    TORCH_CHECK(false, what, ": ", e.what_without_backtrace());
  }
  if (optimizer != nullptr) {
    torch::serialize::InputArchive opt_archive;
    archive.read("optimizer", opt_archive);
    optimizer->load(opt_archive);
  }
}

}  // namespace fairscale::fsdp
