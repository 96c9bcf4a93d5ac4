// Linking //comm/inproc must register the backend (catches a lost alwayslink = 1).
#include "comm/registry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::comm {
namespace {

TEST(InprocRegistration, IsLinked) { EXPECT_THAT(LinkedBackends(), ::testing::Contains("inproc")); }

}  // namespace
}  // namespace fairscale::comm
