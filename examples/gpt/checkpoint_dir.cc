#include "examples/gpt/checkpoint_dir.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/json_fields.h"
#include "base/status_macros.h"

namespace fairscale::examples::gpt {
namespace fs = std::filesystem;

std::string StepDir(const std::string& root, int64_t step) {
  return absl::StrFormat("%s/step_%08d", root, step);
}
std::string RankFile(const std::string& step_dir, int rank) {
  return absl::StrCat(step_dir, "/rank", rank, ".pt");
}
std::vector<std::string> RankFileNames(int world_size) {
  std::vector<std::string> files;
  for (int r = 0; r < world_size; ++r) files.push_back(absl::StrCat("rank", r, ".pt"));
  return files;
}
std::string ShardFileName(int rank) { return absl::StrFormat("rank%05d.shard", rank); }

absl::Status WriteFileAtomic(const std::string& path, const std::string& content) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("cannot create ", tmp, ": ", std::strerror(errno)));
  }
  size_t done = 0;
  while (done < content.size()) {
    const ssize_t w = ::write(fd, content.data() + done, content.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return absl::UnavailableError(absl::StrCat("cannot write ", tmp, ": ", std::strerror(err)));
    }
    done += static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return absl::UnavailableError(absl::StrCat("cannot flush ", tmp, ": ", std::strerror(err)));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return absl::UnavailableError(
        absl::StrCat("cannot rename ", tmp, " to ", path, ": ", std::strerror(err)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("cannot read ", path));
  return ss.str();
}

absl::StatusOr<FileDigest> DigestFile(const std::string& dir, const std::string& name) {
  const std::string path = absl::StrCat(dir, "/", name);
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("checkpoint file ", path, " is missing"));
  FileDigest d;
  d.name = name;
  uint64_t h = kFnv1a64Basis;
  char buf[1 << 16];
  while (in) {
    in.read(buf, sizeof(buf));
    const std::streamsize got = in.gcount();
    h = Fnv1a64(buf, static_cast<size_t>(got), h);
    d.bytes += static_cast<uint64_t>(got);
  }
  if (in.bad()) return absl::DataLossError(absl::StrCat("cannot read checkpoint file ", path));
  d.fnv1a64 = h;
  return d;
}

absl::Status WriteComplete(const std::string& step_dir, int64_t step, int world_size,
                           const nlohmann::json& config) {
  return WriteComplete(step_dir, step, world_size, kFormatRankFiles, RankFileNames(world_size),
                       config,
                       nlohmann::json::object());
}

absl::Status WriteComplete(const std::string& step_dir, int64_t step, int world_size,
                           const std::string& format, const std::vector<std::string>& files,
                           const nlohmann::json& config, const nlohmann::json& trainer_state) {
  nlohmann::json j;
  j["step"] = step;
  j["world_size"] = world_size;
  j["format"] = format;
  j["config"] = config.is_null() ? nlohmann::json::object() : config;
  j["trainer_state"] = trainer_state.is_null() ? nlohmann::json::object() : trainer_state;
  j["files"] = nlohmann::json::array();
  for (const std::string& name : files) {
    absl::StatusOr<FileDigest> d = DigestFile(step_dir, name);
    if (!d.ok()) return d.status();
    // As a hex string: JSON readers that hold numbers as doubles would round a 64-bit value.
    j["files"].push_back({{"name", d->name},
                          {"bytes", d->bytes},
                          {"fnv1a64", absl::StrFormat("%016x", d->fnv1a64)}});
  }
  return WriteFileAtomic(absl::StrCat(step_dir, "/", kCompleteName), j.dump(2) + "\n");
}

namespace {

// Step directories under root, newest first: (step, path).
std::vector<std::pair<int64_t, std::string>> StepDirs(const std::string& root) {
  std::vector<std::pair<int64_t, std::string>> dirs;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return dirs;
  for (const fs::directory_entry& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    int64_t step = 0;
    if (!e.is_directory(ec) || !absl::StartsWith(name, "step_") ||
        !absl::SimpleAtoi(absl::string_view(name).substr(5), &step)) {
      continue;
    }
    dirs.emplace_back(step, e.path().string());
  }
  std::sort(dirs.begin(), dirs.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return dirs;
}

bool HasComplete(const std::string& dir) {
  std::error_code ec;
  return fs::exists(absl::StrCat(dir, "/", kCompleteName), ec);
}

// Reads COMPLETE trusting nothing in it: every field's type and range is checked, and an error
// names the file and the field ("corrupt checkpoint marker <dir>/COMPLETE: files[1].name: ...").
class MarkerReader : public base::JsonFields {
 public:
  explicit MarkerReader(const std::string& path)
      : JsonFields(absl::StrCat("corrupt checkpoint marker ", path, ": ")) {}

  // A file name relative to the step directory that stays inside it: not absolute, no "..",
  // "." or empty component, no NUL.
  absl::Status RelativeName(const std::string& name, const std::string& field) const {
    const std::string quoted = absl::StrCat("\"", absl::CEscape(name), "\"");
    if (name.empty()) return Error(field, "is empty");
    if (name.find('\0') != std::string::npos) return Error(field, quoted + " holds a NUL byte");
    if (name[0] == '/') {
      return Error(field, absl::StrCat(quoted, " is an absolute path (names are relative to "
                                               "the step directory)"));
    }
    for (absl::string_view part : absl::StrSplit(name, '/')) {
      if (part == "..") return Error(field, quoted + " leaves the step directory");
      if (part.empty() || part == ".") {
        return Error(field, quoted + " is not a plain relative path (empty or '.' component)");
      }
    }
    return absl::OkStatus();
  }

  // The types of the fields of `config` (TrainConfig::ToJson()) and `trainer_state` that the
  // trainer reads; other keys may hold anything.
  absl::Status Config(const nlohmann::json& config) const {
    FS_RETURN_IF_ERROR(Object(config, "config"));
    for (const char* key : {"steps", "schedule_steps", "batch", "seq", "width", "blocks", "heads",
                            "warmup_steps", "pipeline_stages", "pipeline_virtual_stages"}) {
      if (config.contains(key)) {
        FS_RETURN_IF_ERROR(Int(config[key], absl::StrCat("config.", key), 0,
                               std::numeric_limits<int64_t>::max())
                               .status());
      }
    }
    if (config.contains("seed")) {
      FS_RETURN_IF_ERROR(Unsigned(config["seed"], "config.seed").status());
    }
    for (const char* key : {"lr", "min_lr_ratio", "grad_clip"}) {
      if (config.contains(key)) {
        FS_RETURN_IF_ERROR(Number(config[key], absl::StrCat("config.", key)).status());
      }
    }
    for (const char* key : {"strategy", "precision", "data_parallel", "pipeline_balance"}) {
      if (config.contains(key)) {
        FS_RETURN_IF_ERROR(String(config[key], absl::StrCat("config.", key)).status());
      }
    }
    // Checkpoints written before trainer_state held the loss scaler in config.
    if (config.contains("grad_scaler")) {
      FS_RETURN_IF_ERROR(GradScaler(config["grad_scaler"], "config.grad_scaler"));
    }
    return absl::OkStatus();
  }

  absl::Status TrainerState(const nlohmann::json& state) const {
    FS_RETURN_IF_ERROR(Object(state, "trainer_state"));
    if (state.contains("full_param_fnv1a64")) {
      FS_RETURN_IF_ERROR(
          Hex64(state["full_param_fnv1a64"], "trainer_state.full_param_fnv1a64").status());
    }
    if (state.contains("grad_scaler")) {
      FS_RETURN_IF_ERROR(GradScaler(state["grad_scaler"], "trainer_state.grad_scaler"));
    }
    return absl::OkStatus();
  }

 private:
  absl::Status GradScaler(const nlohmann::json& v, const std::string& field) const {
    FS_RETURN_IF_ERROR(Object(v, field));
    if (v.contains("scale")) FS_RETURN_IF_ERROR(Number(v["scale"], field + ".scale").status());
    if (v.contains("growth_tracker")) {
      FS_RETURN_IF_ERROR(Int(v["growth_tracker"], field + ".growth_tracker", 0,
                             std::numeric_limits<int>::max())
                             .status());
    }
    return absl::OkStatus();
  }
};

// The files a step directory of `format` at `world_size` holds (empty for formats whose layout
// this library does not know: the pipeline's, checked by name and uniqueness only).
std::vector<std::string> ExpectedFiles(const std::string& format, int world_size) {
  if (format == kFormatRankFiles) return RankFileNames(world_size);
  if (format != kFormatFsdpSharded) return {};
  std::vector<std::string> files;
  for (int r = 0; r < world_size; ++r) files.push_back(ShardFileName(r));
  files.push_back(kShardManifestName);
  return files;
}

absl::StatusOr<CompleteCheckpoint> ParseComplete(const std::string& dir) {
  const std::string path = absl::StrCat(dir, "/", kCompleteName);
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return text.status();
  const nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return absl::DataLossError(absl::StrCat("corrupt checkpoint marker ", path, ": not valid JSON"));
  }
  const MarkerReader m(path);
  if (!j.is_object()) return m.WrongType(j, "(top level)", "an object");
  CompleteCheckpoint c;
  c.dir = dir;
  FS_ASSIGN_OR_RETURN(const nlohmann::json* step, m.Need(j, "step", "step"));
  FS_ASSIGN_OR_RETURN(c.step, m.Int(*step, "step", 0, std::numeric_limits<int64_t>::max()));
  FS_ASSIGN_OR_RETURN(const nlohmann::json* world, m.Need(j, "world_size", "world_size"));
  FS_ASSIGN_OR_RETURN(const int64_t world_size, m.Int(*world, "world_size", 1, kMaxWorldSize));
  c.world_size = static_cast<int>(world_size);
  if (j.contains("format")) {
    FS_ASSIGN_OR_RETURN(c.format, m.String(j["format"], "format"));
  }
  FS_ASSIGN_OR_RETURN(const nlohmann::json* config, m.Need(j, "config", "config"));
  FS_RETURN_IF_ERROR(m.Config(*config));
  c.config = *config;
  if (j.contains("trainer_state") && !j["trainer_state"].is_null()) {
    FS_RETURN_IF_ERROR(m.TrainerState(j["trainer_state"]));
    c.trainer_state = j["trainer_state"];
  }
  FS_ASSIGN_OR_RETURN(const nlohmann::json* files, m.Need(j, "files", "files"));
  if (!files->is_array()) return m.WrongType(*files, "files", "an array");
  std::set<std::string> seen;
  for (size_t i = 0; i < files->size(); ++i) {
    const nlohmann::json& f = (*files)[i];
    const std::string field = absl::StrCat("files[", i, "]");
    FS_RETURN_IF_ERROR(m.Object(f, field));
    FileDigest d;
    FS_ASSIGN_OR_RETURN(const nlohmann::json* name, m.Need(f, "name", field + ".name"));
    FS_ASSIGN_OR_RETURN(d.name, m.String(*name, field + ".name"));
    FS_RETURN_IF_ERROR(m.RelativeName(d.name, field + ".name"));
    if (!seen.insert(d.name).second) {
      return m.Error(field + ".name", absl::StrCat("\"", d.name, "\" is listed twice"));
    }
    FS_ASSIGN_OR_RETURN(const nlohmann::json* bytes, m.Need(f, "bytes", field + ".bytes"));
    FS_ASSIGN_OR_RETURN(d.bytes, m.Unsigned(*bytes, field + ".bytes"));
    FS_ASSIGN_OR_RETURN(const nlohmann::json* fnv, m.Need(f, "fnv1a64", field + ".fnv1a64"));
    FS_ASSIGN_OR_RETURN(d.fnv1a64, m.Hex64(*fnv, field + ".fnv1a64"));
    c.files.push_back(std::move(d));
  }
  if (c.files.empty()) return m.Error("files", "lists no file");
  // rank_files: one file per rank; fsdp_sharded: one shard per rank and the manifest. Exactly
  // those: a name left out, or one of another layout, is named.
  const std::vector<std::string> expected = ExpectedFiles(c.format, c.world_size);
  if (!expected.empty()) {
    const std::string layout =
        absl::StrCat("format ", c.format, " at world_size ", c.world_size, " has ",
                     expected.front(), " .. ", expected.back());
    const std::set<std::string> want(expected.begin(), expected.end());
    for (size_t i = 0; i < c.files.size(); ++i) {
      if (want.count(c.files[i].name) == 0) {
        return m.Error(absl::StrCat("files[", i, "].name"),
                       absl::StrCat("\"", c.files[i].name, "\" is not a file of this checkpoint (",
                                    layout, ")"));
      }
    }
    for (const std::string& name : expected) {
      if (seen.count(name) == 0) {
        return m.Error("files", absl::StrCat(name, " is not listed (", layout, ")"));
      }
    }
  }
  return c;
}

}  // namespace

absl::Status NoCompleteCheckpointError(const std::string& root) {
  return absl::NotFoundError(absl::StrCat(
      "resume: no complete checkpoint (a step_* directory with ", kCompleteName, ") under ", root,
      "; run without --resume to start from step 0, or with --resume=auto to resume only when "
      "there is one"));
}

absl::Status RefuseToOverwriteCheckpoints(const std::string& root) {
  int complete = 0;
  std::string newest;
  for (const auto& [step, dir] : StepDirs(root)) {
    if (!HasComplete(dir)) continue;
    if (complete++ == 0) newest = dir;
  }
  if (complete == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      root, " already holds ", complete, " complete checkpoint", complete == 1 ? "" : "s",
      " (newest ", newest, "), which a run from step 0 would delete: run with --resume to "
      "continue from the newest, with --overwrite_checkpoints to delete them and start from step "
      "0, or with another --out_dir to keep them"));
}

absl::Status WithOlderCheckpointHint(const absl::Status& error, const std::string& root) {
  if (error.ok() || error.code() != absl::StatusCode::kDataLoss) return error;
  std::string newest;
  for (const auto& [step, dir] : StepDirs(root)) {
    if (!HasComplete(dir)) continue;
    if (newest.empty()) {
      newest = dir;
      continue;
    }
    absl::StatusOr<CompleteCheckpoint> c = ParseComplete(dir);
    if (!c.ok() || c->step != step || !VerifyCheckpoint(*c).ok()) continue;
    return absl::Status(
        error.code(),
        absl::StrCat(error.message(), "; the newest intact checkpoint before it is ", dir,
                     " (step ", step, "): to resume from it, move the damaged one aside (mv ",
                     newest, " ", newest, ".damaged) and run with --resume again"));
  }
  return absl::Status(error.code(),
                      absl::StrCat(error.message(), "; no older intact checkpoint is under ", root,
                                   ": start again without --resume (with another --out_dir to "
                                   "keep these files)"));
}

absl::StatusOr<std::optional<CompleteCheckpoint>> FindLatestComplete(const std::string& root) {
  for (const auto& [step, dir] : StepDirs(root)) {
    if (!HasComplete(dir)) continue;
    absl::StatusOr<CompleteCheckpoint> c = ParseComplete(dir);
    if (!c.ok()) return c.status();
    if (c->step != step) {
      return absl::DataLossError(absl::StrCat("corrupt checkpoint marker ", dir, "/",
                                              kCompleteName, ": says step ", c->step));
    }
    return std::optional<CompleteCheckpoint>(*std::move(c));
  }
  return std::optional<CompleteCheckpoint>();
}

absl::Status VerifyCheckpoint(const CompleteCheckpoint& checkpoint) {
  for (const FileDigest& want : checkpoint.files) {
    absl::StatusOr<FileDigest> got = DigestFile(checkpoint.dir, want.name);
    if (!got.ok()) return got.status();
    const std::string path = absl::StrCat(checkpoint.dir, "/", want.name);
    if (got->bytes != want.bytes) {
      return absl::DataLossError(absl::StrCat("checkpoint file ", path, " is corrupt: ",
                                              got->bytes, " bytes, ", kCompleteName, " says ",
                                              want.bytes));
    }
    if (got->fnv1a64 != want.fnv1a64) {
      return absl::DataLossError(absl::StrFormat(
          "checkpoint file %s is corrupt: FNV-1a checksum %016x, %s says %016x", path,
          got->fnv1a64, kCompleteName, want.fnv1a64));
    }
  }
  return absl::OkStatus();
}

absl::Status PruneCheckpoints(const std::string& root, int keep) {
  if (keep < 1) return absl::InvalidArgumentError("PruneCheckpoints: keep must be >= 1");
  int complete_seen = 0;
  for (const auto& [step, dir] : StepDirs(root)) {
    const bool complete = HasComplete(dir);
    bool remove = false;
    if (complete) {
      remove = ++complete_seen > keep;
    } else {
      remove = complete_seen > 0;  // older than a complete one: an interrupted save
    }
    if (!remove) continue;
    std::error_code ec;
    // COMPLETE goes first so that a crash mid-delete never leaves a "complete" partial dir.
    fs::remove(absl::StrCat(dir, "/", kCompleteName), ec);
    fs::remove_all(dir, ec);
    if (ec) return absl::UnavailableError(absl::StrCat("cannot delete ", dir, ": ", ec.message()));
  }
  return absl::OkStatus();
}

absl::Status RemoveCheckpointsAfter(const std::string& root, int64_t step) {
  for (const auto& [s, dir] : StepDirs(root)) {
    if (s <= step) continue;
    std::error_code ec;
    fs::remove(absl::StrCat(dir, "/", kCompleteName), ec);
    fs::remove_all(dir, ec);
    if (ec) return absl::UnavailableError(absl::StrCat("cannot delete ", dir, ": ", ec.message()));
  }
  return absl::OkStatus();
}

}  // namespace fairscale::examples::gpt
