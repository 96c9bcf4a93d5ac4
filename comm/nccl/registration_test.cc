// Under --config=cuda, linking //comm/nccl registers "nccl" (catches a lost alwayslink); without
// the config the target is empty and registers nothing.
#include "comm/registry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::comm {
namespace {

TEST(NcclBackend, RegisteredOnlyUnderCudaConfig) {
#ifdef FS_COMM_NCCL_BUILT
  EXPECT_THAT(LinkedBackends(), ::testing::ElementsAre("nccl"));
#else
  EXPECT_THAT(LinkedBackends(), ::testing::IsEmpty());
#endif
}

}  // namespace
}  // namespace fairscale::comm
