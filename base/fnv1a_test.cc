#include "base/fnv1a.h"

#include <gtest/gtest.h>

#include <cstring>

namespace fairscale::base {
namespace {

// Reference values of 64-bit FNV-1a (Fowler/Noll/Vo test vectors).
TEST(Fnv1aTest, KnownValues) {
  EXPECT_EQ(Fnv1a64("", 0), 0xcbf29ce484222325ULL);
  EXPECT_EQ(Fnv1a64("a", 1), 0xaf63dc4c8601ec8cULL);
  EXPECT_EQ(Fnv1a64("foobar", 6), 0x85944171f73967e8ULL);
}

TEST(Fnv1aTest, HashesInPieces) {
  const char* s = "offload tier chunk";
  const size_t n = std::strlen(s);
  EXPECT_EQ(Fnv1a64(s + 7, n - 7, Fnv1a64(s, 7)), Fnv1a64(s, n));
}

}  // namespace
}  // namespace fairscale::base
