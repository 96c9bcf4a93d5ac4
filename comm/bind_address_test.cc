#include "comm/bind_address.h"

#include <string>

#include "base/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::comm {
namespace {

using ::fairscale::base::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(BindAddress, LoopbackInterface) {
  ASSERT_OK_AND_ASSIGN(std::string address, InterfaceIpv4Address("lo"));
  EXPECT_EQ(address, "127.0.0.1");
  bool listed = false;
  for (const auto& [name, ipv4] : ListInterfaces()) listed |= name == "lo" && ipv4 == "127.0.0.1";
  EXPECT_TRUE(listed);
}

TEST(BindAddress, UnknownInterfaceListsTheOthers) {
  EXPECT_THAT(InterfaceIpv4Address("fs_nosuch0"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("no interface named 'fs_nosuch0'"),
                             HasSubstr("interfaces: "), HasSubstr("lo 127.0.0.1"))));
  BindAddressInputs in;
  in.socket_ifname = "fs_nosuch0";
  in.master_addr = "127.0.0.1";
  EXPECT_THAT(ChooseBindAddress(in),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("FS_SOCKET_IFNAME='fs_nosuch0'"), HasSubstr("lo"))));
}

TEST(BindAddress, RouteTowardLoopback) {
  ASSERT_OK_AND_ASSIGN(std::string source, SourceAddressToward("127.0.0.1"));
  EXPECT_EQ(source, "127.0.0.1");
  EXPECT_TRUE(IsLoopbackHost("127.0.0.1"));
  EXPECT_TRUE(IsLoopbackHost("127.0.0.2"));
  EXPECT_TRUE(IsLoopbackHost("localhost"));
  EXPECT_FALSE(IsLoopbackHost("10.77.0.1"));
  EXPECT_FALSE(IsLoopbackHost("fs-no-such-host.invalid"));
  EXPECT_THAT(SourceAddressToward("fs-no-such-host.invalid"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cannot resolve")));
}

// The route toward an address of this host's own (non-loopback) interface starts from it: what a
// rank on rank 0's host advertises when MASTER_ADDR is that host's address.
TEST(BindAddress, RouteTowardAnAddressOfThisHost) {
  int checked = 0;
  for (const auto& [name, ipv4] : ListInterfaces()) {
    if (ipv4.empty() || ipv4.rfind("127.", 0) == 0) continue;
    ASSERT_OK_AND_ASSIGN(std::string source, SourceAddressToward(ipv4));
    EXPECT_EQ(source, ipv4) << name;
    BindAddressInputs in;
    in.master_addr = ipv4;
    ASSERT_OK_AND_ASSIGN(BindAddressChoice choice, ChooseBindAddress(in));
    EXPECT_EQ(choice.address, ipv4) << name;
    EXPECT_EQ(choice.interface, "");
    in.single_node = true;  // every rank here: loopback as before
    ASSERT_OK_AND_ASSIGN(choice, ChooseBindAddress(in));
    EXPECT_EQ(choice.address, "127.0.0.1");
    ++checked;
  }
  if (checked == 0) GTEST_SKIP() << "no interface with a non-loopback IPv4 address here";
}

TEST(BindAddress, Choice) {
  BindAddressInputs in;
  ASSERT_OK_AND_ASSIGN(BindAddressChoice choice, ChooseBindAddress(in));
  EXPECT_EQ(choice.address, "127.0.0.1");  // no MASTER_ADDR
  in.master_addr = "localhost";
  ASSERT_OK_AND_ASSIGN(choice, ChooseBindAddress(in));
  EXPECT_EQ(choice.address, "127.0.0.1");
  EXPECT_THAT(choice.reason, HasSubstr("loopback"));
  in.socket_ifname = "lo";
  ASSERT_OK_AND_ASSIGN(choice, ChooseBindAddress(in));
  EXPECT_EQ(choice.address, "127.0.0.1");
  EXPECT_EQ(choice.interface, "lo");
  EXPECT_EQ(choice.reason, "FS_SOCKET_IFNAME=lo");
}

}  // namespace
}  // namespace fairscale::comm
