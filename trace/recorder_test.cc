// Recorder, Scope and the Chrome trace files: thread safety, the disabled path, the JSON format,
// round trips, merging and atomic writes.
#include "trace/recorder.h"

#include <dirent.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/tmp.h"
#include <nlohmann/json.hpp>
#include "trace/chrome_trace.h"

namespace fairscale::trace {
namespace {

using ::fairscale::base::testing::StatusIs;
using ::fairscale::testing::TmpPath;
using ::testing::HasSubstr;
using nlohmann::json;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<std::string> ListDir(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) names.emplace_back(e->d_name);
    closedir(d);
  }
  return names;
}

std::vector<Event> NonMetadata(const std::vector<Event>& events) {
  std::vector<Event> out;
  for (const Event& e : events) {
    if (e.phase != Phase::kMetadata) out.push_back(e);
  }
  return out;
}

// The checks a viewer relies on, on the parsed JSON of a trace file.
void ExpectValidChromeTrace(const json& doc) {
  ASSERT_TRUE(doc.is_object());
  ASSERT_TRUE(doc.contains("traceEvents"));
  ASSERT_TRUE(doc["traceEvents"].is_array());
  EXPECT_EQ(doc["displayTimeUnit"], "ms");
  for (const json& e : doc["traceEvents"]) {
    for (const char* key : {"ph", "ts", "pid", "tid", "name"}) {
      ASSERT_TRUE(e.contains(key)) << key << " missing in " << e.dump();
    }
    EXPECT_TRUE(e["ts"].is_number()) << e.dump();
    EXPECT_TRUE(e["pid"].is_number_integer()) << e.dump();
    EXPECT_TRUE(e["tid"].is_number_integer()) << e.dump();
    const std::string ph = e["ph"];
    EXPECT_THAT(ph, ::testing::AnyOf("X", "i", "C", "M")) << e.dump();
    if (ph == "X") {
      ASSERT_TRUE(e.contains("dur")) << e.dump();
      EXPECT_GE(e["dur"].get<double>(), 0.0) << e.dump();
    }
    if (ph == "M") {
      ASSERT_TRUE(e["args"].contains("name") || e["args"].contains("sort_index")) << e.dump();
    }
  }
}

TEST(Recorder, ConcurrentThreadsRecordEverySpanOnTheirOwnTrack) {
  Recorder recorder(3);
  constexpr int kThreads = 8;
  constexpr int kSpans = 400;
  std::vector<std::thread> threads;
  std::vector<int> tids(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&recorder, &tids, t] {
      tids[t] = Recorder::CurrentThreadId();
      recorder.SetThreadName(absl::StrCat("worker ", t));
      for (int i = 0; i < kSpans; ++i) {
        Scope s(recorder, "step", kCategoryCompute, {Arg("thread", t), Arg("i", i)});
        if (i % 50 == 0) recorder.Counter("memory_mb", static_cast<double>(i));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  const std::vector<Event> events = recorder.Events();
  std::map<int, std::vector<const Event*>> by_tid;
  int counters = 0;
  std::set<std::string> thread_names;
  for (const Event& e : events) {
    EXPECT_EQ(e.pid, 3);
    if (e.phase == Phase::kComplete) by_tid[e.tid].push_back(&e);
    if (e.phase == Phase::kCounter) ++counters;
    if (e.phase == Phase::kMetadata && e.name == "thread_name") {
      thread_names.insert(e.StringArg("name"));
    }
  }
  EXPECT_EQ(counters, kThreads * (kSpans / 50));
  ASSERT_EQ(by_tid.size(), static_cast<size_t>(kThreads));
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_EQ(by_tid.count(tids[t]), 1u);
    const std::vector<const Event*>& spans = by_tid[tids[t]];
    ASSERT_EQ(spans.size(), static_cast<size_t>(kSpans));
    // Sorted by time, in program order, never overlapping on one thread.
    for (int i = 0; i < kSpans; ++i) {
      EXPECT_EQ(spans[i]->IntArg("thread", -1), t);
      EXPECT_EQ(spans[i]->IntArg("i", -1), i);
      if (i > 0) { EXPECT_GE(spans[i]->ts_ns, spans[i - 1]->ts_ns + spans[i - 1]->dur_ns); }
    }
    EXPECT_EQ(thread_names.count(absl::StrCat("worker ", t)), 1u);
  }
}

TEST(Recorder, DisabledRecordsNothingAndCanBeTurnedOn) {
  Recorder recorder(1, /*enabled=*/false);
  EXPECT_FALSE(recorder.enabled());
  {
    Scope s(recorder, "forward");
    Scope null_scope(nullptr, "forward");
  }
  recorder.Complete("x", kCategoryCompute, 0, 10);
  recorder.Instant("mark", "app");
  recorder.Counter("memory_mb", 1.0);
  EXPECT_TRUE(NonMetadata(recorder.Events()).empty());

  recorder.set_enabled(true);
  { Scope s(recorder, "backward"); }
  recorder.Instant("mark", "app", {Arg("step", 2)});
  const std::vector<Event> events = NonMetadata(recorder.Events());
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].name, "backward");
  EXPECT_EQ(events[0].category, "compute");
  EXPECT_EQ(events[0].pid, 1);
  EXPECT_EQ(events[1].phase, Phase::kInstant);
  EXPECT_EQ(events[1].IntArg("step"), 2);

  recorder.Clear();
  EXPECT_TRUE(NonMetadata(recorder.Events()).empty());
}

TEST(Recorder, LanesAreReusedLowestFirstAndNamed) {
  Recorder recorder(0);
  const int a = recorder.AcquireLane();
  const int b = recorder.AcquireLane();
  EXPECT_EQ(a, kFirstLaneTid);
  EXPECT_EQ(b, kFirstLaneTid + 1);
  recorder.ReleaseLane(a);
  EXPECT_EQ(recorder.AcquireLane(), kFirstLaneTid);
  EXPECT_EQ(recorder.AcquireLane(), kFirstLaneTid + 2);
  std::map<int, std::string> names;
  for (const Event& e : recorder.Events()) {
    if (e.name == "thread_name") names[e.tid] = e.StringArg("name");
  }
  EXPECT_EQ(names[kFirstLaneTid], "comm");
  EXPECT_EQ(names[kFirstLaneTid + 1], "comm 2");
  EXPECT_EQ(names[kFirstLaneTid + 2], "comm 3");
}

TEST(ChromeTrace, WritesTheTraceEventFormatAndReadsItBack) {
  Recorder recorder(2);
  recorder.SetThreadName("main");
  recorder.Complete("forward", kCategoryCompute, 1'000'000'500, 1'000'002'000,
                    {Arg("layer", 3), Arg("note", "a \"quoted\" name"), Arg("ratio", 0.25)});
  recorder.Complete("all_gather", kCategoryComm, 1'000'001'000, 1'000'001'000,
                    {Arg("bytes", int64_t{1} << 40)}, kFirstLaneTid);
  recorder.Complete("backwards", kCategoryCompute, 50, 40);  // end < start: zero length
  recorder.Counter("memory_mb", 12.5);
  recorder.Instant("step_end", "app");
  const std::string path = TmpPath("format.json");
  ASSERT_OK(recorder.WriteChromeTrace(path));

  const json doc = json::parse(ReadAll(path));
  ExpectValidChromeTrace(doc);
  bool saw_process_name = false, saw_main = false, saw_forward = false, saw_gather = false;
  for (const json& e : doc["traceEvents"]) {
    EXPECT_EQ(e["pid"], 2);
    if (e["ph"] == "M" && e["name"] == "process_name") {
      saw_process_name = true;
      EXPECT_EQ(e["args"]["name"], "rank 2");
    }
    if (e["ph"] == "M" && e["name"] == "thread_name" && e["args"]["name"] == "main") {
      saw_main = true;
      EXPECT_EQ(e["tid"], Recorder::CurrentThreadId());
    }
    if (e["name"] == "forward") {
      saw_forward = true;
      EXPECT_EQ(e["ph"], "X");
      EXPECT_EQ(e["cat"], "compute");
      EXPECT_DOUBLE_EQ(e["ts"].get<double>(), 1000000.5);  // microseconds
      EXPECT_DOUBLE_EQ(e["dur"].get<double>(), 1.5);
      EXPECT_EQ(e["args"]["layer"], 3);
      EXPECT_EQ(e["args"]["note"], "a \"quoted\" name");
      EXPECT_DOUBLE_EQ(e["args"]["ratio"].get<double>(), 0.25);
    }
    if (e["name"] == "all_gather") {
      saw_gather = true;
      EXPECT_EQ(e["args"]["bytes"].get<int64_t>(), int64_t{1} << 40);
      EXPECT_EQ(e["tid"], kFirstLaneTid);
    }
    if (e["name"] == "backwards") { EXPECT_EQ(e["dur"].get<double>(), 0.0); }
    if (e["ph"] == "i") { EXPECT_EQ(e["s"], "t"); }
    if (e["ph"] == "C") { EXPECT_DOUBLE_EQ(e["args"]["memory_mb"].get<double>(), 12.5); }
  }
  EXPECT_TRUE(saw_process_name && saw_main && saw_forward && saw_gather);

  ASSERT_OK_AND_ASSIGN(std::vector<Event> back, ReadChromeTrace(path));
  const std::vector<Event> original = recorder.Events();
  ASSERT_EQ(back.size(), original.size());
  for (size_t i = 0; i < back.size(); ++i) {
    EXPECT_EQ(back[i].name, original[i].name);
    EXPECT_EQ(back[i].phase, original[i].phase);
    EXPECT_EQ(back[i].pid, original[i].pid);
    EXPECT_EQ(back[i].tid, original[i].tid);
    EXPECT_EQ(back[i].dur_ns, original[i].dur_ns);
    if (original[i].phase != Phase::kMetadata) { EXPECT_EQ(back[i].ts_ns, original[i].ts_ns); }
    EXPECT_EQ(back[i].args.size(), original[i].args.size());
  }
}

TEST(ChromeTrace, WriteIsAtomicAndReportsTheFile) {
  const std::string dir = TmpPath("atomic");
  ASSERT_EQ(system(absl::StrCat("mkdir -p ", dir).c_str()), 0);
  const std::string path = dir + "/t.json";
  {
    std::ofstream old(path);
    old << "old contents";
  }
  Recorder recorder(0);
  recorder.Complete("forward", kCategoryCompute, 0, 1000);
  ASSERT_OK(recorder.WriteChromeTrace(path));
  EXPECT_TRUE(json::parse(ReadAll(path)).is_object());  // replaced as a whole
  for (const std::string& name : ListDir(dir)) {
    EXPECT_FALSE(absl::StrContains(name, ".tmp")) << name;  // no temporary left behind
  }
  EXPECT_THAT(WriteChromeTrace(dir + "/missing/t.json", recorder.Events()),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("missing/t.json")));
  Event bad;
  bad.name = "bad";
  bad.dur_ns = -1;
  EXPECT_THAT(WriteChromeTrace(path, {bad}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("negative duration")));
  EXPECT_TRUE(json::parse(ReadAll(path)).is_object());  // the failed write left it alone
}

TEST(ChromeTrace, ReadRejectsMissingAndCorruptFiles) {
  EXPECT_THAT(ReadChromeTrace(TmpPath("nope.json")),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope.json")));
  const std::string corrupt = TmpPath("corrupt.json");
  std::ofstream(corrupt) << "{\"traceEvents\": [";
  EXPECT_THAT(ReadChromeTrace(corrupt),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("corrupt.json")));
  const std::string no_ts = TmpPath("no_ts.json");
  std::ofstream(no_ts) << R"({"traceEvents": [{"name": "a", "ph": "X", "pid": 0, "tid": 1}]})";
  EXPECT_THAT(ReadChromeTrace(no_ts),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("event 0: missing \"ts\"")));
}

TEST(ChromeTrace, MergesRankFilesIntoOneTrackPerRank) {
  const std::string path = TmpPath("merged.json");
  std::vector<std::string> inputs;
  size_t total = 0;
  for (int rank = 0; rank < 2; ++rank) {
    Recorder recorder(rank);
    recorder.SetThreadName("main");
    recorder.Complete("forward", kCategoryCompute, 1000 * rank, 1000 * rank + 500);
    recorder.Complete("all_reduce", kCategoryComm, 1000 * rank + 100, 1000 * rank + 900,
                      {Arg("bytes", 64 * (rank + 1))}, kFirstLaneTid);
    inputs.push_back(RankTracePath(path, rank));
    EXPECT_EQ(inputs.back(), absl::StrCat(path, ".rank", rank));
    ASSERT_OK(recorder.WriteChromeTrace(inputs.back()));
    total += recorder.Events().size();
  }
  ASSERT_OK(MergeChromeTraces(inputs, path));
  const json doc = json::parse(ReadAll(path));
  ExpectValidChromeTrace(doc);
  EXPECT_EQ(doc["traceEvents"].size(), total);
  std::map<int, std::string> process_names;
  std::map<int, int64_t> bytes;
  for (const json& e : doc["traceEvents"]) {
    if (e["name"] == "process_name") process_names[e["pid"]] = e["args"]["name"];
    if (e["cat"] == "comm") bytes[e["pid"]] += e["args"]["bytes"].get<int64_t>();
  }
  EXPECT_EQ(process_names, (std::map<int, std::string>{{0, "rank 0"}, {1, "rank 1"}}));
  EXPECT_EQ(bytes, (std::map<int, int64_t>{{0, 64}, {1, 128}}));

  EXPECT_THAT(MergeChromeTraces({inputs[0], inputs[0]}, path),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pid (rank) 0")));
  EXPECT_THAT(MergeChromeTraces({inputs[0], TmpPath("absent.rank1")}, path),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("absent.rank1")));
  EXPECT_EQ(json::parse(ReadAll(path))["traceEvents"].size(), total);  // failed merges wrote nothing
}

}  // namespace
}  // namespace fairscale::trace
