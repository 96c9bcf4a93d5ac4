#include "pipe/internal/skip_declarations.h"

#include <algorithm>
#include <cstddef>
#include <map>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"

namespace fairscale::pipe::internal {
namespace {

// The shortest encoding of one id: "0:" (default namespace) and "1:x".
constexpr size_t kMinIdBytes = 5;

void Put(std::string* out, absl::string_view field) {
  absl::StrAppend(out, field.size(), ":", field);
}

// A canonical non-negative decimal ("0", or no leading zero) that fits int64.
bool ParseCanonical(absl::string_view s, int64_t* v) {
  if (s.empty() || s.size() > 19 || (s.size() > 1 && s[0] == '0')) return false;
  int64_t n = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    if (__builtin_mul_overflow(n, 10, &n) || __builtin_add_overflow(n, c - '0', &n)) return false;
  }
  *v = n;
  return true;
}

class Reader {
 public:
  explicit Reader(absl::string_view in) : in_(in) {}
  bool done() const { return pos_ == in_.size(); }
  size_t left() const { return in_.size() - pos_; }
  bool Next(std::string* field) {
    // The length has at most 19 digits (int64): look no further for the colon.
    const absl::string_view rest = in_.substr(pos_, 20);
    const size_t colon = rest.find(':');
    int64_t len = 0;
    if (colon == absl::string_view::npos || !ParseCanonical(rest.substr(0, colon), &len)) {
      return false;
    }
    const size_t start = pos_ + colon + 1;
    if (static_cast<uint64_t>(len) > in_.size() - start) return false;
    field->assign(in_.data() + start, static_cast<size_t>(len));
    pos_ = start + static_cast<size_t>(len);
    return true;
  }
  bool NextInt(int64_t* v) {
    std::string field;
    return Next(&field) && ParseCanonical(field, v);
  }
  bool NextIds(std::vector<SkipId>* ids) {
    int64_t n = 0;
    // Bounded by what is left before anything is kept for it.
    if (!NextInt(&n) || static_cast<uint64_t>(n) > left() / kMinIdBytes) return false;
    for (int64_t i = 0; i < n; ++i) {
      std::string ns, name;
      if (!Next(&ns) || !Next(&name) || name.empty()) return false;
      ids->push_back({ns.empty() ? Namespace() : Namespace(std::move(ns)), std::move(name)});
    }
    return true;
  }

 private:
  absl::string_view in_;
  size_t pos_ = 0;
};

std::set<std::string> NamesOf(const std::vector<SkipId>& ids) {
  std::set<std::string> out;
  for (const SkipId& id : ids) out.insert(id.name);
  return out;
}

}  // namespace

std::string EncodeDeclarations(const std::vector<LayerSkips>& layers) {
  std::string out;
  for (const LayerSkips& layer : layers) {
    Put(&out, std::to_string(layer.virtual_stage));
    Put(&out, std::to_string(layer.position));
    Put(&out, layer.layer);
    for (const std::vector<SkipId>* ids : {&layer.stash, &layer.pop}) {
      Put(&out, std::to_string(ids->size()));
      for (const SkipId& id : *ids) {
        Put(&out, id.ns.name());
        Put(&out, id.name);
      }
    }
  }
  return out;
}

absl::StatusOr<std::vector<LayerSkips>> DecodeDeclarations(const std::string& encoded) {
  if (static_cast<int64_t>(encoded.size()) > kMaxDeclarationBytes) {
    return absl::DataLossError(absl::StrCat("malformed skip declarations: ", encoded.size(),
                                            " bytes, more than ", kMaxDeclarationBytes));
  }
  std::vector<LayerSkips> out;
  Reader r(encoded);
  while (!r.done()) {
    LayerSkips layer;
    if (!r.NextInt(&layer.virtual_stage) || !r.NextInt(&layer.position) || !r.Next(&layer.layer) ||
        !r.NextIds(&layer.stash) || !r.NextIds(&layer.pop)) {
      return absl::DataLossError(absl::StrCat("malformed skip declarations (", encoded.size(),
                                              " bytes) after ", out.size(), " layers"));
    }
    out.push_back(std::move(layer));
  }
  return out;
}

absl::Status VerifyDeclarations(const std::vector<LayerSkips>& layers) {
  // Where each name is stashed, to tell "popped before its stash" from "never stashed".
  std::map<SkipId, const LayerSkips*> stashed_anywhere;
  for (const LayerSkips& layer : layers) {
    for (const SkipId& id : layer.stash) stashed_anywhere.emplace(id, &layer);
  }
  std::map<SkipId, const LayerSkips*> stashed;
  std::set<SkipId> popped;
  std::vector<std::string> problems;
  for (const LayerSkips& layer : layers) {
    const std::string who = absl::StrCat("layer '", layer.layer, "'");
    std::set<std::string> both;
    const std::set<std::string> pop_names = NamesOf(layer.pop);
    for (const SkipId& id : layer.stash) {
      if (pop_names.count(id.name)) both.insert(id.name);
    }
    for (const std::string& n : both) {
      problems.push_back(
          absl::StrCat(who, " declared '", n, "' both as stashable and as poppable"));
    }
    for (const SkipId& id : layer.stash) {
      if (both.count(id.name)) continue;
      if (stashed.count(id)) {
        problems.push_back(absl::StrCat(who, " redeclared ", DescribeSkip(id),
                                        " as stashable but not isolated by namespace (layer '",
                                        stashed[id]->layer, "' stashes it)"));
        continue;
      }
      stashed[id] = &layer;
    }
    for (const SkipId& id : layer.pop) {
      if (both.count(id.name)) continue;
      if (popped.count(id)) {
        problems.push_back(absl::StrCat(who, " redeclared ", DescribeSkip(id),
                                        " as poppable but not isolated by namespace"));
        continue;
      }
      if (!stashed.count(id)) {
        auto later = stashed_anywhere.find(id);
        if (later != stashed_anywhere.end() && !both.count(id.name) &&
            later->second != &layer) {
          problems.push_back(absl::StrCat(who, " declared ", DescribeSkip(id),
                                          " as poppable but it was not stashed before it (layer '",
                                          later->second->layer, "' stashes it later)"));
        } else {
          problems.push_back(
              absl::StrCat(who, " declared ", DescribeSkip(id), " as poppable but it was not stashed"));
        }
        continue;
      }
      popped.insert(id);
    }
  }
  for (const auto& [id, layer] : stashed) {
    if (!popped.count(id)) {
      problems.push_back(absl::StrCat("no layer declared ", DescribeSkip(id),
                                      " as poppable but layer '", layer->layer, "' stashes it"));
    }
  }
  if (problems.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "one or more pairs of stash and pop do not match: * ", absl::StrJoin(problems, "; * ")));
}

std::vector<SkipRoute> RoutesOf(const std::vector<LayerSkips>& layers) {
  std::map<SkipId, int64_t> from;
  std::vector<SkipRoute> routes;
  for (const LayerSkips& layer : layers) {
    for (const SkipId& id : layer.stash) from[id] = layer.virtual_stage;
    for (const SkipId& id : layer.pop) {
      auto it = from.find(id);
      if (it != from.end()) routes.push_back({id, it->second, layer.virtual_stage});
    }
  }
  std::sort(routes.begin(), routes.end(),
            [](const SkipRoute& a, const SkipRoute& b) { return a.id < b.id; });
  return routes;
}

std::vector<SkipId> InTransitAfter(const std::vector<SkipRoute>& routes, int64_t c) {
  std::vector<SkipId> out;
  for (const SkipRoute& r : routes) {
    if (r.from <= c && c < r.to) out.push_back(r.id);
  }
  return out;
}

}  // namespace fairscale::pipe::internal
