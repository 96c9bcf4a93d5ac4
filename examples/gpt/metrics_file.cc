#include "examples/gpt/metrics_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>

#include "absl/strings/str_cat.h"

namespace fairscale::examples::gpt {

nlohmann::json MetricNumber(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  return v;
}

std::optional<double> ReadMetricNumber(const nlohmann::json& v) {
  if (v.is_number()) return v.get<double>();
  if (v.is_null()) return std::numeric_limits<double>::quiet_NaN();
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    if (s == "NaN") return std::numeric_limits<double>::quiet_NaN();
    if (s == "Infinity") return std::numeric_limits<double>::infinity();
    if (s == "-Infinity") return -std::numeric_limits<double>::infinity();
  }
  return std::nullopt;
}

namespace {

// Why `line` cannot be kept ("" when it can); sets *step.
std::string Problem(const std::string& line, nlohmann::json* j, int64_t* step) {
  *j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (j->is_discarded()) return "not valid JSON";
  if (!j->is_object()) return "not a JSON object";
  const auto s = j->find("step");
  if (s == j->end()) return "no \"step\"";
  if (!s->is_number_integer()) return absl::StrCat("\"step\" is not an integer: ", s->dump());
  *step = s->get<int64_t>();
  const auto type = j->find("type");
  if (type != j->end() && !type->is_string()) return "\"type\" is not a string";
  const auto loss = j->find("loss");
  if (loss != j->end() && !ReadMetricNumber(*loss).has_value()) {
    std::string got = loss->dump();
    if (got.size() > 40) got = absl::StrCat(got.substr(0, 37), "...");
    return absl::StrCat("\"loss\" is not a number: ", got);
  }
  return "";
}

}  // namespace

KeptMetrics ReadMetricsForResume(const std::string& path, int64_t keep_through_step) {
  KeptMetrics kept;
  std::ifstream in(path, std::ios::binary);
  if (!in) return kept;
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (line.empty()) continue;
    nlohmann::json j;
    int64_t step = 0;
    const std::string problem = Problem(line, &j, &step);
    if (!problem.empty()) {
      kept.warnings.push_back(
          absl::StrCat(path, ":", number, ": skipped a malformed metrics record (", problem, ")"));
      continue;
    }
    if (step > keep_through_step) continue;
    const std::string type = j.value("type", "");
    if (type == "final" || type == "sample") continue;
    kept.records.push_back(std::move(j));
    absl::StrAppend(&kept.text, line, "\n");
  }
  return kept;
}

absl::Status AppendMetricsRecord(const std::string& path, const nlohmann::json& record,
                                 bool truncate) {
  const std::string line = record.dump() + "\n";
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC |
                                          (truncate ? O_TRUNC : 0), 0644);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot open metrics file ", path, ": ", std::strerror(errno)));
  }
  ssize_t n = 0;
  do {
    n = ::write(fd, line.data(), line.size());
  } while (n < 0 && errno == EINTR);
  const int write_errno = errno;
  ::close(fd);
  if (n != static_cast<ssize_t>(line.size())) {
    return absl::UnavailableError(absl::StrCat(
        "cannot append to metrics file ", path, ": ",
        n < 0 ? std::strerror(write_errno)
              : absl::StrCat("short write, ", n, " of ", line.size(), " bytes")));
  }
  return absl::OkStatus();
}

}  // namespace fairscale::examples::gpt
