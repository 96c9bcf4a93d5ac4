#include "examples/gpt/svg_plot.h"

#include <cmath>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::examples::gpt {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

TEST(NiceTicksTest, OneTwoFiveSteps) {
  EXPECT_THAT(NiceTicks(0, 300), ElementsAre(0, 50, 100, 150, 200, 250, 300));
  EXPECT_THAT(NiceTicks(1.2, 4.4), ElementsAre(1.5, 2.0, 2.5, 3.0, 3.5, 4.0));
  EXPECT_THAT(NiceTicks(0, 1, 3), ElementsAre(0, 0.5, 1));
  EXPECT_THAT(NiceTicks(5, 5), ElementsAre(5));
}

TEST(LinePlotSvgTest, DrawsEverySeriesWithLegendAndEscapedText) {
  PlotSeries train{"train loss", "#1f77b4", {{1, 4.2}, {2, 3.1}, {3, 2.5}}};
  PlotSeries val{"val <loss>", "#d62728", {{3, 2.7}}};
  PlotSeries nan{"skipped", "black", {{1, NAN}}};
  const std::string svg = LinePlotSvg({train, val, nan}, "GPT & co", "step", "loss");
  EXPECT_THAT(svg, HasSubstr("<svg xmlns=\"http://www.w3.org/2000/svg\""));
  EXPECT_THAT(svg, HasSubstr("</svg>"));
  EXPECT_THAT(svg, HasSubstr("<polyline points=\""));  // train: 3 points
  EXPECT_THAT(svg, HasSubstr("<circle cx=\""));         // val: 1 point
  EXPECT_THAT(svg, HasSubstr("GPT &amp; co"));
  EXPECT_THAT(svg, HasSubstr("val &lt;loss&gt;"));
  EXPECT_THAT(svg, Not(HasSubstr("nan")));
  EXPECT_THAT(svg, HasSubstr(">step<"));
}

TEST(LinePlotSvgTest, EmptyInputIsAValidEmptyChart) {
  const std::string svg = LinePlotSvg({}, "t", "x", "y");
  EXPECT_THAT(svg, HasSubstr("</svg>"));
  EXPECT_THAT(svg, Not(HasSubstr("polyline")));
}

TEST(WrapTextTest, BreaksAtSpacesCutsLongWordsAndEndsWithDotsWhenTooLong) {
  EXPECT_THAT(WrapText("a bb ccc dddd", 6, 3), ElementsAre("a bb", "ccc", "dddd"));
  EXPECT_THAT(WrapText("short", 10, 1), ElementsAre("short"));
  EXPECT_THAT(WrapText("abcdefghij", 4, 5), ElementsAre("abcd", "efgh", "ij"));
  EXPECT_THAT(WrapText("one two three four", 9, 1), ElementsAre("one tw..."));
  EXPECT_THAT(WrapText("", 10, 2), ElementsAre());
}

// The title's <text> lines (font-size 15) of an SVG, unescaped enough to count characters.
std::vector<std::string> TitleLines(const std::string& svg) {
  std::vector<std::string> lines;
  const std::string open = "font-size=\"15\">";
  for (size_t at = svg.find(open); at != std::string::npos; at = svg.find(open, at + 1)) {
    const size_t begin = at + open.size();
    std::string line = svg.substr(begin, svg.find("</text>", begin) - begin);
    for (const char* entity : {"&amp;", "&lt;", "&gt;", "&quot;"}) {
      for (size_t e = line.find(entity); e != std::string::npos; e = line.find(entity)) {
        line.replace(e, std::string(entity).size(), "x");
      }
    }
    lines.push_back(line);
  }
  return lines;
}

// Every title line fits the 720-pixel canvas at a conservative 0.65 em per character (a
// sans-serif font's average is about 0.55 em; digits and capitals, common here, about 0.65).
void ExpectTitleFits(const std::string& title) {
  const std::string svg = LinePlotSvg({PlotSeries{"train loss", "#1f77b4", {{1, 4.0}, {2, 3.0}}}},
                                      title, "step", "loss");
  ASSERT_THAT(svg, HasSubstr("width=\"720\""));
  const std::vector<std::string> lines = TitleLines(svg);
  ASSERT_FALSE(lines.empty()) << svg;
  EXPECT_LE(lines.size(), 3u);
  std::string joined;
  for (const std::string& line : lines) {
    EXPECT_LE(line.size() * 15 * 0.65, 720 - 2 * 10) << "title line too wide: " << line;
    joined += (joined.empty() ? "" : " ") + line;
  }
  if (joined.size() >= 3 && joined.compare(joined.size() - 3, 3, "...") == 0) return;
  EXPECT_EQ(joined, title);  // nothing lost when it fits in three lines
}

TEST(LinePlotSvgTest, TheLongestTitleOfTheJobFitsTheCanvas) {
  // trainer.cc: "GPT <blocks>x<width> on KJV Genesis+Exodus, <world> ranks, <mode>, <precision>";
  // the longest mode is a pipeline's (pipe_model.cc). The default 4 blocks give 6 layers: at
  // most 6 (virtual) stages, interleaved, FSDP inside the stages, the longest strategy name.
  ExpectTitleFits(
      "GPT 4x128 on KJV Genesis+Exodus, 12 ranks, pipe 3 stages x 2 virtual (layers "
      "1+1+1+1+1+1) x 4 replicas (FSDP SHARD_GRAD_OP), interleaved, 24 micro-batches, bf16");
  // Pipeline mode with 64 blocks in 66 stages: far longer than three lines; ends in "...".
  std::string balance = "1";
  for (int i = 1; i < 66; ++i) balance += "+1";
  ExpectTitleFits("GPT 64x1024 on KJV Genesis+Exodus, 1056 ranks, pipe 66 stages (layers " +
                  balance + ") x 16 replicas (FSDP SHARD_GRAD_OP), 1f1b, 128 micro-batches, bf16");
  // The unpipelined title stays on one line, as before.
  const std::string svg = LinePlotSvg(
      {}, "GPT 4x128 on KJV Genesis+Exodus, 2 ranks, full_shard, bf16", "step", "loss");
  EXPECT_EQ(TitleLines(svg).size(), 1u);
  EXPECT_THAT(svg, HasSubstr("height=\"440\""));
}

}  // namespace
}  // namespace fairscale::examples::gpt
