#include "fsdp/internal/shard_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/fnv1a.h"

namespace fairscale::fsdp::internal {
namespace {

constexpr char kMagic[8] = {'F', 'S', 'D', 'P', 'S', 'H', 'D', '1'};
constexpr int64_t kFooterBytes = 8 + 8 + 8;  // header length, header FNV-1a, magic
constexpr const char* kManifestFormat = "fairscale.fsdp.sharded_checkpoint.v1";

std::string Errno() { return std::strerror(errno); }

std::string Hex(uint64_t v) { return absl::StrFormat("%016x", v); }

bool ParseHex(const std::string& s, uint64_t* out) {
  if (s.empty() || s.size() > 16) return false;
  uint64_t v = 0;
  for (char c : s) {
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) return false;
    v = v * 16 + static_cast<uint64_t>(d);
  }
  *out = v;
  return true;
}

absl::Status SyncDirOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return absl::DataLossError(absl::StrCat("cannot open directory '", dir, "': ", Errno()));
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return absl::DataLossError(absl::StrCat("fsync of '", dir, "' failed: ", Errno()));
  return absl::OkStatus();
}

}  // namespace

absl::Status CommitFile(const std::string& tmp, const std::string& path) {
  const int fd = ::open(tmp.c_str(), O_RDONLY);
  if (fd < 0) return absl::DataLossError(absl::StrCat("cannot open '", tmp, "': ", Errno()));
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return absl::DataLossError(absl::StrCat("fsync of '", tmp, "' failed: ", Errno()));
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string err = Errno();
    std::remove(tmp.c_str());
    return absl::DataLossError(
        absl::StrCat("renaming '", tmp, "' to '", path, "' failed: ", err));
  }
  return SyncDirOf(path);
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view data) {
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return absl::DataLossError(absl::StrCat("cannot create '", tmp, "': ", Errno()));
  const bool ok = std::fwrite(data.data(), 1, data.size(), f) == data.size();
  const bool closed = std::fclose(f) == 0;
  if (!ok || !closed) {
    std::remove(tmp.c_str());
    return absl::DataLossError(absl::StrCat("cannot write '", tmp, "': ", Errno()));
  }
  return CommitFile(tmp, path);
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    return absl::DataLossError(absl::StrCat("cannot open '", path, "': ", Errno()));
  }
  std::string out;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
  const bool error = std::ferror(f) != 0;
  std::fclose(f);
  if (error) return absl::DataLossError(absl::StrCat("cannot read '", path, "'"));
  return out;
}

std::string RankFileName(int rank) { return absl::StrFormat("rank%05d.shard", rank); }

// ---- writer --------------------------------------------------------------------------------

ShardFileWriter::ShardFileWriter(std::string path, std::FILE* file, int rank, int world_size)
    : path_(std::move(path)), file_(file), fnv_(base::kFnv1a64Basis) {
  info_.rank = rank;
  info_.world_size = world_size;
}

ShardFileWriter::~ShardFileWriter() {
  if (file_ != nullptr) {
    std::fclose(file_);
    std::remove((path_ + ".tmp").c_str());
  }
}

absl::StatusOr<std::unique_ptr<ShardFileWriter>> ShardFileWriter::Open(const std::string& path,
                                                                       int rank, int world_size) {
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return absl::DataLossError(absl::StrCat("cannot create '", tmp, "': ", Errno()));
  std::unique_ptr<ShardFileWriter> w(new ShardFileWriter(path, f, rank, world_size));
  absl::Status s = w->Write(kMagic, sizeof(kMagic));
  if (!s.ok()) return s;
  return w;
}

absl::Status ShardFileWriter::Write(const void* data, size_t n) {
  if (n > 0 && std::fwrite(data, 1, n, file_) != n) {
    return absl::DataLossError(absl::StrCat("cannot write '", path_, ".tmp': ", Errno()));
  }
  fnv_ = base::Fnv1a64(data, n, fnv_);
  written_ += static_cast<int64_t>(n);
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
  r.offset = written_;
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
  const bool closed = std::fclose(file_) == 0;
  file_ = nullptr;
  if (!closed) {
    std::remove((path_ + ".tmp").c_str());
    return absl::DataLossError(absl::StrCat("cannot write '", path_, ".tmp': ", Errno()));
  }
  s = CommitFile(path_ + ".tmp", path_);
  if (!s.ok()) return s;
  summary.bytes = written_;
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
  try {
    const nlohmann::json j = nlohmann::json::parse(header);
    r->info_.rank = j.at("rank").get<int>();
    r->info_.world_size = j.at("world_size").get<int>();
    for (const auto& rec : j.at("records")) {
      RecordMeta m;
      m.key = rec.at("key").get<std::string>();
      m.dtype = rec.at("dtype").get<std::string>();
      m.shape = rec.at("shape").get<std::vector<int64_t>>();
      m.begin = rec.at("begin").get<int64_t>();
      m.end = rec.at("end").get<int64_t>();
      m.offset = rec.at("offset").get<int64_t>();
      m.nbytes = rec.at("nbytes").get<int64_t>();
      int64_t numel = 1;
      for (int64_t d : m.shape) numel *= d;
      if (!ParseHex(rec.at("fnv1a").get<std::string>(), &m.fnv1a) || m.offset < 0 ||
          m.nbytes < 0 || m.offset + m.nbytes > bytes || m.begin < 0 || m.end < m.begin ||
          m.end > numel) {
        return absl::DataLossError(absl::StrCat("checkpoint file '", path, "': record '", m.key,
                                                "' is malformed"));
      }
      r->info_.records.push_back(std::move(m));
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::DataLossError(
        absl::StrCat("checkpoint file '", path, "': malformed header: ", e.what()));
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

std::vector<Manifest::Tensor> TensorsFromJson(const nlohmann::json& j) {
  std::vector<Manifest::Tensor> out;
  for (const auto& t : j) {
    Manifest::Tensor m;
    m.name = t.at("name").get<std::string>();
    m.shape = t.at("shape").get<std::vector<int64_t>>();
    m.dtype = t.at("dtype").get<std::string>();
    if (t.contains("alias_of")) m.alias_of = t.at("alias_of").get<std::string>();
    out.push_back(std::move(m));
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
  Manifest m;
  try {
    const nlohmann::json j = nlohmann::json::parse(json.begin(), json.end());
    if (j.at("format").get<std::string>() != kManifestFormat) {
      return absl::DataLossError(absl::StrCat("manifest '", path, "' has format '",
                                              j.at("format").get<std::string>(), "', expected '",
                                              kManifestFormat, "'"));
    }
    m.world_size = j.at("world_size").get<int>();
    m.units = j.at("units").get<std::vector<std::string>>();
    m.params = TensorsFromJson(j.at("params"));
    m.buffers = TensorsFromJson(j.at("buffers"));
    for (const auto& f : j.at("files")) {
      Manifest::File file;
      file.name = f.at("name").get<std::string>();
      file.bytes = f.at("bytes").get<int64_t>();
      if (!ParseHex(f.at("fnv1a").get<std::string>(), &file.fnv1a) ||
          !ParseHex(f.at("header_fnv1a").get<std::string>(), &file.header_fnv1a)) {
        return absl::DataLossError(
            absl::StrCat("manifest '", path, "': bad checksum of file '", file.name, "'"));
      }
      m.files.push_back(std::move(file));
    }
    if (static_cast<int>(m.files.size()) != m.world_size || m.world_size < 1) {
      return absl::DataLossError(absl::StrCat("manifest '", path, "' lists ", m.files.size(),
                                              " files for world size ", m.world_size));
    }
    if (j.contains("optimizer")) {
      const auto& o = j.at("optimizer");
      m.has_optimizer = true;
      m.optimizer_kind = o.at("kind").get<std::string>();
      for (const auto& g : o.at("param_groups")) {
        m.param_groups.push_back({g.at("options").get<std::map<std::string, double>>(),
                                  g.at("params").get<std::vector<std::string>>()});
      }
      for (const auto& [name, p] : o.at("state").items()) {
        m.optimizer_state[name] = {p.at("step").get<int64_t>(),
                                   p.at("tensors").get<std::vector<std::string>>()};
      }
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::DataLossError(
        absl::StrCat("manifest '", path, "' is malformed or incomplete: ", e.what()));
  }
  return m;
}

}  // namespace fairscale::fsdp::internal
