// The metrics file's numbers and its reading on resume (metrics_file.h): NaN and infinities are
// written in a form that reads back as themselves; bad lines are skipped with a warning naming
// the file and line.
#include "examples/gpt/metrics_file.h"

#include <unistd.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/tmp.h"

namespace fairscale::examples::gpt {
namespace {

using ::testing::ElementsAre;

constexpr double kInf = std::numeric_limits<double>::infinity();

TEST(MetricsFile, NonFiniteNumbersRoundTripThroughText) {
  for (double v : {1.25, -3.0, 0.0, kInf, -kInf, std::nan("")}) {
    SCOPED_TRACE(v);
    const std::string text = nlohmann::json{{"loss", MetricNumber(v)}}.dump();
    const std::optional<double> back = ReadMetricNumber(nlohmann::json::parse(text)["loss"]);
    ASSERT_TRUE(back.has_value()) << text;
    if (std::isnan(v)) {
      EXPECT_TRUE(std::isnan(*back));
    } else {
      EXPECT_EQ(*back, v);
    }
  }
  const nlohmann::json inf = {{"loss", MetricNumber(kInf)}};
  const nlohmann::json nan = {{"loss", MetricNumber(std::nan(""))}};
  EXPECT_EQ(inf.dump(), R"({"loss":"Infinity"})");
  EXPECT_EQ(nan.dump(), R"({"loss":"NaN"})");
  // What nlohmann wrote for a NaN before (null) reads as NaN; other values are not numbers.
  EXPECT_TRUE(std::isnan(*ReadMetricNumber(nlohmann::json())));
  EXPECT_FALSE(ReadMetricNumber("fast").has_value());
  EXPECT_FALSE(ReadMetricNumber(nlohmann::json::array()).has_value());
}

TEST(MetricsFile, ResumeKeepsGoodRecordsAndNamesEachSkippedLine) {
  const std::string path = fairscale::testing::TmpPath(absl::StrCat("metrics_", getpid(), ".jsonl"));
  {
    std::ofstream out(path);
    out << R"({"type":"train","step":1,"loss":2.5})" << "\n"          // 1: kept
        << R"({"type":"train","step":2,"loss":null})" << "\n"         // 2: kept (NaN)
        << R"({"type":"val","step":2,"loss":"Infinity"})" << "\n"     // 3: kept (inf)
        << "garbage{" << "\n"                                         // 4: skipped
        << R"({"type":"train","step":"3","loss":1})" << "\n"          // 5: skipped
        << R"({"type":"train","step":3,"loss":"fast"})" << "\n"       // 6: skipped
        << "\n"                                                       // 7: empty, ignored
        << R"([1,2])" << "\n"                                         // 8: skipped
        << R"({"type":"train","step":4,"loss":1.0})" << "\n"          // 9: after the step
        << R"({"type":"final","step":2})" << "\n"                     // 10: a resume drops it
        << R"({"type":"train","step":2,"lo)";                         // 11: torn last line
  }
  const KeptMetrics kept = ReadMetricsForResume(path, 3);
  ASSERT_EQ(kept.records.size(), 3u);
  EXPECT_EQ(kept.records[0]["loss"], 2.5);
  EXPECT_TRUE(std::isnan(*ReadMetricNumber(kept.records[1]["loss"])));
  EXPECT_EQ(*ReadMetricNumber(kept.records[2]["loss"]), kInf);
  EXPECT_EQ(kept.text,
            "{\"type\":\"train\",\"step\":1,\"loss\":2.5}\n"
            "{\"type\":\"train\",\"step\":2,\"loss\":null}\n"
            "{\"type\":\"val\",\"step\":2,\"loss\":\"Infinity\"}\n");
  EXPECT_THAT(
      kept.warnings,
      ElementsAre(path + ":4: skipped a malformed metrics record (not valid JSON)",
                  path + ":5: skipped a malformed metrics record (\"step\" is not an integer: \"3\")",
                  path + ":6: skipped a malformed metrics record (\"loss\" is not a number: \"fast\")",
                  path + ":8: skipped a malformed metrics record (not a JSON object)",
                  path + ":11: skipped a malformed metrics record (not valid JSON)"));
  EXPECT_TRUE(ReadMetricsForResume(path + ".absent", 3).records.empty());
  EXPECT_TRUE(ReadMetricsForResume(path + ".absent", 3).warnings.empty());
}

}  // namespace
}  // namespace fairscale::examples::gpt
