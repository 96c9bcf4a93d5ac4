#include "trace/chrome_trace.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include <nlohmann/json.hpp>

namespace fairscale::trace {
namespace {

using nlohmann::json;

double Micros(int64_t ns) { return static_cast<double>(ns) / 1000.0; }
int64_t Nanos(double us) { return static_cast<int64_t>(us * 1000.0 + (us >= 0 ? 0.5 : -0.5)); }

json ArgValue(const Arg::Value& v) {
  if (const int64_t* i = std::get_if<int64_t>(&v)) return *i;
  if (const double* d = std::get_if<double>(&v)) return *d;
  return std::get<std::string>(v);
}

json ToJson(const Event& e) {
  json j;
  j["name"] = e.name;
  j["cat"] = e.category;
  j["ph"] = std::string(1, static_cast<char>(e.phase));
  j["ts"] = e.phase == Phase::kMetadata ? 0.0 : Micros(e.ts_ns);
  if (e.phase == Phase::kComplete) j["dur"] = Micros(e.dur_ns);
  if (e.phase == Phase::kInstant) j["s"] = "t";
  j["pid"] = e.pid;
  j["tid"] = e.tid;
  json args = json::object();
  for (const Arg& a : e.args) args[a.key] = ArgValue(a.value);
  j["args"] = std::move(args);
  return j;
}

absl::Status WriteFileAtomically(const std::string& path, const std::string& text) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) {
    return absl::InternalError(
        absl::StrCat("trace: cannot create '", tmp, "': ", std::strerror(errno)));
  }
  const bool wrote = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const int write_errno = errno;
  const bool closed = std::fclose(f) == 0;
  if (!wrote || !closed) {
    std::remove(tmp.c_str());
    return absl::InternalError(absl::StrCat("trace: writing '", tmp, "' failed: ",
                                            std::strerror(wrote ? errno : write_errno)));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    return absl::InternalError(absl::StrCat("trace: renaming '", tmp, "' to '", path,
                                            "' failed: ", std::strerror(err)));
  }
  return absl::OkStatus();
}

// The parsed "traceEvents" array of `path`.
absl::StatusOr<json> ReadEventsArray(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("trace: cannot open '", path, "'"));
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  json doc = json::parse(buffer.str(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    return absl::DataLossError(absl::StrCat("trace: '", path, "' is not valid JSON"));
  }
  if (!doc.is_object() || !doc.contains("traceEvents") || !doc["traceEvents"].is_array()) {
    return absl::DataLossError(
        absl::StrCat("trace: '", path, "' is not a JSON object with a \"traceEvents\" array"));
  }
  return std::move(doc["traceEvents"]);
}

absl::Status EventError(const std::string& path, size_t index, absl::string_view what) {
  return absl::DataLossError(absl::StrCat("trace: '", path, "' event ", index, ": ", what));
}

}  // namespace

std::string RankTracePath(const std::string& path, int rank) {
  return absl::StrCat(path, ".rank", rank);
}

std::string ToChromeTraceJson(const std::vector<Event>& events) {
  json array = json::array();
  for (const Event& e : events) array.push_back(ToJson(e));
  json doc;
  doc["traceEvents"] = std::move(array);
  doc["displayTimeUnit"] = "ms";
  return doc.dump();
}

absl::Status WriteChromeTrace(const std::string& path, const std::vector<Event>& events) {
  for (size_t i = 0; i < events.size(); ++i) {
    if (events[i].dur_ns < 0) {
      return absl::InvalidArgumentError(absl::StrCat("trace: writing '", path, "': event ", i,
                                                     " ('", events[i].name,
                                                     "') has negative duration ",
                                                     events[i].dur_ns, " ns"));
    }
  }
  return WriteFileAtomically(path, ToChromeTraceJson(events));
}

absl::StatusOr<std::vector<Event>> ReadChromeTrace(const std::string& path) {
  absl::StatusOr<json> array = ReadEventsArray(path);
  if (!array.ok()) return array.status();
  std::vector<Event> events;
  events.reserve(array->size());
  for (size_t i = 0; i < array->size(); ++i) {
    const json& j = (*array)[i];
    if (!j.is_object()) return EventError(path, i, "not a JSON object");
    for (const char* key : {"name", "ph", "ts", "pid", "tid"}) {
      if (!j.contains(key)) return EventError(path, i, absl::StrCat("missing \"", key, "\""));
    }
    if (!j["name"].is_string() || !j["ph"].is_string() || j["ph"].get<std::string>().size() != 1 ||
        !j["ts"].is_number() || !j["pid"].is_number_integer() || !j["tid"].is_number_integer()) {
      return EventError(path, i, "name/ph must be strings, ts a number, pid/tid integers");
    }
    Event e;
    const char ph = j["ph"].get<std::string>()[0];
    switch (ph) {
      case 'X': e.phase = Phase::kComplete; break;
      case 'i': case 'I': e.phase = Phase::kInstant; break;
      case 'C': e.phase = Phase::kCounter; break;
      case 'M': e.phase = Phase::kMetadata; break;
      default: return EventError(path, i, absl::StrCat("unsupported phase '", std::string(1, ph),
                                                       "'"));
    }
    e.name = j["name"].get<std::string>();
    if (j.contains("cat") && j["cat"].is_string()) e.category = j["cat"].get<std::string>();
    e.ts_ns = Nanos(j["ts"].get<double>());
    if (e.phase == Phase::kComplete) {
      if (!j.contains("dur") || !j["dur"].is_number()) {
        return EventError(path, i, "complete event without a numeric \"dur\"");
      }
      e.dur_ns = Nanos(j["dur"].get<double>());
      if (e.dur_ns < 0) return EventError(path, i, "negative \"dur\"");
    }
    e.pid = j["pid"].get<int>();
    e.tid = j["tid"].get<int>();
    if (j.contains("args") && j["args"].is_object()) {
      for (const auto& [key, value] : j["args"].items()) {
        if (value.is_number_integer()) {
          e.args.emplace_back(key, value.get<int64_t>());
        } else if (value.is_number()) {
          e.args.emplace_back(key, value.get<double>());
        } else if (value.is_string()) {
          e.args.emplace_back(key, value.get<std::string>());
        } else {
          e.args.emplace_back(key, value.dump());
        }
      }
    }
    events.push_back(std::move(e));
  }
  return events;
}

absl::Status MergeChromeTraces(const std::vector<std::string>& inputs, const std::string& output) {
  json merged = json::array();
  std::set<int> pids_before;  // pids of the inputs already merged
  for (const std::string& input : inputs) {
    absl::StatusOr<json> array = ReadEventsArray(input);
    if (!array.ok()) return array.status();
    std::set<int> pids;
    for (size_t i = 0; i < array->size(); ++i) {
      const json& j = (*array)[i];
      if (!j.is_object() || !j.contains("pid") || !j["pid"].is_number_integer()) {
        return EventError(input, i, "not an object with an integer \"pid\"");
      }
      const int pid = j["pid"].get<int>();
      if (pids_before.count(pid) != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("trace: merging into '", output, "': '", input, "' holds pid (rank) ",
                         pid, ", which an earlier input already holds"));
      }
      pids.insert(pid);
      merged.push_back(j);
    }
    pids_before.insert(pids.begin(), pids.end());
  }
  json doc;
  doc["traceEvents"] = std::move(merged);
  doc["displayTimeUnit"] = "ms";
  return WriteFileAtomically(output, doc.dump());
}

}  // namespace fairscale::trace
