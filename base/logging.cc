#include "base/logging.h"

#include <cstdlib>

#include <atomic>

#include "absl/strings/str_cat.h"

namespace fairscale::base {
namespace {
std::atomic<int> g_rank{-1};
std::atomic<int> g_size{-1};
thread_local int t_rank = -1;
thread_local int t_size = -1;
}  // namespace

std::string OutputRankPrefix(int rank) {
  const char* prefixed = std::getenv("FS_OUTPUT_PREFIXED");
  if (prefixed != nullptr && std::string(prefixed) == "1") return "";
  return "[rank " + std::to_string(rank) + "] ";
}

void SetLogRank(int rank, int size) {
  g_rank.store(rank);
  g_size.store(size);
}

ScopedLogRank::ScopedLogRank(int rank, int size) : prev_rank_(t_rank), prev_size_(t_size) {
  t_rank = rank;
  t_size = size;
}

ScopedLogRank::~ScopedLogRank() {
  t_rank = prev_rank_;
  t_size = prev_size_;
}

std::string LogPrefix() {
  int rank = t_rank, size = t_size;
  if (size < 0) {
    rank = g_rank.load();
    size = g_size.load();
  }
  if (size < 0) return "";
  return absl::StrCat("[rank ", rank, "/", size, "] ");
}

}  // namespace fairscale::base
