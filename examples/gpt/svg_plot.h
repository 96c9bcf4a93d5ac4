// A line chart as a standalone SVG document (//examples/gpt:svg_plot): the GPT job's loss curve
// (train and validation loss against the step). No dependencies; the caller writes the string.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace fairscale::examples::gpt {

struct PlotSeries {
  std::string label;
  std::string color;  // any SVG color, e.g. "#1f77b4"
  std::vector<std::pair<double, double>> points;  // (x, y); non-finite points are skipped
};

// The title's font size, the widest a character of it is taken to be (times the font size; a
// sans-serif font's widest common glyphs, 'M' and 'W', are about 0.9, its average about 0.55), the
// margin it keeps from each side of the canvas, and the most lines it wraps onto.
inline constexpr double kTitleFontSize = 15;
inline constexpr double kTitleCharWidth = 0.65;
inline constexpr double kTitleMargin = 10;
inline constexpr size_t kTitleLines = 3;

// Axes with "nice" ticks covering every point, a polyline per series, a legend, the title
// (wrapped at spaces onto up to kTitleLines lines that fit the canvas; longer titles end in
// "...") and the axis labels. Series with one point are drawn as a dot. Empty input gives an
// empty chart.
std::string LinePlotSvg(const std::vector<PlotSeries>& series, const std::string& title,
                        const std::string& x_label, const std::string& y_label);

// `text` in lines of at most max_chars characters, broken at spaces (a longer word is cut), at
// most max_lines of them: the last ends in "..." when text did not fit.
std::vector<std::string> WrapText(const std::string& text, size_t max_chars, size_t max_lines);

// Tick values from lo to hi inclusive, spaced 1, 2 or 5 x 10^k, about `target` of them.
std::vector<double> NiceTicks(double lo, double hi, int target = 6);

}  // namespace fairscale::examples::gpt
