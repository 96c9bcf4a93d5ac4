// The Store contract, run against every implementation: HashStore, FileStore, PrefixStore over a
// HashStore and TCPStore (server and a second client in this process).
//
// Each case gets two handles on one store: `a` and `b` (two FileStore objects on one
// directory, the TCPStore server and a client, two PrefixStores with one prefix), so a value
// written through one must be visible through the other.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/status_matchers.h"
#include "comm/store/file_store.h"
#include "comm/store/hash_store.h"
#include "comm/store/prefix_store.h"
#include "comm/store/store.h"
#include "comm/store/tcp_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/tmp.h"

namespace fairscale::comm {
namespace {

using ::fairscale::base::testing::IsOk;
using ::fairscale::base::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr absl::Duration kShort = absl::Milliseconds(100);
constexpr absl::Duration kLong = absl::Seconds(10);

struct Handles {
  std::shared_ptr<Store> a;
  std::shared_ptr<Store> b;
};

struct StoreKind {
  std::string name;
  std::function<Handles()> make;
};

void PrintTo(const StoreKind& kind, std::ostream* os) { *os << kind.name; }

std::string TempDir() { return fairscale::testing::UniqueTmpPath("file_store"); }

std::vector<StoreKind> Kinds() {
  return {
      {"Hash",
       [] {
         auto s = std::make_shared<HashStore>();
         return Handles{s, s};
       }},
      {"File",
       [] {
         const std::string dir = TempDir();
         auto a = FileStore::Create(dir);
         auto b = FileStore::Create(dir);
         if (!a.ok() || !b.ok()) return Handles{};
         return Handles{std::shared_ptr<Store>(std::move(*a)),
                        std::shared_ptr<Store>(std::move(*b))};
       }},
      {"Prefix",
       [] {
         auto base = std::make_shared<HashStore>();
         return Handles{std::make_shared<PrefixStore>("job", base),
                        std::make_shared<PrefixStore>("job", base)};
       }},
      {"Tcp",
       [] {
         TCPStoreOptions server_options;
         server_options.is_server = true;
         server_options.timeout = kLong;
         auto server = TCPStore::Create(server_options);
         if (!server.ok()) return Handles{};
         TCPStoreOptions client_options;
         client_options.port = (*server)->port();
         client_options.timeout = kLong;
         auto client = TCPStore::Create(client_options);
         if (!client.ok()) return Handles{};
         // The client goes first at teardown (its server must outlive it for a clean close).
         std::shared_ptr<Store> s(std::move(*server));
         std::shared_ptr<Store> c(std::move(*client));
         return Handles{s, c};
       }},
  };
}

class StoreTest : public ::testing::TestWithParam<StoreKind> {
 protected:
  void SetUp() override {
    h_ = GetParam().make();
    ASSERT_NE(h_.a, nullptr) << "could not create a " << GetParam().name << " store";
    ASSERT_NE(h_.b, nullptr);
  }
  void TearDown() override {
    h_.b.reset();
    h_.a.reset();
  }
  Store& a() { return *h_.a; }
  Store& b() { return *h_.b; }

  Handles h_;
};

TEST_P(StoreTest, SetThenGetThroughTheOtherHandle) {
  ASSERT_OK(a().Set("k", "v1"));
  ASSERT_OK_AND_ASSIGN(std::string v, b().Get("k", kShort));
  EXPECT_EQ(v, "v1");
  ASSERT_OK(b().Set("k", "v2"));  // Overwrite.
  ASSERT_OK_AND_ASSIGN(v, a().Get("k", kShort));
  EXPECT_EQ(v, "v2");
  ASSERT_OK(a().Set("empty", ""));
  ASSERT_OK_AND_ASSIGN(v, b().Get("empty", kShort));
  EXPECT_EQ(v, "");
}

TEST_P(StoreTest, AnyKeyBytesWork) {
  const std::vector<std::string> keys = {"a/b/c", "../../etc/passwd", std::string("nul\0key", 7),
                                         "/", ".", "k\n\xff\x80", std::string(200, 'x')};
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_OK(a().Set(keys[i], absl::StrCat("value", i))) << i;
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_OK_AND_ASSIGN(std::string v, b().Get(keys[i], kShort));
    EXPECT_EQ(v, absl::StrCat("value", i));
  }
  // Keys that differ only in a byte past a prefix stay distinct.
  ASSERT_OK_AND_ASSIGN(bool present, a().Check("a/b"));
  EXPECT_FALSE(present);
}

TEST_P(StoreTest, BinaryValueRoundTrips) {
  std::string value(1 << 20, '\0');
  for (size_t i = 0; i < value.size(); ++i) value[i] = static_cast<char>(i * 131 + 7);
  ASSERT_OK(a().Set("blob", value));
  ASSERT_OK_AND_ASSIGN(std::string v, b().Get("blob", kLong));
  EXPECT_TRUE(v == value);
}

TEST_P(StoreTest, GetWaitsForALaterSetFromAnotherThread) {
  const absl::Time start = absl::Now();
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(50));
    ASSERT_OK(b().Set("late", "here"));
  });
  absl::StatusOr<std::string> v = a().Get("late", kLong);
  setter.join();
  ASSERT_OK(v);
  EXPECT_EQ(*v, "here");
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(40));
}

TEST_P(StoreTest, GetTimesOutQuicklyNamingTheKey) {
  const absl::Time start = absl::Now();
  EXPECT_THAT(a().Get("never-set", kShort),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("never-set")));
  const absl::Duration took = absl::Now() - start;
  EXPECT_GE(took, absl::Milliseconds(90));
  EXPECT_LT(took, absl::Seconds(2));
}

TEST_P(StoreTest, ZeroTimeoutGetReturnsAPresentKey) {
  ASSERT_OK(a().Set("there", "yes"));
  ASSERT_OK_AND_ASSIGN(std::string v, b().Get("there", absl::ZeroDuration()));
  EXPECT_EQ(v, "yes");
  EXPECT_THAT(b().Get("not-there", absl::ZeroDuration()),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
}

TEST_P(StoreTest, ParkedGetDoesNotBlockOtherCallsOnTheSameHandle) {
  std::thread waiter([&] {
    absl::StatusOr<std::string> v = a().Get("parked", kLong);
    ASSERT_OK(v);
    EXPECT_EQ(*v, "released");
  });
  absl::SleepFor(absl::Milliseconds(20));
  const absl::Time start = absl::Now();
  ASSERT_OK(a().Set("other", "x"));
  ASSERT_OK_AND_ASSIGN(int64_t n, a().Add("n", 1));
  EXPECT_EQ(n, 1);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  ASSERT_OK(a().Set("parked", "released"));
  waiter.join();
}

TEST_P(StoreTest, ConcurrentAddsSumExactlyAndEachResultIsUnique) {
  constexpr int kThreads = 8;
  constexpr int kAdds = 100;
  std::vector<std::vector<int64_t>> seen(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Store& s = t % 2 == 0 ? a() : b();
      for (int i = 0; i < kAdds; ++i) {
        absl::StatusOr<int64_t> r = s.Add("counter", 1);
        ASSERT_OK(r);
        seen[t].push_back(*r);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  std::vector<int64_t> all;
  for (const auto& s : seen) all.insert(all.end(), s.begin(), s.end());
  std::sort(all.begin(), all.end());
  ASSERT_EQ(all.size(), static_cast<size_t>(kThreads * kAdds));
  for (size_t i = 0; i < all.size(); ++i) ASSERT_EQ(all[i], static_cast<int64_t>(i + 1));
  ASSERT_OK_AND_ASSIGN(std::string v, a().Get("counter", kShort));
  EXPECT_EQ(v, absl::StrCat(kThreads * kAdds));
}

TEST_P(StoreTest, AddSemantics) {
  ASSERT_OK_AND_ASSIGN(int64_t v, a().Add("fresh", 5));
  EXPECT_EQ(v, 5);
  ASSERT_OK_AND_ASSIGN(v, b().Add("fresh", -7));
  EXPECT_EQ(v, -2);
  ASSERT_OK(a().Set("text", "hello"));
  EXPECT_THAT(b().Add("text", 1), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("text")));
  ASSERT_OK(a().Set("big", "9223372036854775807"));
  EXPECT_THAT(a().Add("big", 1), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_P(StoreTest, CompareSetSemantics) {
  // Missing key equals "": the swap happens and creates it.
  ASSERT_OK_AND_ASSIGN(std::string v, a().CompareSet("cas", "", "first"));
  EXPECT_EQ(v, "first");
  // Mismatch: returns the current value and changes nothing.
  ASSERT_OK_AND_ASSIGN(v, b().CompareSet("cas", "wrong", "second"));
  EXPECT_EQ(v, "first");
  ASSERT_OK_AND_ASSIGN(v, a().Get("cas", kShort));
  EXPECT_EQ(v, "first");
  // Match: swaps.
  ASSERT_OK_AND_ASSIGN(v, b().CompareSet("cas", "first", "second"));
  EXPECT_EQ(v, "second");
  // A missing key with a non-empty expectation stays missing.
  ASSERT_OK_AND_ASSIGN(v, a().CompareSet("absent", "something", "x"));
  EXPECT_EQ(v, "");
  ASSERT_OK_AND_ASSIGN(bool present, a().Check("absent"));
  EXPECT_FALSE(present);
}

TEST_P(StoreTest, CompareSetElectsExactlyOneWinner) {
  constexpr int kThreads = 6;
  std::atomic<int> winners{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::string me = absl::StrCat("rank", t);
      absl::StatusOr<std::string> r = (t % 2 ? a() : b()).CompareSet("leader", "", me);
      ASSERT_OK(r);
      if (*r == me) winners.fetch_add(1);
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(winners.load(), 1);
}

TEST_P(StoreTest, DeleteAndCheck) {
  ASSERT_OK_AND_ASSIGN(bool existed, a().Delete("d"));
  EXPECT_FALSE(existed);
  ASSERT_OK(a().Set("d", "1"));
  ASSERT_OK_AND_ASSIGN(bool present, b().Check("d"));
  EXPECT_TRUE(present);
  ASSERT_OK_AND_ASSIGN(existed, b().Delete("d"));
  EXPECT_TRUE(existed);
  ASSERT_OK_AND_ASSIGN(present, a().Check("d"));
  EXPECT_FALSE(present);
  EXPECT_THAT(a().Get("d", absl::Milliseconds(20)),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  // A deleted counter starts again from zero.
  ASSERT_OK(a().Set("d", "41"));
  ASSERT_OK(a().Delete("d"));
  ASSERT_OK_AND_ASSIGN(int64_t n, a().Add("d", 1));
  EXPECT_EQ(n, 1);
}

TEST_P(StoreTest, WaitReturnsOnceEveryKeyExists) {
  ASSERT_OK(a().Set("w1", "x"));
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(30));
    ASSERT_OK(b().Set("w2", "x"));
    absl::SleepFor(absl::Milliseconds(30));
    ASSERT_OK(b().Set("w3", "x"));
  });
  const std::vector<std::string> keys = {"w1", "w2", "w3"};
  EXPECT_OK(a().Wait(keys, kLong));
  setter.join();
  EXPECT_OK(a().Wait({}, kShort));
}

TEST_P(StoreTest, WaitTimesOutNamingTheMissingKeys) {
  ASSERT_OK(a().Set("have", "x"));
  const std::vector<std::string> keys = {"have", "missing-1", "missing-2"};
  const absl::Time start = absl::Now();
  absl::Status s = b().Wait(keys, kShort);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("missing-1")));
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("missing-2")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

TEST_P(StoreTest, KeyAndValueLimitsAreInvalidArgument) {
  const std::string too_long(kMaxStoreKeyBytes + 1, 'k');
  const auto invalid = StatusIs(absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(a().Set(too_long, "v"), invalid);
  EXPECT_THAT(a().Get(too_long, kShort), invalid);
  EXPECT_THAT(a().Add(too_long, 1), invalid);
  EXPECT_THAT(a().CompareSet(too_long, "", "v"), invalid);
  EXPECT_THAT(a().Delete(too_long), invalid);
  EXPECT_THAT(a().Check(too_long), invalid);
  EXPECT_THAT(a().Wait({"ok", too_long}, kShort), invalid);
  EXPECT_THAT(a().Set("", "v"), invalid);
  EXPECT_THAT(a().Get("", kShort), invalid);

  const std::string too_big(kMaxStoreValueBytes + 1, 'v');
  EXPECT_THAT(a().Set("k", too_big), StatusIs(absl::StatusCode::kInvalidArgument,
                                              HasSubstr(absl::StrCat(kMaxStoreValueBytes))));
  EXPECT_THAT(a().CompareSet("k", "", too_big), invalid);
  ASSERT_OK_AND_ASSIGN(bool present, a().Check("k"));
  EXPECT_FALSE(present);

  // Long keys (but within the limit, leaving room for a PrefixStore's prefix) work.
  const std::string long_key(kMaxStoreKeyBytes - 16, 'L');
  const std::string other_long_key = long_key.substr(1) + "M";
  ASSERT_OK(a().Set(long_key, "long"));
  ASSERT_OK(a().Set(other_long_key, "other"));
  ASSERT_OK_AND_ASSIGN(std::string v, b().Get(long_key, kShort));
  EXPECT_EQ(v, "long");
  ASSERT_OK_AND_ASSIGN(int64_t n, b().Add(other_long_key + "n", 3));
  EXPECT_EQ(n, 3);
  ASSERT_OK_AND_ASSIGN(bool existed, b().Delete(long_key));
  EXPECT_TRUE(existed);
  ASSERT_OK_AND_ASSIGN(v, a().Get(other_long_key, kShort));
  EXPECT_EQ(v, "other");
}

INSTANTIATE_TEST_SUITE_P(AllStores, StoreTest, ::testing::ValuesIn(Kinds()),
                         [](const ::testing::TestParamInfo<StoreKind>& info) {
                           return info.param.name;
                         });

TEST(PrefixStore, NamespacesDoNotSeeEachOther) {
  auto base = std::make_shared<HashStore>();
  PrefixStore job1("job1", base);
  PrefixStore job2("job2", base);
  ASSERT_OK(job1.Set("k", "1"));
  ASSERT_OK_AND_ASSIGN(bool present, job2.Check("k"));
  EXPECT_FALSE(present);
  ASSERT_OK_AND_ASSIGN(std::string v, base->Get("job1/k", kShort));
  EXPECT_EQ(v, "1");
}

}  // namespace
}  // namespace fairscale::comm
