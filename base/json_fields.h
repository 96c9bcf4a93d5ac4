// Reading fields of untrusted JSON (//base:json_fields): the file readers of checkpoints (the GPT
// job's COMPLETE marker, the FSDP sharded checkpoint's manifest and rank-file headers) check
// every field's presence, type and range through this class, so a hostile or corrupt file gets
// one error naming the file and the field, and no value reaches a conversion that is undefined
// behaviour (nlohmann's get<int>() of 1e300, of a negative number as unsigned, ...).
//
// Every error is kDataLoss "<prefix><field>: <what>", e.g. with the prefix
// "manifest '/ckpt/manifest.json': ", "... files[2].bytes: expected an integer, got string \"12\"".
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fairscale::base {

class JsonFields {
 public:
  explicit JsonFields(std::string prefix) : prefix_(std::move(prefix)) {}

  absl::Status Error(absl::string_view field, absl::string_view what) const;
  // "expected <want>, got <type> <value, cut at 40 characters>".
  absl::Status WrongType(const nlohmann::json& v, absl::string_view field,
                         absl::string_view want) const;

  // obj[key], which must exist (obj must be an object).
  absl::StatusOr<const nlohmann::json*> Need(const nlohmann::json& obj, const std::string& key,
                                             absl::string_view field) const;
  absl::Status Object(const nlohmann::json& v, absl::string_view field) const;
  absl::Status Array(const nlohmann::json& v, absl::string_view field) const;
  // An integer (not 1.0) in [min, max].
  absl::StatusOr<int64_t> Int(const nlohmann::json& v, absl::string_view field,
                              int64_t min = std::numeric_limits<int64_t>::min(),
                              int64_t max = std::numeric_limits<int64_t>::max()) const;
  absl::StatusOr<uint64_t> Unsigned(const nlohmann::json& v, absl::string_view field) const;
  // Any JSON number.
  absl::StatusOr<double> Number(const nlohmann::json& v, absl::string_view field) const;
  absl::StatusOr<std::string> String(const nlohmann::json& v, absl::string_view field) const;
  // A string of 1 to 16 hex digits.
  absl::StatusOr<uint64_t> Hex64(const nlohmann::json& v, absl::string_view field) const;
  // An array of strings.
  absl::StatusOr<std::vector<std::string>> Strings(const nlohmann::json& v,
                                                   absl::string_view field) const;
  // A tensor shape: an array of at most 64 non-negative integers whose product fits int64
  // (stored in *numel when not null).
  absl::StatusOr<std::vector<int64_t>> Shape(const nlohmann::json& v, absl::string_view field,
                                             int64_t* numel = nullptr) const;

 private:
  std::string prefix_;
};

}  // namespace fairscale::base
