#include "launch/line_prefixer.h"

#include <utility>

namespace fairscale::launch {

LinePrefixer::LinePrefixer(std::string prefix, std::function<void(absl::string_view)> sink)
    : prefix_(std::move(prefix)), sink_(std::move(sink)) {}

void LinePrefixer::Emit(absl::string_view line) {
  scratch_.clear();
  scratch_.append(prefix_);
  scratch_.append(line.data(), line.size());
  scratch_.push_back('\n');
  sink_(scratch_);
}

void LinePrefixer::Feed(absl::string_view bytes) {
  while (!bytes.empty()) {
    const size_t nl = bytes.find('\n');
    const size_t take = nl == absl::string_view::npos ? bytes.size() : nl;
    if (partial_.empty() && nl != absl::string_view::npos && take <= kMaxLineBytes) {
      Emit(bytes.substr(0, take));  // The common case: a whole line, no copy into partial_.
      bytes.remove_prefix(take + 1);
      continue;
    }
    const size_t room = kMaxLineBytes - partial_.size();
    if (take > room) {
      partial_.append(bytes.data(), room);
      bytes.remove_prefix(room);
      Emit(partial_);
      partial_.clear();
      continue;
    }
    partial_.append(bytes.data(), take);
    bytes.remove_prefix(take);
    if (nl != absl::string_view::npos) {
      bytes.remove_prefix(1);
      Emit(partial_);
      partial_.clear();
    }
  }
}

void LinePrefixer::Flush() {
  if (partial_.empty()) return;
  Emit(partial_);
  partial_.clear();
}

}  // namespace fairscale::launch
