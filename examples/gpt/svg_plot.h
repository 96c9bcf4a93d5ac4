// A line chart as a standalone SVG document (//examples/gpt:svg_plot): the GPT job's loss curve
// (train and validation loss against the step). No dependencies; the caller writes the string.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace fairscale::examples::gpt {

struct PlotSeries {
  std::string label;
  std::string color;  // any SVG color, e.g. "#1f77b4"
  std::vector<std::pair<double, double>> points;  // (x, y); non-finite points are skipped
};

// Axes with "nice" ticks covering every point, a polyline per series, a legend, the title and
// the axis labels. Series with one point are drawn as a dot. Empty input gives an empty chart.
std::string LinePlotSvg(const std::vector<PlotSeries>& series, const std::string& title,
                        const std::string& x_label, const std::string& y_label);

// Tick values from lo to hi inclusive, spaced 1, 2 or 5 x 10^k, about `target` of them.
std::vector<double> NiceTicks(double lo, double hi, int target = 6);

}  // namespace fairscale::examples::gpt
