#include "fsdp/internal/shard_file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/escaping.h"
#include "base/atomic_file.h"
#include "base/fnv1a.h"
#include "base/json_fields.h"
#include "base/status_macros.h"

namespace fairscale::fsdp::internal {
namespace {

constexpr char kMagic[8] = {'F', 'S', 'D', 'P', 'S', 'H', 'D', '1'};
constexpr int64_t kFooterBytes = 8 + 8 + 8;  // header length, header FNV-1a, magic
constexpr const char* kManifestFormat = "fairscale.fsdp.sharded_checkpoint.v1";
constexpr int64_t kMaxWorld = int64_t{1} << 20;  // ranks a checkpoint may have

std::string Errno() { return std::strerror(errno); }

std::string Hex(uint64_t v) { return absl::StrFormat("%016x", v); }

std::string JoinPath(const std::string& dir, const std::string& name) {
  return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

// A file the manifest lists, read whole: a missing one is a broken checkpoint (kDataLoss, as
// every error of OpenCheckpointFiles), not a kNotFound.
absl::StatusOr<std::string> ReadCheckpointFile(const std::string& path) {
  absl::StatusOr<std::string> bytes = base::ReadFile(path);
  if (absl::IsNotFound(bytes.status())) return absl::DataLossError(bytes.status().message());
  return bytes;
}

}  // namespace

std::string RankFileName(int rank) { return absl::StrFormat("rank%05d.shard", rank); }

// ---- writer --------------------------------------------------------------------------------

ShardFileWriter::ShardFileWriter(base::AtomicFileWriter file, int rank, int world_size)
    : file_(std::move(file)), fnv_(base::kFnv1a64Basis) {
  info_.rank = rank;
  info_.world_size = world_size;
}

ShardFileWriter::~ShardFileWriter() = default;

absl::StatusOr<std::unique_ptr<ShardFileWriter>> ShardFileWriter::Open(const std::string& path,
                                                                       int rank, int world_size) {
  FS_ASSIGN_OR_RETURN(base::AtomicFileWriter file, base::AtomicFileWriter::Open(path));
  std::unique_ptr<ShardFileWriter> w(new ShardFileWriter(std::move(file), rank, world_size));
  FS_RETURN_IF_ERROR(w->Write(kMagic, sizeof(kMagic)));
  return w;
}

absl::Status ShardFileWriter::Write(const void* data, size_t n) {
  FS_RETURN_IF_ERROR(file_.Append(absl::string_view(static_cast<const char*>(data), n)));
  fnv_ = base::Fnv1a64(data, n, fnv_);
  return absl::OkStatus();
}

absl::Status ShardFileWriter::Add(const std::string& key, const std::string& dtype,
                                  const std::vector<int64_t>& shape, int64_t begin, int64_t end,
                                  const void* data, int64_t nbytes) {
  RecordMeta r;
  r.key = key;
  r.dtype = dtype;
  r.shape = shape;
  r.begin = begin;
  r.end = end;
  r.offset = file_.bytes_written();
  r.nbytes = nbytes;
  r.fnv1a = base::Fnv1a64(data, static_cast<size_t>(nbytes));
  info_.records.push_back(r);
  return Write(data, static_cast<size_t>(nbytes));
}

absl::StatusOr<ShardFileWriter::Summary> ShardFileWriter::Finish() {
  nlohmann::json records = nlohmann::json::array();
  for (const RecordMeta& r : info_.records) {
    records.push_back({{"key", r.key},
                       {"dtype", r.dtype},
                       {"shape", r.shape},
                       {"begin", r.begin},
                       {"end", r.end},
                       {"offset", r.offset},
                       {"nbytes", r.nbytes},
                       {"fnv1a", Hex(r.fnv1a)}});
  }
  const std::string header =
      nlohmann::json{{"rank", info_.rank}, {"world_size", info_.world_size}, {"records", records}}
          .dump();
  Summary summary;
  summary.header_fnv1a = base::Fnv1a64(header.data(), header.size());
  const uint64_t len = header.size();
  absl::Status s = Write(header.data(), header.size());
  if (s.ok()) s = Write(&len, sizeof(len));
  if (s.ok()) s = Write(&summary.header_fnv1a, sizeof(summary.header_fnv1a));
  if (s.ok()) s = Write(kMagic, sizeof(kMagic));
  if (!s.ok()) return s;
  FS_RETURN_IF_ERROR(file_.Commit());
  summary.bytes = file_.bytes_written();
  summary.fnv1a = fnv_;
  return summary;
}

// ---- reader --------------------------------------------------------------------------------

ShardFileReader::~ShardFileReader() {
  if (file_ != nullptr) std::fclose(file_);
}

absl::StatusOr<std::unique_ptr<ShardFileReader>> ShardFileReader::Open(const std::string& path,
                                                                       int64_t bytes,
                                                                       uint64_t header_fnv1a) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    return absl::DataLossError(
        absl::StrCat("checkpoint file '", path, "' cannot be opened: ", Errno()));
  }
  std::unique_ptr<ShardFileReader> r(new ShardFileReader(path, f));
  struct stat st;
  if (::fstat(::fileno(f), &st) != 0 || st.st_size != bytes) {
    return absl::DataLossError(absl::StrCat("checkpoint file '", path, "' has ",
                                            static_cast<int64_t>(st.st_size),
                                            " bytes, the manifest says ", bytes,
                                            " (truncated or replaced)"));
  }
  // The leading magic first: a file of another kind (or overwritten from its start) is named as
  // such, before its footer is trusted for anything.
  char head[sizeof(kMagic)];
  if (bytes < static_cast<int64_t>(sizeof(kMagic)) || ::fseeko(f, 0, SEEK_SET) != 0 ||
      std::fread(head, 1, sizeof(head), f) != sizeof(head) ||
      std::memcmp(head, kMagic, sizeof(kMagic)) != 0) {
    return absl::DataLossError(absl::StrCat(
        "checkpoint file '", path, "': its first 8 bytes are not the magic \"",
        absl::string_view(kMagic, sizeof(kMagic)), "\" (not a shard file, or overwritten)"));
  }
  char footer[kFooterBytes];
  uint64_t len = 0, fnv = 0;
  if (bytes < kFooterBytes + 8 || ::fseeko(f, bytes - kFooterBytes, SEEK_SET) != 0 ||
      std::fread(footer, 1, kFooterBytes, f) != kFooterBytes ||
      std::memcmp(footer + 16, kMagic, 8) != 0) {
    return absl::DataLossError(absl::StrCat("checkpoint file '", path, "' has no valid footer"));
  }
  std::memcpy(&len, footer, 8);
  std::memcpy(&fnv, footer + 8, 8);
  if (fnv != header_fnv1a || len > static_cast<uint64_t>(bytes - kFooterBytes - 8)) {
    return absl::DataLossError(absl::StrCat("checkpoint file '", path,
                                            "': header checksum does not match the manifest"));
  }
  std::string header(len, '\0');
  if (::fseeko(f, bytes - kFooterBytes - static_cast<int64_t>(len), SEEK_SET) != 0 ||
      std::fread(header.data(), 1, len, f) != len ||
      base::Fnv1a64(header.data(), header.size()) != fnv) {
    return absl::DataLossError(absl::StrCat("checkpoint file '", path, "': corrupt header"));
  }
  const nlohmann::json j = nlohmann::json::parse(header, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return absl::DataLossError(
        absl::StrCat("checkpoint file '", path, "': its header is not valid JSON"));
  }
  const base::JsonFields fields(absl::StrCat("checkpoint file '", path, "': header field "));
  FS_ASSIGN_OR_RETURN(const nlohmann::json* rank, fields.Need(j, "rank", "rank"));
  FS_ASSIGN_OR_RETURN(const nlohmann::json* world, fields.Need(j, "world_size", "world_size"));
  FS_ASSIGN_OR_RETURN(const int64_t world_size, fields.Int(*world, "world_size", 1, kMaxWorld));
  FS_ASSIGN_OR_RETURN(const int64_t rank_value, fields.Int(*rank, "rank", 0, world_size - 1));
  r->info_.rank = static_cast<int>(rank_value);
  r->info_.world_size = static_cast<int>(world_size);
  FS_ASSIGN_OR_RETURN(const nlohmann::json* records, fields.Need(j, "records", "records"));
  FS_RETURN_IF_ERROR(fields.Array(*records, "records"));
  // Records lie after the leading magic and before the header.
  const int64_t data_begin = sizeof(kMagic);
  const int64_t data_end = bytes - kFooterBytes - static_cast<int64_t>(len);
  for (size_t i = 0; i < records->size(); ++i) {
    const nlohmann::json& rec = (*records)[i];
    const std::string field = absl::StrCat("records[", i, "]");
    auto need = [&](const char* key) { return fields.Need(rec, key, field + "." + key); };
    RecordMeta m;
    int64_t numel = 0;
    FS_ASSIGN_OR_RETURN(const nlohmann::json* key, need("key"));
    FS_ASSIGN_OR_RETURN(m.key, fields.String(*key, field + ".key"));
    FS_ASSIGN_OR_RETURN(const nlohmann::json* dtype, need("dtype"));
    FS_ASSIGN_OR_RETURN(m.dtype, fields.String(*dtype, field + ".dtype"));
    FS_ASSIGN_OR_RETURN(const nlohmann::json* shape, need("shape"));
    FS_ASSIGN_OR_RETURN(m.shape, fields.Shape(*shape, field + ".shape", &numel));
    FS_ASSIGN_OR_RETURN(const nlohmann::json* begin, need("begin"));
    FS_ASSIGN_OR_RETURN(m.begin, fields.Int(*begin, field + ".begin", 0, numel));
    FS_ASSIGN_OR_RETURN(const nlohmann::json* end, need("end"));
    FS_ASSIGN_OR_RETURN(m.end, fields.Int(*end, field + ".end", m.begin, numel));
    FS_ASSIGN_OR_RETURN(const nlohmann::json* offset, need("offset"));
    FS_ASSIGN_OR_RETURN(m.offset, fields.Int(*offset, field + ".offset", data_begin, data_end));
    FS_ASSIGN_OR_RETURN(const nlohmann::json* nbytes, need("nbytes"));
    FS_ASSIGN_OR_RETURN(m.nbytes, fields.Int(*nbytes, field + ".nbytes", 0, data_end - m.offset));
    FS_ASSIGN_OR_RETURN(const nlohmann::json* fnv, need("fnv1a"));
    FS_ASSIGN_OR_RETURN(m.fnv1a, fields.Hex64(*fnv, field + ".fnv1a"));
    r->info_.records.push_back(std::move(m));
  }
  return r;
}

absl::StatusOr<std::string> ShardFileReader::Read(size_t i) {
  const RecordMeta& m = info_.records.at(i);
  std::string data(static_cast<size_t>(m.nbytes), '\0');
  if (::fseeko(file_, m.offset, SEEK_SET) != 0 ||
      std::fread(data.data(), 1, data.size(), file_) != data.size()) {
    return absl::DataLossError(
        absl::StrCat("checkpoint file '", path_, "': cannot read tensor '", m.key, "'"));
  }
  if (base::Fnv1a64(data.data(), data.size()) != m.fnv1a) {
    return absl::DataLossError(absl::StrCat("checkpoint file '", path_, "': tensor '", m.key,
                                            "' elements [", m.begin, ", ", m.end,
                                            ") fail their checksum (corrupt file)"));
  }
  return data;
}

// ---- manifest ------------------------------------------------------------------------------

namespace {

nlohmann::json TensorsJson(const std::vector<Manifest::Tensor>& tensors) {
  nlohmann::json out = nlohmann::json::array();
  for (const Manifest::Tensor& t : tensors) {
    nlohmann::json j = {{"name", t.name}, {"shape", t.shape}, {"dtype", t.dtype}};
    if (!t.alias_of.empty()) j["alias_of"] = t.alias_of;
    out.push_back(std::move(j));
  }
  return out;
}

}  // namespace

std::string ManifestToJson(const Manifest& m) {
  nlohmann::json files = nlohmann::json::array();
  for (const Manifest::File& f : m.files) {
    files.push_back({{"name", f.name},
                     {"bytes", f.bytes},
                     {"fnv1a", Hex(f.fnv1a)},
                     {"header_fnv1a", Hex(f.header_fnv1a)}});
  }
  nlohmann::json j = {{"format", kManifestFormat},   {"world_size", m.world_size},
                      {"units", m.units},            {"params", TensorsJson(m.params)},
                      {"buffers", TensorsJson(m.buffers)}, {"files", files}};
  if (m.has_optimizer) {
    nlohmann::json groups = nlohmann::json::array();
    for (const auto& g : m.param_groups) {
      groups.push_back({{"options", g.options}, {"params", g.params}});
    }
    nlohmann::json state = nlohmann::json::object();
    for (const auto& [name, p] : m.optimizer_state) {
      state[name] = {{"step", p.step}, {"tensors", p.tensors}};
    }
    j["optimizer"] = {{"kind", m.optimizer_kind}, {"param_groups", groups}, {"state", state}};
  }
  return j.dump(1);
}

absl::StatusOr<Manifest> ManifestFromJson(absl::string_view json, const std::string& path) {
  const nlohmann::json j =
      nlohmann::json::parse(json.begin(), json.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return absl::DataLossError(absl::StrCat("manifest '", path, "' is not valid JSON"));
  }
  const base::JsonFields f(absl::StrCat("manifest '", path, "': "));
  Manifest m;
  FS_ASSIGN_OR_RETURN(const nlohmann::json* format, f.Need(j, "format", "format"));
  FS_ASSIGN_OR_RETURN(const std::string format_name, f.String(*format, "format"));
  if (format_name != kManifestFormat) {
    return f.Error("format", absl::StrCat("is '", absl::CEscape(format_name), "', expected '",
                                          kManifestFormat, "'"));
  }
  FS_ASSIGN_OR_RETURN(const nlohmann::json* world, f.Need(j, "world_size", "world_size"));
  FS_ASSIGN_OR_RETURN(const int64_t world_size, f.Int(*world, "world_size", 1, kMaxWorld));
  m.world_size = static_cast<int>(world_size);
  FS_ASSIGN_OR_RETURN(const nlohmann::json* units, f.Need(j, "units", "units"));
  FS_ASSIGN_OR_RETURN(m.units, f.Strings(*units, "units"));

  // Parameters, then buffers: unique names, shapes, checkpoint dtypes; a tied parameter names an
  // earlier untied one.
  std::set<std::string> untied;
  for (const char* kind : {"params", "buffers"}) {
    std::vector<Manifest::Tensor>& out = kind[0] == 'p' ? m.params : m.buffers;
    std::set<std::string> names;
    FS_ASSIGN_OR_RETURN(const nlohmann::json* list, f.Need(j, kind, kind));
    FS_RETURN_IF_ERROR(f.Array(*list, kind));
    for (size_t i = 0; i < list->size(); ++i) {
      const nlohmann::json& t = (*list)[i];
      const std::string field = absl::StrCat(kind, "[", i, "]");
      Manifest::Tensor tensor;
      FS_ASSIGN_OR_RETURN(const nlohmann::json* name, f.Need(t, "name", field + ".name"));
      FS_ASSIGN_OR_RETURN(tensor.name, f.String(*name, field + ".name"));
      FS_ASSIGN_OR_RETURN(const nlohmann::json* shape, f.Need(t, "shape", field + ".shape"));
      FS_ASSIGN_OR_RETURN(tensor.shape, f.Shape(*shape, field + ".shape"));
      FS_ASSIGN_OR_RETURN(const nlohmann::json* dtype, f.Need(t, "dtype", field + ".dtype"));
      FS_ASSIGN_OR_RETURN(tensor.dtype, f.String(*dtype, field + ".dtype"));
      if (DtypeSize(tensor.dtype) == 0) {
        return f.Error(field + ".dtype", absl::StrCat("'", absl::CEscape(tensor.dtype),
                                                      "' is not a dtype a checkpoint holds"));
      }
      if (!names.insert(tensor.name).second) {
        return f.Error(field + ".name", absl::StrCat("'", absl::CEscape(tensor.name),
                                                     "' appears twice"));
      }
      if (t.contains("alias_of")) {
        if (kind[0] != 'p') return f.Error(field + ".alias_of", "a buffer cannot be tied");
        FS_ASSIGN_OR_RETURN(tensor.alias_of, f.String(t["alias_of"], field + ".alias_of"));
        if (untied.count(tensor.alias_of) == 0) {
          return f.Error(field + ".alias_of",
                         absl::StrCat("'", absl::CEscape(tensor.alias_of),
                                      "' is not an earlier untied parameter"));
        }
      } else if (kind[0] == 'p') {
        untied.insert(tensor.name);
      }
      out.push_back(std::move(tensor));
    }
  }

  // files[r] is rank r's, by the one name a save gives it: nothing outside the directory.
  FS_ASSIGN_OR_RETURN(const nlohmann::json* files, f.Need(j, "files", "files"));
  FS_RETURN_IF_ERROR(f.Array(*files, "files"));
  if (files->size() != static_cast<size_t>(m.world_size)) {
    return f.Error("files", absl::StrCat("lists ", files->size(), " files for world size ",
                                         m.world_size));
  }
  for (size_t r = 0; r < files->size(); ++r) {
    const nlohmann::json& e = (*files)[r];
    const std::string field = absl::StrCat("files[", r, "]");
    Manifest::File file;
    FS_ASSIGN_OR_RETURN(const nlohmann::json* name, f.Need(e, "name", field + ".name"));
    FS_ASSIGN_OR_RETURN(file.name, f.String(*name, field + ".name"));
    if (file.name != RankFileName(static_cast<int>(r))) {
      return f.Error(field + ".name", absl::StrCat("is '", absl::CEscape(file.name),
                                                   "', rank ", r, "'s file is '",
                                                   RankFileName(static_cast<int>(r)), "'"));
    }
    FS_ASSIGN_OR_RETURN(const nlohmann::json* bytes, f.Need(e, "bytes", field + ".bytes"));
    FS_ASSIGN_OR_RETURN(file.bytes, f.Int(*bytes, field + ".bytes", 0));
    FS_ASSIGN_OR_RETURN(const nlohmann::json* fnv, f.Need(e, "fnv1a", field + ".fnv1a"));
    FS_ASSIGN_OR_RETURN(file.fnv1a, f.Hex64(*fnv, field + ".fnv1a"));
    FS_ASSIGN_OR_RETURN(const nlohmann::json* hfnv,
                        f.Need(e, "header_fnv1a", field + ".header_fnv1a"));
    FS_ASSIGN_OR_RETURN(file.header_fnv1a, f.Hex64(*hfnv, field + ".header_fnv1a"));
    m.files.push_back(std::move(file));
  }

  if (j.contains("optimizer")) {
    const nlohmann::json& o = j["optimizer"];
    m.has_optimizer = true;
    FS_ASSIGN_OR_RETURN(const nlohmann::json* kind, f.Need(o, "kind", "optimizer.kind"));
    FS_ASSIGN_OR_RETURN(m.optimizer_kind, f.String(*kind, "optimizer.kind"));
    FS_ASSIGN_OR_RETURN(const nlohmann::json* groups,
                        f.Need(o, "param_groups", "optimizer.param_groups"));
    FS_RETURN_IF_ERROR(f.Array(*groups, "optimizer.param_groups"));
    for (size_t i = 0; i < groups->size(); ++i) {
      const nlohmann::json& g = (*groups)[i];
      const std::string field = absl::StrCat("optimizer.param_groups[", i, "]");
      Manifest::OptimGroup group;
      FS_ASSIGN_OR_RETURN(const nlohmann::json* options, f.Need(g, "options", field + ".options"));
      FS_RETURN_IF_ERROR(f.Object(*options, field + ".options"));
      for (const auto& [key, value] : options->items()) {
        FS_ASSIGN_OR_RETURN(group.options[key],
                            f.Number(value, absl::StrCat(field, ".options.", key)));
      }
      FS_ASSIGN_OR_RETURN(const nlohmann::json* params, f.Need(g, "params", field + ".params"));
      FS_ASSIGN_OR_RETURN(group.params, f.Strings(*params, field + ".params"));
      m.param_groups.push_back(std::move(group));
    }
    FS_ASSIGN_OR_RETURN(const nlohmann::json* state, f.Need(o, "state", "optimizer.state"));
    FS_RETURN_IF_ERROR(f.Object(*state, "optimizer.state"));
    for (const auto& [name, p] : state->items()) {
      const std::string field = absl::StrCat("optimizer.state.", name);
      Manifest::OptimParam param;
      FS_ASSIGN_OR_RETURN(const nlohmann::json* step, f.Need(p, "step", field + ".step"));
      FS_ASSIGN_OR_RETURN(param.step, f.Int(*step, field + ".step", 0));
      FS_ASSIGN_OR_RETURN(const nlohmann::json* tensors, f.Need(p, "tensors", field + ".tensors"));
      FS_ASSIGN_OR_RETURN(param.tensors, f.Strings(*tensors, field + ".tensors"));
      if (std::set<std::string>(param.tensors.begin(), param.tensors.end()).size() !=
          param.tensors.size()) {
        return f.Error(field + ".tensors", "names a tensor twice");
      }
      m.optimizer_state[name] = std::move(param);
    }
  }
  return m;
}

absl::StatusOr<CheckpointFiles> OpenCheckpointFiles(
    const std::string& dir, bool verify_whole_files,
    const std::function<absl::Status(const Manifest&)>& check_manifest) {
  CheckpointFiles c;
  c.manifest_path = JoinPath(dir, kManifestName);
  struct stat st;
  if (::stat(c.manifest_path.c_str(), &st) != 0) {
    return absl::DataLossError(absl::StrCat(
        "no manifest '", c.manifest_path,
        "': not a sharded checkpoint, or its save did not complete"));
  }
  FS_ASSIGN_OR_RETURN(const std::string json, ReadCheckpointFile(c.manifest_path));
  FS_ASSIGN_OR_RETURN(c.manifest, ManifestFromJson(json, c.manifest_path));
  const Manifest& m = c.manifest;
  if (check_manifest) FS_RETURN_IF_ERROR(check_manifest(m));

  // What each tensor key's records must be: its shape, its dtype ("" for optimizer state, which
  // may differ from its parameter's) and its number of elements.
  struct Expected {
    const std::vector<int64_t>* shape;
    std::string dtype;
    int64_t numel;
  };
  std::map<std::string, Expected> expected;
  auto numel_of = [](const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;  // ManifestFromJson checked it fits
    return n;
  };
  std::map<std::string, const Manifest::Tensor*> untied;
  for (const Manifest::Tensor& t : m.params) {
    if (!t.alias_of.empty()) continue;
    untied[t.name] = &t;
    expected["p/" + t.name] = {&t.shape, t.dtype, numel_of(t.shape)};
  }
  for (const Manifest::Tensor& t : m.buffers) {
    expected["b/" + t.name] = {&t.shape, t.dtype, numel_of(t.shape)};
  }
  for (const auto& [name, p] : m.optimizer_state) {
    auto param = untied.find(name);
    if (param == untied.end()) {
      return absl::DataLossError(absl::StrCat("manifest '", c.manifest_path,
                                              "': optimizer.state.", absl::CEscape(name),
                                              ": is not an untied parameter"));
    }
    for (const std::string& t : p.tensors) {
      expected[absl::StrCat("o/", name, "/", t)] = {&param->second->shape, "",
                                                    numel_of(param->second->shape)};
    }
  }

  for (int rank = 0; rank < m.world_size; ++rank) {
    const Manifest::File& f = m.files[rank];
    const std::string path = JoinPath(dir, f.name);
    if (verify_whole_files) {
      FS_ASSIGN_OR_RETURN(const std::string bytes, ReadCheckpointFile(path));
      if (static_cast<int64_t>(bytes.size()) != f.bytes ||
          base::Fnv1a64(bytes.data(), bytes.size()) != f.fnv1a) {
        return absl::DataLossError(absl::StrCat("checkpoint file '", path,
                                                "' does not match the manifest's size and "
                                                "checksum (truncated, corrupt or replaced)"));
      }
    }
    FS_ASSIGN_OR_RETURN(std::unique_ptr<ShardFileReader> file,
                        ShardFileReader::Open(path, f.bytes, f.header_fnv1a));
    if (file->info().rank != rank || file->info().world_size != m.world_size) {
      return absl::DataLossError(absl::StrCat(
          "checkpoint file '", path, "' holds rank ", file->info().rank, "/",
          file->info().world_size, ", the manifest expects rank ", rank, "/", m.world_size));
    }
    for (size_t i = 0; i < file->info().records.size(); ++i) {
      const RecordMeta& r = file->info().records[i];
      const std::string where =
          absl::StrCat("checkpoint file '", path, "': record '", absl::CEscape(r.key), "' ");
      auto it = expected.find(r.key);
      if (it == expected.end()) {
        return absl::DataLossError(
            absl::StrCat(where, "is of a tensor the manifest does not list"));
      }
      const Expected& e = it->second;
      if (r.shape != *e.shape || (!e.dtype.empty() && r.dtype != e.dtype)) {
        return absl::DataLossError(absl::StrCat(
            where, "has shape [", absl::StrJoin(r.shape, ", "), "] and dtype '",
            absl::CEscape(r.dtype), "', the manifest says [", absl::StrJoin(*e.shape, ", "),
            "]", e.dtype.empty() ? "" : absl::StrCat(" and '", e.dtype, "'")));
      }
      int64_t want = 0;
      const int64_t elem = DtypeSize(r.dtype);
      if (elem == 0 || __builtin_mul_overflow(r.end - r.begin, elem, &want) ||
          r.nbytes != want) {
        return absl::DataLossError(absl::StrCat(where, "has ", r.nbytes, " bytes of dtype '",
                                                absl::CEscape(r.dtype), "' for elements [",
                                                r.begin, ", ", r.end, ")"));
      }
      c.index[r.key].push_back({static_cast<size_t>(rank), i});
    }
    c.files.push_back(std::move(file));
  }

  // Each tensor's elements are in exactly one record.
  for (const auto& [key, e] : expected) {
    std::vector<std::pair<size_t, size_t>>& recs = c.index[key];
    auto meta = [&c](const std::pair<size_t, size_t>& fi) -> const RecordMeta& {
      return c.files[fi.first]->info().records[fi.second];
    };
    recs.erase(std::remove_if(recs.begin(), recs.end(),
                              [&](const auto& fi) { return meta(fi).begin == meta(fi).end; }),
               recs.end());
    std::sort(recs.begin(), recs.end(),
              [&](const auto& a, const auto& b) { return meta(a).begin < meta(b).begin; });
    int64_t covered = 0;
    for (size_t k = 0; k < recs.size(); ++k) {
      const RecordMeta& r = meta(recs[k]);
      if (r.begin < covered) {
        const RecordMeta& prev = meta(recs[k - 1]);
        return absl::DataLossError(absl::StrCat(
            "checkpoint file '", c.files[recs[k].first]->path(), "': tensor '",
            absl::CEscape(key), "' elements [", r.begin, ", ", std::min(r.end, prev.end),
            ") are also in '", c.files[recs[k - 1].first]->path(), "'"));
      }
      if (r.begin > covered) break;
      covered = r.end;
    }
    if (covered != e.numel) {
      int64_t gap_end = e.numel;
      for (const auto& fi : recs) {
        if (meta(fi).begin > covered) {
          gap_end = meta(fi).begin;
          break;
        }
      }
      return absl::DataLossError(absl::StrCat("tensor '", absl::CEscape(key), "' elements [",
                                              covered, ", ", gap_end,
                                              ") are in no checkpoint file (manifest '",
                                              c.manifest_path, "')"));
    }
  }
  return c;
}

int64_t DtypeSize(absl::string_view dtype) {
  if (dtype == "Float") return 4;
  if (dtype == "Double") return 8;
  if (dtype == "Half" || dtype == "BFloat16") return 2;
  return 0;
}

}  // namespace fairscale::fsdp::internal
