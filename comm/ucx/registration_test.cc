// Linking //comm/ucx registers "ucx" (catches a lost alwayslink).
#include "comm/registry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::comm {
namespace {

TEST(UcxBackend, IsRegistered) {
  EXPECT_THAT(LinkedBackends(), ::testing::Contains("ucx"));
}

}  // namespace
}  // namespace fairscale::comm
