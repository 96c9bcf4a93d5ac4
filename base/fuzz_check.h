// FS_FUZZ_CHECK (//base:fuzz_check): the assertion of our fuzz targets (comm/store/fuzz,
// comm/fuzz). It aborts, which libFuzzer records as a crash with the input, and works the same
// in the gcc-built replay tests, which have no gtest.
#pragma once

#include <cstdio>
#include <cstdlib>

#define FS_FUZZ_CHECK(cond)                                                        \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                \
    }                                                                              \
  } while (0)
