// The input layout of //pipe/fuzz:wire_fuzz_test (wire_fuzz.cc), shared with make_corpus.cc.
//
// byte 0 (control): bit 0 clear: a boundary message; bit 0 set: one rank's skip declarations.
//   boundary message: 24 bytes of header (int64[3], little-endian), then the layout words
//     (int64 little-endian; a trailing partial word is ignored). Bit 1 set: the receiver
//     expects another message id than the header's (CheckHeader must say kInternal).
//   skip declarations: the rest is the encoding, as DecodeDeclarations receives it.
#pragma once

#include <cstdint>

namespace fairscale::pipe::fuzz {

inline constexpr uint8_t kModeBoundary = 0;
inline constexpr uint8_t kModeDeclarations = 1;
inline constexpr uint8_t kOtherId = 2;

}  // namespace fairscale::pipe::fuzz
