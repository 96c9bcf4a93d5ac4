// Fuzz target (libFuzzer's LLVMFuzzerTestOneInput) of the sharded FSDP checkpoint's readers, the
// bytes a load trusts nothing in: the manifest (ManifestFromJson), a rank file's magic, footer
// and JSON header (ShardFileReader::Open, then Read of every record), and a whole directory
// (OpenCheckpointFiles: the manifest against the rank files, every record against the manifest,
// each tensor's records covering it exactly once). Input layout: fuzz_input.h. For every input:
// * no crash, no sanitizer report, no exception out of the readers;
// * every error is kDataLoss and names the file (or the directory) it is about;
// * a manifest that parses obeys the documented bounds (world size >= 1 and the number of files,
//   files[r] = RankFileName(r), shapes >= 0, checkpoint dtypes, tied parameters naming earlier
//   untied ones) and survives ManifestToJson -> ManifestFromJson unchanged;
// * an opened rank file has rank < world size and records inside its data section with
//   0 <= begin <= end <= numel(shape); reading a record gives exactly nbytes bytes or kDataLoss
//   naming the file;
// * an opened directory indexes, per tensor key, records of the manifest's shape with
//   (end - begin) * element size bytes, sorted, disjoint and covering [0, numel) exactly.
#include <fcntl.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <set>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/fnv1a.h"
#include "base/fuzz_check.h"
#include "fsdp/fuzz/fuzz_input.h"
#include "fsdp/internal/shard_file.h"

namespace {

namespace fz = fairscale::fsdp::fuzz;
namespace fi = fairscale::fsdp::internal;

const std::string& Dir() {
  static const std::string dir = [] {
    const char* tmp = std::getenv("TEST_TMPDIR");
    std::string d = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/fs_fsdp_fuzz_", getpid(), "/ck");
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

// Overwrites in place and truncates (no O_TRUNC: on ext4 that flushes the file at close).
void Write(const std::string& path, absl::string_view data) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  FS_FUZZ_CHECK(fd >= 0);
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t w = ::write(fd, data.data() + done, data.size() - done);
    FS_FUZZ_CHECK(w > 0);
    done += static_cast<size_t>(w);
  }
  FS_FUZZ_CHECK(::ftruncate(fd, static_cast<off_t>(data.size())) == 0);
  ::close(fd);
}

// The header checksum a consistent manifest would hold for `file` (0 when the footer is bad).
uint64_t HeaderFnv(absl::string_view file) {
  if (file.size() < 32) return 0;
  uint64_t len = 0;
  std::memcpy(&len, file.data() + file.size() - 24, 8);
  if (len > file.size() - 32) return 0;
  return fairscale::base::Fnv1a64(file.data() + file.size() - 24 - len, len);
}

void CheckError(const absl::Status& s, const std::string& names) {
  if (s.code() != absl::StatusCode::kDataLoss || !absl::StrContains(s.message(), names)) {
    std::fprintf(stderr, "unexpected status (should be DATA_LOSS naming %s): %s\n",
                 names.c_str(), s.ToString().c_str());
    FS_FUZZ_CHECK(false);
  }
}

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    FS_FUZZ_CHECK(d >= 0);
    FS_FUZZ_CHECK(!__builtin_mul_overflow(n, d, &n));
  }
  return n;
}

void CheckManifest(const fi::Manifest& m) {
  FS_FUZZ_CHECK(m.world_size >= 1);
  FS_FUZZ_CHECK(m.files.size() == static_cast<size_t>(m.world_size));
  for (size_t r = 0; r < m.files.size(); ++r) {
    FS_FUZZ_CHECK(m.files[r].name == fi::RankFileName(static_cast<int>(r)));
    FS_FUZZ_CHECK(m.files[r].bytes >= 0);
  }
  std::set<std::string> untied;
  for (const auto* list : {&m.params, &m.buffers}) {
    std::set<std::string> names;
    for (const fi::Manifest::Tensor& t : *list) {
      Numel(t.shape);
      FS_FUZZ_CHECK(fi::DtypeSize(t.dtype) > 0);
      FS_FUZZ_CHECK(names.insert(t.name).second);
      if (list == &m.params) {
        if (t.alias_of.empty()) {
          untied.insert(t.name);
        } else {
          FS_FUZZ_CHECK(untied.count(t.alias_of) == 1);
        }
      } else {
        FS_FUZZ_CHECK(t.alias_of.empty());
      }
    }
  }
  // What is read is what a save of it writes.
  const std::string json = fi::ManifestToJson(m);
  absl::StatusOr<fi::Manifest> again = fi::ManifestFromJson(json, "again");
  if (!again.ok()) {
    std::fprintf(stderr, "round trip failed: %s\n", again.status().ToString().c_str());
    FS_FUZZ_CHECK(false);
  }
  FS_FUZZ_CHECK(fi::ManifestToJson(*again) == json);
}

void CheckRecords(fi::ShardFileReader& r, int64_t bytes) {
  const fi::ShardFileInfo& info = r.info();
  FS_FUZZ_CHECK(info.rank >= 0 && info.rank < info.world_size);
  for (size_t i = 0; i < info.records.size(); ++i) {
    const fi::RecordMeta& m = info.records[i];
    FS_FUZZ_CHECK(0 <= m.begin && m.begin <= m.end && m.end <= Numel(m.shape));
    FS_FUZZ_CHECK(m.offset >= 8 && m.nbytes >= 0 && m.nbytes <= bytes - 24 - m.offset);
    absl::StatusOr<std::string> data = r.Read(i);
    if (data.ok()) {
      FS_FUZZ_CHECK(static_cast<int64_t>(data->size()) == m.nbytes);
    } else {
      CheckError(data.status(), r.path());
    }
  }
}

void FuzzManifest(absl::string_view json) {
  const std::string path = Dir() + "/manifest.json";
  absl::StatusOr<fi::Manifest> m = fi::ManifestFromJson(json, path);
  if (!m.ok()) return CheckError(m.status(), "manifest '" + path + "'");
  CheckManifest(*m);
}

void FuzzRankFile(absl::string_view file, bool fix) {
  const std::string path = Dir() + "/one.shard";
  Write(path, file);
  uint64_t header_fnv = 0;
  if (fix) {
    header_fnv = HeaderFnv(file);
  } else if (file.size() >= 8) {
    std::memcpy(&header_fnv, file.data(), 8);  // some fixed function of the input
  }
  auto r = fi::ShardFileReader::Open(path, static_cast<int64_t>(file.size()), header_fnv);
  if (!r.ok()) return CheckError(r.status(), path);
  CheckRecords(**r, static_cast<int64_t>(file.size()));
}

void FuzzDirectory(absl::string_view rest, bool fix, bool verify) {
  std::vector<absl::string_view> parts = absl::StrSplit(rest, fz::kSeparator);
  std::string manifest(parts[0]);
  const size_t files = std::min<size_t>(parts.size() - 1, fz::kMaxRankFiles);
  if (fix) {
    nlohmann::json j = nlohmann::json::parse(manifest, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("files") && j["files"].is_array()) {
      for (size_t r = 0; r < files && r < j["files"].size(); ++r) {
        nlohmann::json& e = j["files"][r];
        if (!e.is_object()) continue;
        const absl::string_view f = parts[r + 1];
        e["bytes"] = f.size();
        e["fnv1a"] = absl::StrFormat("%016x", fairscale::base::Fnv1a64(f.data(), f.size()));
        e["header_fnv1a"] = absl::StrFormat("%016x", HeaderFnv(f));
      }
      manifest = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    }
  }
  const std::string dir = Dir();
  Write(dir + "/" + fi::kManifestName, manifest);
  for (int r = 0; r < fz::kMaxRankFiles; ++r) {
    const std::string path = dir + "/" + fi::RankFileName(r);
    if (static_cast<size_t>(r) < files) {
      Write(path, parts[r + 1]);
    } else {
      ::unlink(path.c_str());
    }
  }
  absl::StatusOr<fi::CheckpointFiles> c = fi::OpenCheckpointFiles(dir, verify);
  if (!c.ok()) return CheckError(c.status(), dir);
  CheckManifest(c->manifest);
  FS_FUZZ_CHECK(c->files.size() == static_cast<size_t>(c->manifest.world_size));
  for (const auto& [key, recs] : c->index) {
    int64_t covered = 0;
    for (const auto& [f, i] : recs) {
      FS_FUZZ_CHECK(f < c->files.size() && i < c->files[f]->info().records.size());
      const fi::RecordMeta& m = c->files[f]->info().records[i];
      FS_FUZZ_CHECK(m.key == key);
      FS_FUZZ_CHECK(m.begin == covered);  // sorted, disjoint, no gap
      FS_FUZZ_CHECK(m.nbytes == (m.end - m.begin) * fi::DtypeSize(m.dtype));
      covered = m.end;
    }
    if (!recs.empty()) {
      const fi::RecordMeta& last = c->files[recs.back().first]->info().records[recs.back().second];
      FS_FUZZ_CHECK(covered == Numel(last.shape));
    }
  }
  for (size_t f = 0; f < c->files.size(); ++f) {
    CheckRecords(*c->files[f], c->manifest.files[f].bytes);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t control = data[0];
  const absl::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (control & 3) {
    case fz::kModeManifest:
      FuzzManifest(rest);
      break;
    case fz::kModeRankFile:
      FuzzRankFile(rest, (control & fz::kFixChecksums) != 0);
      break;
    default:
      FuzzDirectory(rest, (control & fz::kFixChecksums) != 0,
                    (control & fz::kVerifyWholeFiles) != 0);
      break;
  }
  return 0;
}
