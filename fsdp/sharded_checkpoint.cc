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
#include <functional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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

absl::StatusOr<at::ScalarType> DtypeFromName(const std::string& name) {
  for (at::ScalarType t : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    if (name == c10::toString(t)) return t;
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
  c10::NoGradGuard no_grad;
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

  Manifest manifest;
  manifest.world_size = layout.world;
  internal::ShardFileWriter::Summary summary;
  {
    auto writer = internal::ShardFileWriter::Open(Join(dir, internal::RankFileName(layout.rank)),
                                                  layout.rank, layout.world);
    status = writer.status();
    // Writes the part [lo, hi) of flat `f` that `shard` (this rank's, or the whole unsharded
    // flat) holds, as ranges of its original tensors.
    // Writes the part of flat `flat` this rank owns (see ForEachOwnedPiece) that `shard` (this
    // rank's shard, or the whole unsharded flat) holds, as ranges of its original tensors
    // (those `keep` accepts).
    auto add_ranges = [&](const internal::FlatRef& flat, const at::Tensor& shard,
                          const std::string& prefix, const std::string& suffix,
                          const std::function<bool(size_t)>& keep) {
      internal::ForEachOwnedPiece(
          flat, layout.rank, layout.world,
          [&](size_t i, int64_t entry_begin, int64_t pos, int64_t length) {
            if (!status.ok() || !keep(i)) return;
            at::Tensor t = shard.narrow(0, pos, length).detach().to(at::kCPU).contiguous();
            status = (*writer)->Add(prefix + flat.info.params[i].name + suffix,
                                    DtypeName(t.scalar_type()), flat.info.params[i].shape,
                                    entry_begin, entry_begin + length, t.data_ptr(), t.nbytes());
          });
    };
    for (const internal::FlatRef& flat : layout.flats) {
      if (!status.ok()) break;
      add_ranges(flat, flat.shard, "p/", "", [](size_t) { return true; });
      if (optimizer == nullptr) continue;
      const internal::FlatOptimState ps = internal::GetFlatOptimState(flat, *optimizer);
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
    if (layout.rank == 0) {
      for (const auto& [name, b] : layout.buffers) {
        if (!status.ok()) break;
        at::Tensor t = b.detach().to(at::kCPU).contiguous();
        status = (*writer)->Add("b/" + name, DtypeName(t.scalar_type()), t.sizes().vec(), 0,
                                t.numel(), t.data_ptr(), t.nbytes());
      }
    }
    if (status.ok()) {
      auto s = (*writer)->Finish();
      status = s.status();
      if (s.ok()) summary = *s;
    }
  }
  internal::ThrowIfAnyFailed(comm, status, what);

  // Rank 0 learns every file's size and checksums, then writes the manifest last.
  const int64_t mine[3] = {summary.bytes, static_cast<int64_t>(summary.fnv1a),
                           static_cast<int64_t>(summary.header_fnv1a)};
  std::vector<int64_t> all(3 * layout.world);
  base::ThrowIfError(
      comm->AllGather(comm::MakeConstBuffer(mine, 3), comm::MakeBuffer(all.data(), all.size()))
          .Wait(),
      what + ": all_gather of the file checksums");
  if (layout.rank == 0) {
    for (const internal::FlatRef& flat : layout.flats) {
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
    for (int r = 0; r < layout.world; ++r) {
      manifest.files.push_back({internal::RankFileName(r), all[3 * r],
                                static_cast<uint64_t>(all[3 * r + 1]),
                                static_cast<uint64_t>(all[3 * r + 2])});
    }
    status = internal::WriteFileAtomically(manifest_path, internal::ManifestToJson(manifest));
  }
  internal::ThrowIfAnyFailed(comm, status, what);
}

void load_sharded_checkpoint(FullyShardedDataParallel& model, torch::optim::Optimizer* optimizer,
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
  model->load_local_state_dict(staged_model);
  if (optimizer != nullptr) internal::ApplyOptim(*optimizer, std::move(staged_optim));
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
