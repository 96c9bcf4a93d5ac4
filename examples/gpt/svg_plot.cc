#include "examples/gpt/svg_plot.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"

namespace fairscale::examples::gpt {
namespace {

std::string Escape(const std::string& s) {
  return absl::StrReplaceAll(s, {{"&", "&amp;"}, {"<", "&lt;"}, {">", "&gt;"}, {"\"", "&quot;"}});
}

std::string TickLabel(double v, double step) {
  const int decimals = step >= 1 ? 0 : static_cast<int>(std::ceil(-std::log10(step)));
  return absl::StrFormat("%.*f", decimals, v);
}

}  // namespace

std::vector<std::string> WrapText(const std::string& text, size_t max_chars, size_t max_lines) {
  max_chars = std::max<size_t>(max_chars, 4);
  max_lines = std::max<size_t>(max_lines, 1);
  std::vector<std::string> lines;
  std::string line;
  size_t i = 0;
  while (i < text.size()) {
    // The next word, with the spaces before it.
    size_t j = text.find(' ', text.find_first_not_of(' ', i));
    if (j == std::string::npos) j = text.size();
    std::string word = text.substr(i, j - i);
    if (line.empty()) word.erase(0, word.find_first_not_of(' '));
    if (line.size() + word.size() <= max_chars) {
      line += word;
      i = j;
      continue;
    }
    if (!line.empty()) {  // the word starts the next line
      lines.push_back(line);
      line.clear();
      continue;
    }
    // A word longer than a line: cut it.
    line = word.substr(0, max_chars);
    i += (j - i) - (word.size() - max_chars);
    lines.push_back(line);
    line.clear();
  }
  if (!line.empty()) lines.push_back(line);
  for (std::string& l : lines) l.erase(l.find_last_not_of(' ') + 1);
  if (lines.size() > max_lines) {
    lines.resize(max_lines);
    std::string& last = lines.back();
    if (last.size() + 3 > max_chars) last.resize(max_chars - 3);
    last += "...";
  }
  return lines;
}

std::vector<double> NiceTicks(double lo, double hi, int target) {
  if (!(hi > lo)) return {lo};
  const double raw = (hi - lo) / std::max(1, target - 1);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  // The 1-2-5 step whose tick count is nearest the target.
  double step = mag, best = INFINITY;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    const double count = (hi - lo) / (m * mag) + 1;
    if (std::abs(count - target) < best) best = std::abs(count - target), step = m * mag;
  }
  std::vector<double> ticks;
  for (double v = std::floor(lo / step) * step; v <= hi + step * 1e-9; v += step) {
    if (v >= lo - step * 1e-9) ticks.push_back(std::abs(v) < step * 1e-9 ? 0.0 : v);
  }
  return ticks;
}

std::string LinePlotSvg(const std::vector<PlotSeries>& series, const std::string& title,
                        const std::string& x_label, const std::string& y_label) {
  // The title wraps onto up to kTitleLines lines of at most w / kTitleCharWidth characters
  // (a conservative width per character of a sans-serif font), the plot moving down for each.
  const double w = 720, left = 70, right = 20, bottom = 60;
  const std::vector<std::string> title_lines = WrapText(
      title, static_cast<size_t>((w - 2 * kTitleMargin) / (kTitleFontSize * kTitleCharWidth)),
      kTitleLines);
  const double title_h = 20.0 * std::max<size_t>(1, title_lines.size());
  const double top = 20 + title_h, h = 420 + title_h;
  double x0 = std::numeric_limits<double>::infinity(), x1 = -x0, y0 = x0, y1 = -x0;
  for (const PlotSeries& s : series) {
    for (const auto& [x, y] : s.points) {
      if (!std::isfinite(x) || !std::isfinite(y)) continue;
      x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
    }
  }
  if (!std::isfinite(x0)) x0 = 0, x1 = 1, y0 = 0, y1 = 1;
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) y1 = y0 + 1;
  // Widen the ranges to whole ticks so the frame starts and ends on a labelled tick (twice:
  // widening can change the step).
  std::vector<double> xt, yt;
  double xs = 1, ys = 1;
  for (int pass = 0; pass < 2; ++pass) {
    xt = NiceTicks(x0, x1), yt = NiceTicks(y0, y1);
    xs = xt.size() > 1 ? xt[1] - xt[0] : 1, ys = yt.size() > 1 ? yt[1] - yt[0] : 1;
    x0 = std::floor(x0 / xs + 1e-9) * xs, x1 = std::ceil(x1 / xs - 1e-9) * xs;
    y0 = std::floor(y0 / ys + 1e-9) * ys, y1 = std::ceil(y1 / ys - 1e-9) * ys;
  }
  xt = NiceTicks(x0, x1), yt = NiceTicks(y0, y1);
  xs = xt.size() > 1 ? xt[1] - xt[0] : 1, ys = yt.size() > 1 ? yt[1] - yt[0] : 1;
  const double pw = w - left - right, ph = h - top - bottom;
  auto px = [&](double x) { return left + (x - x0) / (x1 - x0) * pw; };
  auto py = [&](double y) { return top + ph - (y - y0) / (y1 - y0) * ph; };

  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%g\" height=\"%g\" "
      "viewBox=\"0 0 %g %g\" font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
      w, h, w, h);
  for (size_t i = 0; i < title_lines.size(); ++i) {
    absl::StrAppendFormat(
        &svg, "<text x=\"%g\" y=\"%g\" text-anchor=\"middle\" font-size=\"%g\">%s</text>\n", w / 2,
        24.0 + 20.0 * static_cast<double>(i), kTitleFontSize, Escape(title_lines[i]));
  }
  for (double v : yt) {
    absl::StrAppendFormat(&svg,
                          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n"
                          "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n",
                          left, py(v), left + pw, py(v), left - 6, py(v) + 4,
                          TickLabel(v, ys));
  }
  for (double v : xt) {
    absl::StrAppendFormat(&svg,
                          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n"
                          "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n",
                          px(v), top, px(v), top + ph, px(v), top + ph + 18, TickLabel(v, xs));
  }
  absl::StrAppendFormat(&svg,
                        "<rect x=\"%g\" y=\"%g\" width=\"%g\" height=\"%g\" fill=\"none\" "
                        "stroke=\"black\"/>\n",
                        left, top, pw, ph);
  absl::StrAppendFormat(&svg, "<text x=\"%g\" y=\"%g\" text-anchor=\"middle\">%s</text>\n",
                        left + pw / 2, h - 16, Escape(x_label));
  absl::StrAppendFormat(&svg,
                        "<text x=\"16\" y=\"%g\" text-anchor=\"middle\" "
                        "transform=\"rotate(-90 16 %g)\">%s</text>\n",
                        top + ph / 2, top + ph / 2, Escape(y_label));
  int legend = 0;
  for (const PlotSeries& s : series) {
    std::string pts;
    int n = 0;
    for (const auto& [x, y] : s.points) {
      if (!std::isfinite(x) || !std::isfinite(y)) continue;
      absl::StrAppendFormat(&pts, "%s%.1f,%.1f", n++ ? " " : "", px(x), py(y));
    }
    if (n == 1) {
      absl::StrAppendFormat(&svg, "<circle cx=\"%s\" r=\"3\" fill=\"%s\"/>\n",
                            absl::StrReplaceAll(pts, {{",", "\" cy=\""}}), s.color);
    } else if (n > 1) {
      absl::StrAppendFormat(&svg,
                            "<polyline points=\"%s\" fill=\"none\" stroke=\"%s\" "
                            "stroke-width=\"1.5\"/>\n",
                            pts, s.color);
    }
    const double ly = top + 16 + 18 * legend++;
    absl::StrAppendFormat(&svg,
                          "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"%s\" "
                          "stroke-width=\"3\"/><text x=\"%g\" y=\"%g\">%s</text>\n",
                          left + pw - 150, ly, left + pw - 126, ly, s.color, left + pw - 120,
                          ly + 4, Escape(s.label));
  }
  svg += "</svg>\n";
  return svg;
}

}  // namespace fairscale::examples::gpt
