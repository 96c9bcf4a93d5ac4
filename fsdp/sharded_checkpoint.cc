// Sharded checkpoints (sharded_checkpoint.h): the model side of the files in
// internal/shard_file.h.
#include "fsdp/sharded_checkpoint.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/GradMode.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <exception>
#include <functional>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/atomic_file.h"
#include "base/fnv1a.h"
#include "comm/torch/tensor_buffer.h"
#include "base/torch_error.h"
#include "fsdp/internal/optim_state.h"
#include "fsdp/internal/param_ranges.h"
#include "fsdp/internal/shard_file.h"
#include "fsdp/internal/state_layout.h"

namespace fairscale::fsdp {

using internal::Manifest;
using internal::ModelLayout;
using internal::ShapeString;

namespace {

std::string DtypeName(at::ScalarType t) { return c10::toString(t); }

// The dtype names a checkpoint may hold are internal::DtypeSize's (the one list, LibTorch-free);
// here each is mapped to the ScalarType of that name.
absl::StatusOr<at::ScalarType> DtypeFromName(const std::string& name) {
  if (internal::DtypeSize(name) > 0) {
    for (int i = 0; i < static_cast<int>(at::ScalarType::NumOptions); ++i) {
      const auto t = static_cast<at::ScalarType>(i);
      if (name == c10::toString(t)) return t;
    }
  }
  return absl::DataLossError(absl::StrCat("unknown dtype '", name, "'"));
}

std::string Join(const std::string& dir, const std::string& name) {
  return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

// The files of a checkpoint (internal::OpenCheckpointFiles checked them against each other),
// read on demand: each record at most once, checked.
class CheckpointReader {
 public:
  static absl::StatusOr<std::unique_ptr<CheckpointReader>> Open(
      const std::string& dir, bool verify_whole_files,
      const std::function<absl::Status(const Manifest&)>& check_manifest = nullptr) {
    absl::StatusOr<internal::CheckpointFiles> files =
        internal::OpenCheckpointFiles(dir, verify_whole_files, check_manifest);
    if (!files.ok()) return files.status();
    std::unique_ptr<CheckpointReader> r(new CheckpointReader);
    r->files_ = *std::move(files);
    return r;
  }

  const Manifest& manifest() const { return files_.manifest; }

  // Reads [begin, begin + dst.numel()) of the flattened tensor `key` into `dst`.
  absl::Status Read(const std::string& key, int64_t begin, at::Tensor dst) {
    const int64_t end = begin + dst.numel();
    int64_t covered = 0;
    auto it = files_.index.find(key);
    for (const auto& [f, i] : it == files_.index.end() ? std::vector<std::pair<size_t, size_t>>()
                                                       : it->second) {
      const internal::RecordMeta& m = files_.files[f]->info().records[i];
      const int64_t lo = std::max(begin, m.begin);
      const int64_t hi = std::min(end, m.end);
      if (lo >= hi) continue;
      absl::StatusOr<at::ScalarType> dtype = DtypeFromName(m.dtype);
      const int64_t elem = dtype.ok() ? static_cast<int64_t>(c10::elementSize(*dtype)) : 0;
      if (!dtype.ok() || *dtype != dst.scalar_type() || m.nbytes != (m.end - m.begin) * elem) {
        return absl::DataLossError(absl::StrCat("checkpoint file '", files_.files[f]->path(),
                                                "': tensor '", key, "' has dtype ", m.dtype,
                                                " and ", m.nbytes, " bytes for elements [",
                                                m.begin, ", ", m.end, "), expected ",
                                                DtypeName(dst.scalar_type())));
      }
      auto cached = cache_.find({f, i});
      if (cached == cache_.end()) {
        absl::StatusOr<std::string> data = files_.files[f]->Read(i);
        if (!data.ok()) return data.status();
        cached = cache_.emplace(std::make_pair(f, i), *std::move(data)).first;
      }
      at::Tensor src = at::from_blob(cached->second.data(), {m.end - m.begin},
                                     at::TensorOptions().dtype(*dtype));
      dst.narrow(0, lo - begin, hi - lo).copy_(src.narrow(0, lo - m.begin, hi - lo));
      covered += hi - lo;
    }
    if (covered != end - begin) {
      return absl::DataLossError(absl::StrCat("tensor '", key, "' elements [", begin, ", ", end,
                                              ") are not all in the checkpoint files (",
                                              covered, " found)"));
    }
    return absl::OkStatus();
  }

 private:
  internal::CheckpointFiles files_;
  std::map<std::pair<size_t, size_t>, std::string> cache_;
};

// kInvalidArgument unless the model's parameters and buffers are the manifest's.
absl::Status CheckModel(const ModelLayout& layout, const Manifest& m, const std::string& where) {
  std::map<std::string, const Manifest::Tensor*> saved;
  for (const auto& t : m.params) saved["parameter '" + t.name + "'"] = &t;
  for (const auto& t : m.buffers) saved["buffer '" + t.name + "'"] = &t;
  std::set<std::string> here;
  auto check = [&](const std::string& what, at::IntArrayRef shape,
                   at::ScalarType dtype) -> absl::Status {
    here.insert(what);
    auto it = saved.find(what);
    if (it == saved.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the model's ", what, " is not in the checkpoint (", where, ")"));
    }
    if (at::IntArrayRef(it->second->shape) != shape || it->second->dtype != DtypeName(dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " is ", it->second->dtype, " ", ShapeString(it->second->shape),
          " in the checkpoint (", where, ") but ", DtypeName(dtype), " ", ShapeString(shape),
          " in the model"));
    }
    return absl::OkStatus();
  };
  for (const std::string& n : layout.param_names) {
    absl::Status s = check("parameter '" + n + "'", layout.entry(n).shape, layout.dtype(n));
    if (!s.ok()) return s;
  }
  for (const auto& [n, b] : layout.buffers) {
    absl::Status s = check("buffer '" + n + "'", b.sizes(), b.scalar_type());
    if (!s.ok()) return s;
  }
  for (const auto& [what, t] : saved) {
    if (!here.count(what)) {
      return absl::InvalidArgumentError(
          absl::StrCat("the checkpoint's ", what, " (", where, ") is not in the model"));
    }
  }
  return absl::OkStatus();
}

FullOptimState OptimMeta(const Manifest& m) {
  FullOptimState meta;
  meta.kind = m.optimizer_kind;
  for (const auto& g : m.param_groups) meta.param_groups.push_back({g.options, g.params});
  for (const auto& [name, p] : m.optimizer_state) {
    auto& ps = meta.state[name];
    ps.step = p.step;
    for (const std::string& t : p.tensors) ps.tensors[t] = at::Tensor();
  }
  return meta;
}

}  // namespace

namespace internal {

// Builds snapshots (the one walk over what a rank file holds, in file order) and reads their
// manifest drafts.
struct SnapshotAccess {
  // This rank's records of `layout` (and, on rank 0, the manifest draft). copy: into host
  // tensors of their own (reusing `reuse`'s by index where dtype and size match); otherwise the
  // values are the pieces as the writer takes them (views of CPU shards, for a synchronous save).
  static ShardedCheckpointSnapshot Take(const ModelLayout& layout,
                                        const torch::optim::Optimizer* optimizer,
                                        const FullOptimState& groups, bool copy,
                                        ShardedCheckpointSnapshot* reuse) {
    c10::NoGradGuard no_grad;
    std::vector<ShardedCheckpointSnapshot::Record> old;
    if (reuse != nullptr) {
      old = std::move(reuse->records_);
      *reuse = ShardedCheckpointSnapshot();
    }
    ShardedCheckpointSnapshot snap;
    snap.rank_ = layout.rank;
    snap.world_size_ = layout.world;
    auto add = [&](std::string key, std::vector<int64_t> shape, int64_t begin,
                   const at::Tensor& src) {
      ShardedCheckpointSnapshot::Record r{std::move(key), std::move(shape), begin,
                                          begin + src.numel(), at::Tensor()};
      if (!copy) {
        r.value = src.detach().to(at::kCPU).contiguous().view({-1});
      } else {
        const size_t i = snap.records_.size();
        if (i < old.size() && old[i].value.defined() &&
            old[i].value.scalar_type() == src.scalar_type() &&
            old[i].value.numel() == src.numel()) {
          r.value = std::move(old[i].value);
        } else {
          r.value = at::empty({src.numel()}, at::TensorOptions().dtype(src.scalar_type()));
        }
        r.value.view(src.sizes()).copy_(src.detach());
      }
      snap.records_.push_back(std::move(r));
    };
    Manifest manifest;
    manifest.world_size = layout.world;
    // The part of flat `flat` this rank owns (see ForEachOwnedPiece) that `shard` (this rank's
    // shard, or the whole unsharded flat) holds, as ranges of its original tensors (those `keep`
    // accepts).
    auto add_ranges = [&](const FlatRef& flat, const at::Tensor& shard, const std::string& prefix,
                          const std::string& suffix, const std::function<bool(size_t)>& keep) {
      ForEachOwnedPiece(flat, layout.rank, layout.world,
                        [&](size_t i, int64_t entry_begin, int64_t pos, int64_t length) {
                          if (!keep(i)) return;
                          add(prefix + flat.info.params[i].name + suffix,
                              flat.info.params[i].shape, entry_begin,
                              shard.narrow(0, pos, length));
                        });
    };
    for (const FlatRef& flat : layout.flats) {
      add_ranges(flat, flat.shard, "p/", "", [](size_t) { return true; });
      if (optimizer == nullptr) continue;
      const FlatOptimState ps = GetFlatOptimState(flat, *optimizer);
      for (const auto& [tname, t] : ps.tensors) {
        add_ranges(flat, t, "o/", "/" + tname,
                   [&ps, &tname = tname](size_t e) { return ps.names[e].count(tname) > 0; });
      }
      for (size_t e = 0; e < flat.info.params.size(); ++e) {
        if (!ps.has[e]) continue;
        auto& saved = manifest.optimizer_state[flat.info.params[e].name];
        saved.step = ps.step[e];
        for (const std::string& tname : ps.names[e]) saved.tensors.push_back(tname);
      }
    }
    if (layout.rank != 0) return snap;
    for (const auto& [name, b] : layout.buffers) add("b/" + name, b.sizes().vec(), 0, b);

    for (const FlatRef& flat : layout.flats) {
      if (std::find(manifest.units.begin(), manifest.units.end(), flat.unit->prefix()) ==
          manifest.units.end()) {
        manifest.units.push_back(flat.unit->prefix());
      }
    }
    for (const std::string& n : layout.param_names) {
      const auto& e = layout.entry(n);
      manifest.params.push_back(
          {n, e.shape, DtypeName(layout.dtype(n)), e.name == n ? std::string() : e.name});
    }
    for (const auto& [n, b] : layout.buffers) {
      manifest.buffers.push_back({n, b.sizes().vec(), DtypeName(b.scalar_type()), ""});
    }
    manifest.has_optimizer = optimizer != nullptr;
    manifest.optimizer_kind = groups.kind;
    for (const auto& g : groups.param_groups) manifest.param_groups.push_back({g.options, g.params});
    snap.manifest_ = std::make_unique<Manifest>(std::move(manifest));
    return snap;
  }

  static const Manifest* manifest(const ShardedCheckpointSnapshot& snap) {
    return snap.manifest_.get();
  }
};

}  // namespace internal

ShardedCheckpointSnapshot::ShardedCheckpointSnapshot() = default;
ShardedCheckpointSnapshot::~ShardedCheckpointSnapshot() = default;
ShardedCheckpointSnapshot::ShardedCheckpointSnapshot(ShardedCheckpointSnapshot&&) noexcept =
    default;
ShardedCheckpointSnapshot& ShardedCheckpointSnapshot::operator=(
    ShardedCheckpointSnapshot&&) noexcept = default;

int64_t ShardedCheckpointSnapshot::bytes() const {
  int64_t n = 0;
  for (const Record& r : records_) n += static_cast<int64_t>(r.value.nbytes());
  return n;
}

absl::StatusOr<ShardFileSummary> ShardedCheckpointSnapshot::write(const std::string& dir) const {
  if (world_size_ == 0) {
    return absl::FailedPreconditionError("write of an empty sharded checkpoint snapshot");
  }
  const std::string name = internal::RankFileName(rank_);
  const std::string path = Join(dir, name);
  try {
    // Only host memory and the file system from here: no LibTorch operator, no communicator.
    auto writer = internal::ShardFileWriter::Open(path, rank_, world_size_);
    if (!writer.ok()) return writer.status();
    for (const Record& r : records_) {
      absl::Status s = (*writer)->Add(r.key, DtypeName(r.value.scalar_type()), r.shape, r.begin,
                                      r.end, r.value.data_ptr(),
                                      static_cast<int64_t>(r.value.nbytes()));
      if (!s.ok()) return s;
    }
    auto summary = (*writer)->Finish();
    if (!summary.ok()) return summary.status();
    return ShardFileSummary{name, summary->bytes, summary->fnv1a, summary->header_fnv1a};
  } catch (const std::exception& e) {  // allocation, JSON: the contract is a Status
    return absl::InternalError(absl::StrCat("writing '", path, "': ", e.what()));
  }
}

ShardedCheckpointSnapshot snapshot_sharded_checkpoint(FullyShardedDataParallel& model,
                                                      const torch::optim::Optimizer* optimizer,
                                                      ShardedCheckpointSnapshot* reuse) {
  const std::string what = absl::StrCat("snapshot_sharded_checkpoint rank ", model->rank(), "/",
                                        model->world_size());
  ModelLayout layout = internal::GetModelLayout(model);
  FullOptimState groups;
  if (optimizer != nullptr) {
    groups = base::ValueOrThrow(internal::OptimGroups(layout, *optimizer), what);
  }
  return internal::SnapshotAccess::Take(layout, optimizer, groups, /*copy=*/true, reuse);
}

absl::Status write_sharded_manifest(const ShardedCheckpointSnapshot& rank0,
                                    const std::vector<ShardFileSummary>& summaries,
                                    const std::string& dir) {
  const Manifest* draft = internal::SnapshotAccess::manifest(rank0);
  if (draft == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "write_sharded_manifest needs rank 0's snapshot, got ",
        rank0.world_size() == 0 ? std::string("an empty one")
                                : absl::StrCat("rank ", rank0.rank(), "'s")));
  }
  if (static_cast<int>(summaries.size()) != rank0.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("write_sharded_manifest: ", summaries.size(),
                     " file summaries for world size ", rank0.world_size()));
  }
  for (size_t r = 0; r < summaries.size(); ++r) {
    if (summaries[r].name != internal::RankFileName(static_cast<int>(r))) {
      return absl::InvalidArgumentError(
          absl::StrCat("write_sharded_manifest: summaries[", r, "] is of '", summaries[r].name,
                       "', rank ", r, "'s file is '", internal::RankFileName(static_cast<int>(r)),
                       "'"));
    }
  }
  try {
    Manifest manifest = *draft;
    for (const ShardFileSummary& f : summaries) {
      manifest.files.push_back({f.name, f.bytes, f.fnv1a, f.header_fnv1a});
    }
    return base::WriteFileAtomic(Join(dir, internal::kManifestName),
                                 internal::ManifestToJson(manifest));
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat("writing '", Join(dir, internal::kManifestName), "': ", e.what()));
  }
}

void save_sharded_checkpoint(FullyShardedDataParallel& model,
                             const torch::optim::Optimizer* optimizer, const std::string& dir) {
  const std::string what = absl::StrCat("save_sharded_checkpoint('", dir, "') rank ",
                                        model->rank(), "/", model->world_size());
  const auto& comm = model->communicator();
  ModelLayout layout = internal::GetModelLayout(model);
  FullOptimState groups;
  if (optimizer != nullptr) {
    auto g = internal::OptimGroups(layout, *optimizer);
    base::ThrowIfError(g.status(), what);
    groups = *std::move(g);
  }
  // A manifest from an earlier save in this directory must not vouch for files being replaced.
  const std::string manifest_path = Join(dir, internal::kManifestName);
  absl::Status status;
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    status = absl::DataLossError(
        absl::StrCat("cannot create directory '", dir, "': ", std::strerror(errno)));
  }
  if (layout.rank == 0 && status.ok() && std::remove(manifest_path.c_str()) != 0 &&
      errno != ENOENT) {
    status = absl::DataLossError(
        absl::StrCat("cannot remove the old '", manifest_path, "': ", std::strerror(errno)));
  }
  internal::ThrowIfAnyFailed(comm, status, what);

  // The phases of an asynchronous save, run in place: nothing changes the model meanwhile, so the
  // snapshot takes the pieces as they are (no host copy of CPU tensors).
  const ShardedCheckpointSnapshot snap =
      internal::SnapshotAccess::Take(layout, optimizer, groups, /*copy=*/false, nullptr);
  absl::StatusOr<ShardFileSummary> summary = snap.write(dir);
  internal::ThrowIfAnyFailed(comm, summary.status(), what);

  // Rank 0 learns every file's size and checksums, then writes the manifest last.
  const int64_t mine[3] = {summary->bytes, static_cast<int64_t>(summary->fnv1a),
                           static_cast<int64_t>(summary->header_fnv1a)};
  std::vector<int64_t> all(3 * layout.world);
  base::ThrowIfError(
      comm->AllGather(comm::MakeConstBuffer(mine, 3), comm::MakeBuffer(all.data(), all.size()))
          .Wait(),
      what + ": all_gather of the file checksums");
  if (layout.rank == 0) {
    std::vector<ShardFileSummary> summaries;
    for (int r = 0; r < layout.world; ++r) {
      summaries.push_back({internal::RankFileName(r), all[3 * r],
                           static_cast<uint64_t>(all[3 * r + 1]),
                           static_cast<uint64_t>(all[3 * r + 2])});
    }
    status = write_sharded_manifest(snap, summaries, dir);
  }
  internal::ThrowIfAnyFailed(comm, status, what);
}

std::function<void()> stage_sharded_checkpoint(FullyShardedDataParallel& model,
                                               torch::optim::Optimizer* optimizer,
                                               const std::string& dir) {
  const std::string what = absl::StrCat("load_sharded_checkpoint('", dir, "') rank ",
                                        model->rank(), "/", model->world_size());
  ModelLayout layout = internal::GetModelLayout(model);
  LocalStateDict staged_model;
  internal::StagedOptim staged_optim;
  // Everything is read and checked before anything changes.
  auto stage = [&]() -> absl::Status {
    const std::string manifest_path = Join(dir, internal::kManifestName);
    // The model against the manifest first: a wrong model is named as such.
    auto reader = CheckpointReader::Open(
        dir, /*verify_whole_files=*/false, [&](const Manifest& m) -> absl::Status {
          absl::Status s = CheckModel(layout, m, manifest_path);
          if (!s.ok()) return s;
          if (optimizer != nullptr && !m.has_optimizer) {
            return absl::InvalidArgumentError(absl::StrCat(
                "the checkpoint was saved without optimizer state (", manifest_path, ")"));
          }
          return absl::OkStatus();
        });
    if (!reader.ok()) return reader.status();
    CheckpointReader& r = **reader;
    auto read = [&r](const std::string& prefix) -> internal::RangeReader {
      return [&r, prefix](const std::string& key, int64_t begin, at::Tensor dst) {
        return r.Read(prefix + key, begin, dst);
      };
    };
    c10::NoGradGuard no_grad;
    auto shards = internal::StageShards(layout, read("p/"), read("b/"));
    if (!shards.ok()) return shards.status();
    staged_model = *std::move(shards);
    if (optimizer != nullptr) {
      auto opt = internal::StageOptim(layout, *optimizer, OptimMeta(r.manifest()), read("o/"));
      if (!opt.ok()) {
        return absl::Status(opt.status().code(), absl::StrCat(opt.status().message(), " (",
                                                              manifest_path, ")"));
      }
      staged_optim = *std::move(opt);
    }
    return absl::OkStatus();
  };
  absl::Status status;
  try {
    status = stage();
  } catch (const c10::Error& e) {  // still agree with the other ranks, which may be waiting
    status = absl::InternalError(e.what_without_backtrace());
  }
  internal::ThrowIfAnyFailed(model->communicator(), status, what);
  auto staged = std::make_shared<std::pair<LocalStateDict, internal::StagedOptim>>(
      std::move(staged_model), std::move(staged_optim));
  return [model, optimizer, staged]() mutable {
    model->load_local_state_dict(staged->first);
    if (optimizer != nullptr) internal::ApplyOptim(*optimizer, std::move(staged->second));
  };
}

void load_sharded_checkpoint(FullyShardedDataParallel& model, torch::optim::Optimizer* optimizer,
                             const std::string& dir) {
  stage_sharded_checkpoint(model, optimizer, dir)();
}

absl::StatusOr<ConsolidatedCheckpoint> consolidate_sharded_checkpoint(const std::string& dir) {
  auto reader = CheckpointReader::Open(dir, /*verify_whole_files=*/true);
  if (!reader.ok()) return reader.status();
  CheckpointReader& r = **reader;
  const Manifest& m = r.manifest();
  ConsolidatedCheckpoint out;
  out.world_size = m.world_size;
  auto full = [&](const std::string& key, const std::vector<int64_t>& shape,
                  const std::string& dtype_name) -> absl::StatusOr<at::Tensor> {
    absl::StatusOr<at::ScalarType> dtype = DtypeFromName(dtype_name);
    if (!dtype.ok()) return dtype.status();
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(*dtype));
    absl::Status s = r.Read(key, 0, t.view({-1}));
    if (!s.ok()) return s;
    return t;
  };
  std::map<std::string, const Manifest::Tensor*> params;
  for (const Manifest::Tensor& p : m.params) params[p.name] = &p;
  for (const Manifest::Tensor& p : m.params) {
    if (!p.alias_of.empty()) {
      const at::Tensor* primary = out.state_dict.find(p.alias_of);
      if (primary == nullptr) {
        return absl::DataLossError(absl::StrCat("parameter '", p.name, "' is tied to '",
                                                p.alias_of, "', which comes later or not at all"));
      }
      out.state_dict.insert(p.name, *primary);
      continue;
    }
    absl::StatusOr<at::Tensor> t = full("p/" + p.name, p.shape, p.dtype);
    if (!t.ok()) return t.status();
    out.state_dict.insert(p.name, *std::move(t));
  }
  for (const Manifest::Tensor& b : m.buffers) {
    absl::StatusOr<at::Tensor> t = full("b/" + b.name, b.shape, b.dtype);
    if (!t.ok()) return t.status();
    out.state_dict.insert(b.name, *std::move(t));
  }
  out.has_optimizer = m.has_optimizer;
  if (m.has_optimizer) {
    out.optimizer = OptimMeta(m);
    for (auto& [name, ps] : out.optimizer.state) {
      auto p = params.find(name);
      if (p == params.end()) {
        return absl::DataLossError(
            absl::StrCat("optimizer state of '", name, "', which is not a parameter"));
      }
      for (auto& [tname, t] : ps.tensors) {
        absl::StatusOr<at::Tensor> v =
            full(absl::StrCat("o/", name, "/", tname), p->second->shape, p->second->dtype);
        if (!v.ok()) return v.status();
        t = *std::move(v);
      }
    }
  }
  return out;
}

}  // namespace fairscale::fsdp
