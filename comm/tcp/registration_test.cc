// Linking //comm/tcp registers "tcp" (catches a lost alwayslink).
#include "comm/registry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::comm {
namespace {

TEST(TcpBackend, IsRegistered) {
  EXPECT_THAT(LinkedBackends(), ::testing::Contains("tcp"));
}

}  // namespace
}  // namespace fairscale::comm
