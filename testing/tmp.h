// Paths for the files a test writes: under $TEST_TMPDIR (Bazel gives each test its own), or
// /tmp outside Bazel. Nothing is created or removed here.
#pragma once

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace fairscale::testing {

// $TEST_TMPDIR (else /tmp).
inline std::string TmpDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

// "<TmpDir()>/<name>": the same path for the same name (a test that writes it twice overwrites).
inline std::string TmpPath(absl::string_view name) { return absl::StrCat(TmpDir(), "/", name); }

// "<TmpDir()>/<prefix>_<pid>_<n>", n counting the calls in this process: a path no other call
// in this process (and no other process) returns, for a test that needs a fresh one each time.
inline std::string UniqueTmpPath(absl::string_view prefix) {
  static std::atomic<int> counter{0};
  return absl::StrCat(TmpDir(), "/", prefix, "_", getpid(), "_", counter.fetch_add(1));
}

}  // namespace fairscale::testing
