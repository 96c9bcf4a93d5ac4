// Runs the demo job (2 and 3 rank threads) and checks the merged file the way a viewer reads it:
// every event has ph/ts/pid/tid/name, durations are non-negative, one pid per rank with its
// process_name metadata, "main" and "comm" threads named, every collective carries its bytes, and
// each rank has the phases and collectives the demo issued.
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/tmp.h"
#include <nlohmann/json.hpp>
#include "trace/internal/demo.h"

namespace fairscale::trace::internal {
namespace {

using ::fairscale::base::testing::StatusIs;
using ::fairscale::testing::TmpPath;
using ::testing::HasSubstr;
using nlohmann::json;

TEST(TraceDemo, WritesAValidMergedTraceAndAProfileTable) {
  for (int ranks : {2, 3}) {
    DemoOptions options;
    options.ranks = ranks;
    options.steps = 2;
    options.compute_rounds = 4;
    options.trace_path = TmpPath(absl::StrCat("demo", ranks, ".json"));
    ASSERT_OK_AND_ASSIGN(std::string table, RunDemo(options));

    std::ifstream in(options.trace_path);
    std::stringstream text;
    text << in.rdbuf();
    const json doc = json::parse(text.str());
    ASSERT_TRUE(doc.is_object());
    ASSERT_TRUE(doc["traceEvents"].is_array());
    std::map<int, std::string> process_names;
    std::map<int, std::set<std::string>> thread_names, phases;
    std::map<int, std::map<std::string, int>> collectives;
    for (const json& e : doc["traceEvents"]) {
      for (const char* key : {"ph", "ts", "pid", "tid", "name"}) {
        ASSERT_TRUE(e.contains(key)) << key << " missing in " << e.dump();
      }
      ASSERT_TRUE(e["ts"].is_number()) << e.dump();
      const int pid = e["pid"];
      const std::string ph = e["ph"], name = e["name"];
      if (ph == "X") {
        ASSERT_TRUE(e["dur"].is_number()) << e.dump();
        EXPECT_GE(e["dur"].get<double>(), 0.0) << e.dump();
      }
      if (ph == "M" && name == "process_name") process_names[pid] = e["args"]["name"];
      if (ph == "M" && name == "thread_name") thread_names[pid].insert(e["args"]["name"].get<std::string>());
      if (ph == "X" && e["cat"] == "compute") phases[pid].insert(name);
      if (ph == "X" && e["cat"] == "comm") {
        ASSERT_TRUE(e["args"].contains("bytes") && e["args"]["bytes"].is_number_integer())
            << e.dump();
        ++collectives[pid][name];
        if (name == "all_gather") {
          EXPECT_EQ(e["args"]["bytes"].get<int64_t>(), int64_t{ranks} * (1 << 14) * 4);
        }
      }
    }
    ASSERT_EQ(process_names.size(), static_cast<size_t>(ranks));
    for (int r = 0; r < ranks; ++r) {
      EXPECT_EQ(process_names[r], absl::StrCat("rank ", r));
      EXPECT_EQ(thread_names[r].count("main"), 1u) << "rank " << r;
      EXPECT_EQ(thread_names[r].count("comm"), 1u) << "rank " << r;
      EXPECT_EQ(phases[r], (std::set<std::string>{"forward", "backward", "optimizer"}));
      EXPECT_EQ(collectives[r],
                (std::map<std::string, int>{{"all_gather", 2}, {"reduce_scatter", 2},
                                            {"all_reduce", 2}}))
          << "rank " << r;
    }
    // One table row per rank, below the header.
    std::vector<std::string> lines = absl::StrSplit(table, '\n');
    ASSERT_GT(lines.size(), static_cast<size_t>(ranks));
    EXPECT_THAT(lines[0], HasSubstr("compute %"));
    for (int r = 0; r < ranks; ++r) {
      std::vector<std::string> cells = absl::StrSplit(lines[1 + r], ' ', absl::SkipEmpty());
      ASSERT_EQ(cells.size(), 8u) << lines[1 + r];
      EXPECT_EQ(cells[0], absl::StrCat(r));
      EXPECT_EQ(cells[6], "6");  // collectives
    }
  }
}

TEST(TraceDemo, RejectsBadOptions) {
  DemoOptions options;
  options.ranks = 0;
  EXPECT_THAT(RunDemo(options), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ranks")));
}

}  // namespace
}  // namespace fairscale::trace::internal
