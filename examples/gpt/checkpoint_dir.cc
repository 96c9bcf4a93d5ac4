#include "examples/gpt/checkpoint_dir.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

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
  j["config"] = config;
  j["trainer_state"] = trainer_state;
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

absl::StatusOr<CompleteCheckpoint> ParseComplete(const std::string& dir) {
  const std::string path = absl::StrCat(dir, "/", kCompleteName);
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return text.status();
  nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  CompleteCheckpoint c;
  c.dir = dir;
  try {
    if (j.is_discarded()) throw std::runtime_error("not valid JSON");
    c.step = j.at("step").get<int64_t>();
    c.world_size = j.at("world_size").get<int>();
    c.format = j.value("format", std::string(kFormatRankFiles));
    c.config = j.at("config");
    if (j.contains("trainer_state")) c.trainer_state = j.at("trainer_state");
    for (const nlohmann::json& f : j.at("files")) {
      FileDigest d;
      d.name = f.at("name").get<std::string>();
      d.bytes = f.at("bytes").get<uint64_t>();
      if (!absl::SimpleHexAtoi(f.at("fnv1a64").get<std::string>(), &d.fnv1a64)) {
        throw std::runtime_error("bad fnv1a64");
      }
      c.files.push_back(d);
    }
    // rank_files: one file per rank; fsdp_sharded: one shard per rank and the manifest.
    const int want_files = c.world_size + (c.format == kFormatFsdpSharded ? 1 : 0);
    if ((c.format == kFormatRankFiles || c.format == kFormatFsdpSharded) &&
        static_cast<int>(c.files.size()) != want_files) {
      throw std::runtime_error(absl::StrCat("lists ", c.files.size(), " files for world size ",
                                            c.world_size));
    }
  } catch (const std::exception& e) {
    return absl::DataLossError(
        absl::StrCat("corrupt checkpoint marker ", path, ": ", e.what()));
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
