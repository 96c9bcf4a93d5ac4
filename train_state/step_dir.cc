#include "train_state/step_dir.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/fnv1a.h"
#include "base/json_fields.h"
#include "base/status_macros.h"

namespace fairscale::train_state {
namespace fs = std::filesystem;

namespace {

std::string Errno(int e) { return std::strerror(e); }

absl::Status IoError(int e, absl::string_view what) {
  const std::string msg = absl::StrCat(what, ": ", Errno(e));
  if (e == ENOSPC || e == EDQUOT) return absl::ResourceExhaustedError(msg);
  return absl::DataLossError(msg);
}

}  // namespace

std::string StepDirName(int64_t step) { return absl::StrFormat("step_%08d", step); }

std::string StepDir(const std::string& root, int64_t step) {
  return absl::StrCat(root, root.empty() || root.back() == '/' ? "" : "/", StepDirName(step));
}

absl::Status CheckPlainName(absl::string_view name, absl::string_view what) {
  const bool chars_ok = std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '_' || c == '.' || c == '-';
  });
  if (name.empty() || name.size() > 128 || !chars_ok || name == "." || name == "..") {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " \"", absl::CEscape(name),
        "\" is not a plain name (1 to 128 of [A-Za-z0-9_.-], not \".\" or \"..\")"));
  }
  return absl::OkStatus();
}

absl::Status CheckRelativePath(absl::string_view path, absl::string_view what) {
  std::vector<absl::string_view> parts = absl::StrSplit(path, '/');
  bool ok = parts.size() <= 4;
  for (absl::string_view part : parts) ok = ok && CheckPlainName(part, what).ok();
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " \"", absl::CEscape(path),
        "\" is not a relative path of 1 to 4 plain names ([A-Za-z0-9_.-], not \".\" or \"..\")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<FileDigest> DigestFile(const std::string& dir, const std::string& name) {
  const std::string path = absl::StrCat(dir, "/", name);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat("checkpoint file ", path, " is missing"));
    return IoError(errno, absl::StrCat("cannot open checkpoint file ", path));
  }
  FileDigest d{name, 0, base::kFnv1a64Basis};
  std::vector<char> buf(1 << 20);
  while (true) {
    const ssize_t r = ::read(fd, buf.data(), buf.size());
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const int e = errno;
      ::close(fd);
      return IoError(e, absl::StrCat("cannot read checkpoint file ", path));
    }
    if (r == 0) break;
    d.fnv1a64 = base::Fnv1a64(buf.data(), static_cast<size_t>(r), d.fnv1a64);
    d.bytes += static_cast<uint64_t>(r);
  }
  ::close(fd);
  return d;
}

std::string MarkerToJson(const Marker& m) {
  nlohmann::json items = nlohmann::json::object();
  for (const auto& [name, item] : m.items) {
    nlohmann::json files = nlohmann::json::array();
    for (const FileDigest& f : item.files) {
      files.push_back({{"name", f.name},
                       {"bytes", f.bytes},
                       {"fnv1a64", absl::StrFormat("%016x", f.fnv1a64)}});
    }
    items[name] = {{"kind", item.kind}, {"files", files}};
  }
  const nlohmann::json j = {{"format", kMarkerFormat}, {"step", m.step},
                            {"world_size", m.world_size}, {"items", items},
                            {"metadata", m.metadata.is_null() ? nlohmann::json::object()
                                                              : m.metadata}};
  return j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace);
}

absl::StatusOr<Marker> MarkerFromJson(absl::string_view json, const std::string& path) {
  const nlohmann::json j =
      nlohmann::json::parse(json.begin(), json.end(), nullptr, /*allow_exceptions=*/false);
  const base::JsonFields f(absl::StrCat("corrupt checkpoint marker ", path, ": "));
  if (j.is_discarded()) return f.Error("(file)", "not valid JSON (truncated or overwritten?)");
  FS_RETURN_IF_ERROR(f.Object(j, "(file)"));
  Marker m;
  FS_ASSIGN_OR_RETURN(const nlohmann::json* format, f.Need(j, "format", "format"));
  FS_ASSIGN_OR_RETURN(const std::string format_name, f.String(*format, "format"));
  if (format_name != kMarkerFormat) {
    return f.Error("format", absl::StrCat("is \"", absl::CEscape(format_name),
                                          "\"; this build reads \"", kMarkerFormat, "\""));
  }
  FS_ASSIGN_OR_RETURN(const nlohmann::json* step, f.Need(j, "step", "step"));
  FS_ASSIGN_OR_RETURN(m.step, f.Int(*step, "step", 0));
  FS_ASSIGN_OR_RETURN(const nlohmann::json* world, f.Need(j, "world_size", "world_size"));
  FS_ASSIGN_OR_RETURN(const int64_t world_size, f.Int(*world, "world_size", 1, kMaxWorldSize));
  m.world_size = static_cast<int>(world_size);
  FS_ASSIGN_OR_RETURN(const nlohmann::json* items, f.Need(j, "items", "items"));
  FS_RETURN_IF_ERROR(f.Object(*items, "items"));
  for (const auto& [name, value] : items->items()) {
    const std::string field = absl::StrCat("items.", absl::CEscape(name));
    if (!CheckPlainName(name, "item").ok()) return f.Error(field, "is not a plain name");
    Marker::Item item;
    FS_ASSIGN_OR_RETURN(const nlohmann::json* kind, f.Need(value, "kind", field + ".kind"));
    FS_ASSIGN_OR_RETURN(item.kind, f.String(*kind, field + ".kind"));
    FS_ASSIGN_OR_RETURN(const nlohmann::json* files, f.Need(value, "files", field + ".files"));
    FS_RETURN_IF_ERROR(f.Array(*files, field + ".files"));
    std::set<std::string> seen;
    for (size_t i = 0; i < files->size(); ++i) {
      const std::string ff = absl::StrCat(field, ".files[", i, "]");
      const nlohmann::json& e = (*files)[i];
      FileDigest d;
      FS_ASSIGN_OR_RETURN(const nlohmann::json* n, f.Need(e, "name", ff + ".name"));
      FS_ASSIGN_OR_RETURN(d.name, f.String(*n, ff + ".name"));
      if (!CheckRelativePath(d.name, "file").ok()) {
        return f.Error(ff + ".name", absl::StrCat("\"", absl::CEscape(d.name),
                                                  "\" is not a plain path inside the item's "
                                                  "directory"));
      }
      if (!seen.insert(d.name).second) {
        return f.Error(ff + ".name", absl::StrCat("\"", d.name, "\" is listed twice"));
      }
      FS_ASSIGN_OR_RETURN(const nlohmann::json* b, f.Need(e, "bytes", ff + ".bytes"));
      FS_ASSIGN_OR_RETURN(d.bytes, f.Unsigned(*b, ff + ".bytes"));
      FS_ASSIGN_OR_RETURN(const nlohmann::json* h, f.Need(e, "fnv1a64", ff + ".fnv1a64"));
      FS_ASSIGN_OR_RETURN(d.fnv1a64, f.Hex64(*h, ff + ".fnv1a64"));
      item.files.push_back(std::move(d));
    }
    m.items[name] = std::move(item);
  }
  if (j.contains("metadata")) {
    FS_RETURN_IF_ERROR(f.Object(j["metadata"], "metadata"));
    m.metadata = j["metadata"];
  }
  return m;
}

absl::StatusOr<Marker> ReadMarker(const std::string& step_dir, int64_t step) {
  const std::string path = absl::StrCat(step_dir, "/", kMarkerName);
  FS_ASSIGN_OR_RETURN(const std::string text, ReadFile(path));
  FS_ASSIGN_OR_RETURN(Marker m, MarkerFromJson(text, path));
  if (m.step != step) {
    return absl::DataLossError(absl::StrCat("corrupt checkpoint marker ", path, ": step: is ",
                                            m.step, ", the directory's is ", step));
  }
  return m;
}

absl::Status WriteMarker(const std::string& step_dir, const Marker& marker) {
  return WriteFileAtomic(absl::StrCat(step_dir, "/", kMarkerName), MarkerToJson(marker));
}

absl::Status VerifyFiles(const std::string& step_dir, const Marker& marker) {
  for (const auto& [name, item] : marker.items) {
    const std::string dir = absl::StrCat(step_dir, "/", name);
    for (const FileDigest& want : item.files) {
      FS_ASSIGN_OR_RETURN(const FileDigest got, DigestFile(dir, want.name));
      const std::string path = absl::StrCat(dir, "/", want.name);
      if (got.bytes != want.bytes) {
        return absl::DataLossError(absl::StrCat("checkpoint file ", path, " is corrupt: ",
                                                got.bytes, " bytes, ", kMarkerName, " says ",
                                                want.bytes));
      }
      if (got.fnv1a64 != want.fnv1a64) {
        return absl::DataLossError(absl::StrFormat(
            "checkpoint file %s is corrupt: FNV-1a %016x, %s says %016x", path, got.fnv1a64,
            kMarkerName, want.fnv1a64));
      }
    }
  }
  return absl::OkStatus();
}

std::vector<StepEntry> ListSteps(const std::string& root) {
  std::vector<StepEntry> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const fs::directory_entry& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    int64_t step = 0;
    if (name.size() < 6 || name.compare(0, 5, "step_") != 0 ||
        name.find_first_not_of("0123456789", 5) != std::string::npos ||
        !absl::SimpleAtoi(absl::string_view(name).substr(5), &step) || !e.is_directory(ec)) {
      continue;
    }
    StepEntry s{step, e.path().string(), false};
    s.complete = fs::exists(absl::StrCat(s.dir, "/", kMarkerName), ec);
    out.push_back(std::move(s));
  }
  std::sort(out.begin(), out.end(), [](const StepEntry& a, const StepEntry& b) {
    return a.step > b.step;
  });
  return out;
}

std::vector<StepEntry> StepsToDelete(const std::vector<StepEntry>& steps, int keep_last,
                                     int64_t keep_every) {
  std::vector<StepEntry> out;
  std::optional<int64_t> newest;
  int complete_seen = 0;
  for (const StepEntry& s : steps) {  // newest first
    if (s.complete) {
      if (!newest) newest = s.step;
      ++complete_seen;
      const bool keep = complete_seen <= std::max(keep_last, 1) ||
                        (keep_every > 0 && s.step % keep_every == 0);
      if (!keep) out.push_back(s);
    } else if (newest && s.step < *newest) {
      out.push_back(s);
    }
  }
  return out;
}

absl::Status RemoveStepDir(const std::string& dir) {
  std::error_code ec;
  fs::remove_all(dir, ec);
  if (ec) {
    return absl::DataLossError(absl::StrCat("cannot remove step directory ", dir, ": ",
                                            ec.message()));
  }
  return absl::OkStatus();
}

}  // namespace fairscale::train_state
