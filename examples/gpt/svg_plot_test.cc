#include "examples/gpt/svg_plot.h"

#include <cmath>
#include <string>

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

}  // namespace
}  // namespace fairscale::examples::gpt
