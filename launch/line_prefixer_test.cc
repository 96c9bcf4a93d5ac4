#include "launch/line_prefixer.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::launch {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

class Collector {
 public:
  LinePrefixer Make(const std::string& prefix) {
    return LinePrefixer(prefix, [this](absl::string_view s) { out.emplace_back(s); });
  }
  std::vector<std::string> out;
};

TEST(LinePrefixer, PrefixesEveryCompleteLine) {
  Collector c;
  LinePrefixer p = c.Make("[rank 2] ");
  p.Feed("a\nbb\n\nccc\n");
  EXPECT_THAT(c.out, ElementsAre("[rank 2] a\n", "[rank 2] bb\n", "[rank 2] \n", "[rank 2] ccc\n"));
  EXPECT_EQ(p.buffered(), 0u);
}

TEST(LinePrefixer, JoinsLinesSplitAcrossReadsWhateverTheChunking) {
  const std::string input = "first line\nsecond\nthird is longer\nno newline";
  for (size_t chunk = 1; chunk <= input.size(); ++chunk) {
    Collector c;
    LinePrefixer p = c.Make("> ");
    for (size_t i = 0; i < input.size(); i += chunk) p.Feed(input.substr(i, chunk));
    EXPECT_THAT(c.out, ElementsAre("> first line\n", "> second\n", "> third is longer\n"))
        << "chunk " << chunk;
    p.Flush();
    EXPECT_EQ(c.out.back(), "> no newline\n") << "chunk " << chunk;
    EXPECT_EQ(c.out.size(), 4u);
  }
}

TEST(LinePrefixer, FlushOfNothingEmitsNothing) {
  Collector c;
  LinePrefixer p = c.Make("x ");
  p.Flush();
  p.Feed("done\n");
  p.Flush();
  EXPECT_THAT(c.out, ElementsAre("x done\n"));
}

TEST(LinePrefixer, AnOverlongLineIsCutIntoBoundedPieces) {
  Collector c;
  LinePrefixer p = c.Make("");
  const std::string big(2 * LinePrefixer::kMaxLineBytes + 10, 'z');
  p.Feed(big.substr(0, 100));
  EXPECT_THAT(c.out, IsEmpty());
  p.Feed(big.substr(100));
  p.Feed("\n");
  ASSERT_EQ(c.out.size(), 3u);
  EXPECT_EQ(c.out[0], std::string(LinePrefixer::kMaxLineBytes, 'z') + "\n");
  EXPECT_EQ(c.out[1], std::string(LinePrefixer::kMaxLineBytes, 'z') + "\n");
  EXPECT_EQ(c.out[2], "zzzzzzzzzz\n");
  EXPECT_LE(p.buffered(), LinePrefixer::kMaxLineBytes);
}

}  // namespace
}  // namespace fairscale::launch
