// Rank-prefixed logging over glog (the logger LibTorch itself links).
//
//   fairscale::base::SetLogRank(rank, size);      // once per process, after rendezvous
//   FS_LOG(INFO) << "connected";                  // -> "I1130 ... file.cc:12] [rank 2/4] connected"
//   FS_VLOG(1) << "detail";
//
// A thread that plays one rank among several in a process (the thread rank runner) uses
// ScopedLogRank; its prefix wins over the process-wide one on that thread.
#pragma once

#include <string>

#include "glog/logging.h"

namespace fairscale::base {

// Sets the process-wide rank shown in every FS_LOG line. size < 0 clears it.
void SetLogRank(int rank, int size);

// "[rank N] " for a program's own stderr lines, or "" when a launcher already prefixes every
// output line of this process (FS_OUTPUT_PREFIXED=1, set by //launch), so lines never carry the
// prefix twice.
std::string OutputRankPrefix(int rank);

// Overrides the rank for the current thread while alive.
class ScopedLogRank {
 public:
  ScopedLogRank(int rank, int size);
  ~ScopedLogRank();
  ScopedLogRank(const ScopedLogRank&) = delete;
  ScopedLogRank& operator=(const ScopedLogRank&) = delete;

 private:
  int prev_rank_;
  int prev_size_;
};

// "[rank r/n] " or "" when no rank is set.
std::string LogPrefix();

}  // namespace fairscale::base

#define FS_LOG(severity) LOG(severity) << ::fairscale::base::LogPrefix()
#define FS_VLOG(level) VLOG(level) << ::fairscale::base::LogPrefix()
