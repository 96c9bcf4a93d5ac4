// Fuzz target (libFuzzer's LLVMFuzzerTestOneInput) for the two files of the GPT job that a
// resume reads back and trusts nothing in: a step directory's COMPLETE marker as the job finds it
// (FindLatestCheckpoint: its check for train_gpt's formats from before //train_state, then
// train_state::ReadMarker, then the job's metadata readers) and metrics.jsonl
// (ReadMetricsForResume). The first input byte picks the reader (even: COMPLETE, odd: metrics;
// for metrics it also sets keep_through_step), the rest is the file. Checks, for every input:
// * COMPLETE: either a marker of step 7 (as the directory says) with world_size in
//   [1, kMaxWorldSize] and plain item names, whose metadata readers return a value; or kDataLoss
//   "corrupt checkpoint marker <path>: ..." naming the file; or kFailedPrecondition naming the
//   step directory and the old format. Never a crash or an exception.
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
#include "examples/gpt/checkpoints.h"
#include "examples/gpt/metrics_file.h"
#include "train_state/step_dir.h"

namespace {

namespace gpt = fairscale::examples::gpt;
namespace train_state = fairscale::train_state;

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

void CheckComplete(const uint8_t* data, size_t size) {
  const std::string ckpt = Root() + "/ckpt";
  const std::string step_dir = ckpt + "/step_00000007";
  const std::string marker = step_dir + "/COMPLETE";
  Write(marker, data, size);
  const auto found = gpt::FindLatestCheckpoint(ckpt);
  if (!found.ok()) {
    if (found.status().code() == absl::StatusCode::kFailedPrecondition) {
      FS_FUZZ_CHECK(absl::StartsWith(found.status().message(),
                                     absl::StrCat("checkpoint ", step_dir, " is in train_gpt's format")));
      return;
    }
    FS_FUZZ_CHECK(found.status().code() == absl::StatusCode::kDataLoss);
    FS_FUZZ_CHECK(absl::StartsWith(found.status().message(),
                                   absl::StrCat("corrupt checkpoint marker ", marker)));
    return;
  }
  FS_FUZZ_CHECK(found->has_value());  // the marker exists
  const gpt::LatestCheckpoint& c = **found;
  FS_FUZZ_CHECK(c.dir == step_dir);
  FS_FUZZ_CHECK(c.marker.step == 7);
  FS_FUZZ_CHECK(c.marker.world_size >= 1 && c.marker.world_size <= train_state::kMaxWorldSize);
  for (const auto& [name, item] : c.marker.items) {
    FS_FUZZ_CHECK(train_state::CheckPlainName(name, "item").ok());
  }
  const nlohmann::json config = gpt::MarkerConfig(c.marker);
  FS_FUZZ_CHECK(config.is_null() || c.marker.metadata.contains("config"));
  const std::optional<std::string> hash = gpt::MarkerFullParamHash(c.marker);
  FS_FUZZ_CHECK(!hash.has_value() || c.marker.metadata["full_param_fnv1a64"].is_string());
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
