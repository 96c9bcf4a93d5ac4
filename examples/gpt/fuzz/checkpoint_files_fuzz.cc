// Fuzz target (libFuzzer's LLVMFuzzerTestOneInput) for the two files of the GPT job that a
// resume reads back and trusts nothing in: a step directory's COMPLETE marker
// (FindLatestComplete) and metrics.jsonl (ReadMetricsForResume). The first input byte picks the
// reader (even: COMPLETE, odd: metrics; for metrics it also sets keep_through_step), the rest is
// the file. Checks, for every input:
// * COMPLETE: either a checkpoint whose every field obeys the documented bounds (step as the
//   directory says, world_size in [1, kMaxWorldSize], a non-empty list of distinct relative
//   names inside the step directory, exactly the format's files for the known formats), or
//   kDataLoss "corrupt checkpoint marker <path>: ..." naming the file. Never a crash.
// * metrics: every kept record is an object with an integer step <= keep_through_step that is
//   not a "final" or "sample" record; the kept text has one line per record; every warning
//   names the file and a line number that exists; kept + warned <= the non-empty lines.
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/fuzz_check.h"
#include "examples/gpt/checkpoint_dir.h"
#include "examples/gpt/metrics_file.h"

namespace {

namespace gpt = fairscale::examples::gpt;

const std::string& Root() {
  static const std::string root = [] {
    const char* tmp = std::getenv("TEST_TMPDIR");
    std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/fs_ckpt_fuzz_", getpid());
    std::filesystem::create_directories(dir + "/ckpt/step_00000007");
    return dir;
  }();
  return root;
}

void Write(const std::string& path, const uint8_t* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
}

bool InsideStepDir(const std::string& name) {
  if (name.empty() || name[0] == '/') return false;
  for (absl::string_view part : absl::StrSplit(name, '/')) {
    if (part.empty() || part == "." || part == "..") return false;
  }
  return name.find('\0') == std::string::npos;
}

void CheckComplete(const uint8_t* data, size_t size) {
  const std::string ckpt = Root() + "/ckpt";
  const std::string marker = ckpt + "/step_00000007/COMPLETE";
  Write(marker, data, size);
  const auto found = gpt::FindLatestComplete(ckpt);
  if (!found.ok()) {
    FS_FUZZ_CHECK(found.status().code() == absl::StatusCode::kDataLoss);
    FS_FUZZ_CHECK(absl::StartsWith(found.status().message(),
                                   absl::StrCat("corrupt checkpoint marker ", marker)));
    return;
  }
  FS_FUZZ_CHECK(found->has_value());  // the marker exists
  const gpt::CompleteCheckpoint& c = **found;
  FS_FUZZ_CHECK(c.step == 7);
  FS_FUZZ_CHECK(c.world_size >= 1 && c.world_size <= gpt::kMaxWorldSize);
  FS_FUZZ_CHECK(!c.files.empty());
  std::set<std::string> names;
  for (const gpt::FileDigest& f : c.files) {
    FS_FUZZ_CHECK(InsideStepDir(f.name));
    FS_FUZZ_CHECK(names.insert(f.name).second);
  }
  if (c.format == gpt::kFormatRankFiles) {
    const std::vector<std::string> want = gpt::RankFileNames(c.world_size);
    FS_FUZZ_CHECK(names == std::set<std::string>(want.begin(), want.end()));
  } else if (c.format == gpt::kFormatFsdpSharded) {
    FS_FUZZ_CHECK(names.size() == static_cast<size_t>(c.world_size) + 1);
    FS_FUZZ_CHECK(names.count(gpt::kShardManifestName) == 1);
    for (int r = 0; r < c.world_size; ++r) FS_FUZZ_CHECK(names.count(gpt::ShardFileName(r)) == 1);
  }
}

void CheckMetrics(int64_t keep, const uint8_t* data, size_t size) {
  const std::string path = Root() + "/metrics.jsonl";
  Write(path, data, size);
  const gpt::KeptMetrics kept = gpt::ReadMetricsForResume(path, keep);
  const std::string text(reinterpret_cast<const char*>(data), size);
  const std::vector<std::string> lines = absl::StrSplit(text, '\n');
  size_t nonempty = 0;
  for (const std::string& l : lines) nonempty += l.empty() ? 0 : 1;
  FS_FUZZ_CHECK(kept.records.size() + kept.warnings.size() <= nonempty);
  size_t text_lines = 0;
  for (char ch : kept.text) text_lines += ch == '\n' ? 1 : 0;
  FS_FUZZ_CHECK(text_lines == kept.records.size());
  for (const auto& r : kept.records) {
    FS_FUZZ_CHECK(r.is_object());
    const auto step = r.find("step");
    FS_FUZZ_CHECK(step != r.end() && step->is_number_integer());
    FS_FUZZ_CHECK(step->get<int64_t>() <= keep);
    const std::string type = r.value("type", std::string());
    FS_FUZZ_CHECK(type != "final" && type != "sample");
  }
  for (const std::string& w : kept.warnings) {
    FS_FUZZ_CHECK(absl::StartsWith(w, path + ":"));
    int64_t line = 0;
    const std::string rest = w.substr(path.size() + 1);
    FS_FUZZ_CHECK(absl::SimpleAtoi(rest.substr(0, rest.find(':')), &line));
    FS_FUZZ_CHECK(line >= 1 && static_cast<size_t>(line) <= lines.size());
    FS_FUZZ_CHECK(absl::StrContains(w, "skipped a malformed metrics record"));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t selector = data[0];
  if (selector % 2 == 0) {
    CheckComplete(data + 1, size - 1);
  } else {
    CheckMetrics(static_cast<int64_t>(selector / 2) - 16, data + 1, size - 1);
  }
  return 0;
}
