// Fuzz target (libFuzzer's LLVMFuzzerTestOneInput) of the CheckpointManager's COMPLETE marker
// reader (MarkerFromJson, //train_state:step_dir): the bytes a restore trusts nothing in. For
// every input: no crash, no sanitizer report, no exception; an error is kDataLoss starting with
// "corrupt checkpoint marker <path>: "; a marker that parses obeys the documented bounds (step
// >= 0, world size in [1, kMaxWorldSize], plain item names, file paths of plain names inside the
// item's directory, no file listed twice in an
// item, metadata an object) and survives MarkerToJson -> MarkerFromJson unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <set>
#include <string>

#include "absl/strings/match.h"
#include "base/fuzz_check.h"
#include "train_state/step_dir.h"

namespace ts = fairscale::train_state;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = "ckpt/step_00000007/COMPLETE";
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<ts::Marker> m = ts::MarkerFromJson(text, path);
  if (!m.ok()) {
    if (m.status().code() != absl::StatusCode::kDataLoss ||
        !absl::StartsWith(m.status().message(), "corrupt checkpoint marker " + path + ": ")) {
      std::fprintf(stderr, "unexpected status: %s\n", m.status().ToString().c_str());
      FS_FUZZ_CHECK(false);
    }
    return 0;
  }
  FS_FUZZ_CHECK(m->step >= 0);
  FS_FUZZ_CHECK(m->world_size >= 1 && m->world_size <= ts::kMaxWorldSize);
  FS_FUZZ_CHECK(m->metadata.is_object());
  for (const auto& [name, item] : m->items) {
    FS_FUZZ_CHECK(ts::CheckPlainName(name, "item").ok());
    std::set<std::string> names;
    for (const ts::FileDigest& f : item.files) {
      FS_FUZZ_CHECK(ts::CheckRelativePath(f.name, "file").ok());
      FS_FUZZ_CHECK(names.insert(f.name).second);
    }
  }
  const std::string json = ts::MarkerToJson(*m);
  absl::StatusOr<ts::Marker> again = ts::MarkerFromJson(json, path);
  if (!again.ok()) {
    std::fprintf(stderr, "round trip failed: %s\n", again.status().ToString().c_str());
    FS_FUZZ_CHECK(false);
  }
  FS_FUZZ_CHECK(ts::MarkerToJson(*again) == json);
  return 0;
}
