// The input layout of //fsdp/fuzz:sharded_checkpoint_fuzz (shared with make_corpus, which writes
// the seeds in it).
//
//   byte 0: control. bits 0-1: the reader
//             0: ManifestFromJson on the rest,
//             1: ShardFileReader::Open on the rest (one rank file) and Read of every record,
//             2, 3: OpenCheckpointFiles on a directory: the rest is the manifest and the rank
//                files (rank00000.shard, ...), cut at kSeparator;
//           bit 2: the harness writes the true sizes and checksums of the rank files into the
//                  manifest's "files" entries (and, in mode 1, passes the true header checksum),
//                  so mutations get past the checksums to the fields behind them;
//           bit 3: verify_whole_files.
#pragma once

#include <cstdint>
#include <string>

namespace fairscale::fsdp::fuzz {

inline constexpr char kSeparator[] = "\n==FSDP-FUZZ-FILE==\n";
inline constexpr int kMaxRankFiles = 4;

inline constexpr uint8_t kModeManifest = 0;
inline constexpr uint8_t kModeRankFile = 1;
inline constexpr uint8_t kModeDirectory = 2;
inline constexpr uint8_t kFixChecksums = 4;
inline constexpr uint8_t kVerifyWholeFiles = 8;

}  // namespace fairscale::fsdp::fuzz
