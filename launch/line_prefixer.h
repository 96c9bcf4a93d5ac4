// LinePrefixer (//launch:line_prefixer): cuts a byte stream into lines and hands each line,
// prefixed (fs_launch uses "[rank 3] "), to a sink. fs_launch keeps one per rank and stream.
#pragma once

#include <cstddef>
#include <functional>
#include <string>

#include "absl/strings/string_view.h"

namespace fairscale::launch {

class LinePrefixer {
 public:
  // A line longer than this without a newline is emitted in pieces of this size (so a rank
  // that prints megabytes without '\n' cannot grow the launcher's memory).
  static constexpr size_t kMaxLineBytes = 64 << 10;

  // `sink` receives prefix + line + "\n" as one string per line.
  LinePrefixer(std::string prefix, std::function<void(absl::string_view)> sink);

  // Emits every line completed by `bytes`; keeps the unfinished rest.
  void Feed(absl::string_view bytes);
  // Emits the unfinished rest, if any, as a last line (with a '\n' added).
  void Flush();

  size_t buffered() const { return partial_.size(); }

 private:
  void Emit(absl::string_view line);

  const std::string prefix_;
  const std::function<void(absl::string_view)> sink_;
  std::string partial_;
  std::string scratch_;
};

}  // namespace fairscale::launch
