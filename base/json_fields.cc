#include "base/json_fields.h"

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace fairscale::base {

absl::Status JsonFields::Error(absl::string_view field, absl::string_view what) const {
  return absl::DataLossError(absl::StrCat(prefix_, field, ": ", what));
}

absl::Status JsonFields::WrongType(const nlohmann::json& v, absl::string_view field,
                                   absl::string_view want) const {
  std::string got = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (got.size() > 40) got = absl::StrCat(got.substr(0, 37), "...");
  return Error(field, absl::StrCat("expected ", want, ", got ", v.type_name(), " ", got));
}

absl::StatusOr<const nlohmann::json*> JsonFields::Need(const nlohmann::json& obj,
                                                       const std::string& key,
                                                       absl::string_view field) const {
  if (!obj.is_object()) return WrongType(obj, field, "an object holding it");
  auto it = obj.find(key);
  if (it == obj.end()) return Error(field, "missing");
  return &*it;
}

absl::Status JsonFields::Object(const nlohmann::json& v, absl::string_view field) const {
  if (!v.is_object()) return WrongType(v, field, "an object");
  return absl::OkStatus();
}

absl::Status JsonFields::Array(const nlohmann::json& v, absl::string_view field) const {
  if (!v.is_array()) return WrongType(v, field, "an array");
  return absl::OkStatus();
}

absl::StatusOr<int64_t> JsonFields::Int(const nlohmann::json& v, absl::string_view field,
                                        int64_t min, int64_t max) const {
  if (!v.is_number_integer()) return WrongType(v, field, "an integer");
  if (v.is_number_unsigned() &&
      v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return Error(field, absl::StrCat("must be in [", min, ", ", max, "], got ", v.dump()));
  }
  const int64_t x = v.get<int64_t>();
  if (x < min || x > max) {
    return Error(field, absl::StrCat("must be in [", min, ", ", max, "], got ", x));
  }
  return x;
}

absl::StatusOr<uint64_t> JsonFields::Unsigned(const nlohmann::json& v,
                                              absl::string_view field) const {
  if (!v.is_number_unsigned()) return WrongType(v, field, "an unsigned integer");
  return v.get<uint64_t>();
}

absl::StatusOr<double> JsonFields::Number(const nlohmann::json& v, absl::string_view field) const {
  if (!v.is_number()) return WrongType(v, field, "a number");
  return v.get<double>();
}

absl::StatusOr<std::string> JsonFields::String(const nlohmann::json& v,
                                               absl::string_view field) const {
  if (!v.is_string()) return WrongType(v, field, "a string");
  return v.get<std::string>();
}

absl::StatusOr<uint64_t> JsonFields::Hex64(const nlohmann::json& v, absl::string_view field) const {
  absl::StatusOr<std::string> s = String(v, field);
  if (!s.ok()) return s.status();
  uint64_t x = 0;
  if (s->empty() || s->size() > 16 ||
      s->find_first_not_of("0123456789abcdefABCDEF") != std::string::npos ||
      !absl::SimpleHexAtoi(*s, &x)) {
    std::string shown = absl::CEscape(*s);
    if (shown.size() > 40) shown = absl::StrCat(shown.substr(0, 37), "...");
    return Error(field, absl::StrCat("expected up to 16 hex digits, got \"", shown, "\""));
  }
  return x;
}

absl::StatusOr<std::vector<std::string>> JsonFields::Strings(const nlohmann::json& v,
                                                             absl::string_view field) const {
  if (absl::Status s = Array(v, field); !s.ok()) return s;
  std::vector<std::string> out;
  out.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    absl::StatusOr<std::string> e = String(v[i], absl::StrCat(field, "[", i, "]"));
    if (!e.ok()) return e.status();
    out.push_back(*std::move(e));
  }
  return out;
}

absl::StatusOr<std::vector<int64_t>> JsonFields::Shape(const nlohmann::json& v,
                                                       absl::string_view field,
                                                       int64_t* numel) const {
  if (absl::Status s = Array(v, field); !s.ok()) return s;
  if (v.size() > 64) {
    return Error(field, absl::StrCat("has ", v.size(), " dimensions, at most 64 are allowed"));
  }
  std::vector<int64_t> shape;
  int64_t n = 1;
  for (size_t i = 0; i < v.size(); ++i) {
    absl::StatusOr<int64_t> d = Int(v[i], absl::StrCat(field, "[", i, "]"), 0);
    if (!d.ok()) return d.status();
    if (__builtin_mul_overflow(n, *d, &n)) {
      return Error(field, "has more elements than fit in int64");
    }
    shape.push_back(*d);
  }
  if (numel != nullptr) *numel = n;
  return shape;
}

}  // namespace fairscale::base
