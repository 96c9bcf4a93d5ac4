// The input layout of offload/fuzz/disk_tier_fuzz.cc, shared with make_corpus.cc (which writes
// the seeds): byte 0 is a control byte, the rest is the offload file itself.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

#include "offload/tier.h"

namespace fairscale::offload::fuzz {

// Control byte, bits 0-1: which expected tensor list Open() is given (see ExpectedSpecs()).
constexpr uint8_t kSpecsMask = 0x03;
// Checksums the harness recomputes before writing the file, so that mutated fields get past them
// (each stored where the file's own header says; a section outside the input is left alone).
constexpr uint8_t kFixHeader = 1 << 2;  // the header's FNV-1a over [0, 112)
constexpr uint8_t kFixLayout = 1 << 3;  // the layout section's FNV-1a (in the header)
constexpr uint8_t kFixTable = 1 << 4;   // the checksum table's FNV-1a (in the header)
constexpr uint8_t kFixChunks = 1 << 5;  // every chunk's FNV-1a in the table, from the data
constexpr uint8_t kFixAll = kFixHeader | kFixLayout | kFixTable | kFixChunks;
// Bits 6-7: the session Open() expects, and whether it verifies every chunk at open.
constexpr uint8_t kSessionShift = 6;
enum class SessionMode : uint8_t {
  kAnyVerifyAll = 0,  // expected_session 0 (any), verify_all
  kExact = 1,         // the file's own session, verify_all
  kStale = 2,         // the file's session + 1, verify_all: must not open
  kAnyLazy = 3,       // expected_session 0, no verify_all (chunks are checked when read)
};

inline uint8_t Control(int specs, uint8_t fix, SessionMode mode) {
  return static_cast<uint8_t>(specs | fix | (static_cast<uint8_t>(mode) << kSessionShift));
}

// The expected lists: 0 two tensors, 1 none, 2 a BFloat16 and an empty tensor, 3 the first of
// list 0 only (a file of list 0 then has one tensor too many).
inline std::vector<TensorSpec> ExpectedSpecs(int which) {
  switch (which & kSpecsMask) {
    case 0:
      return {{"a", c10::kFloat, {3, 5}}, {"b", c10::kDouble, {7}}};
    case 1:
      return {};
    case 2:
      return {{"w", c10::kBFloat16, {5, 3}}, {"e", c10::kFloat, {0}}};
    default:
      return {{"a", c10::kFloat, {3, 5}}};
  }
}

}  // namespace fairscale::offload::fuzz
