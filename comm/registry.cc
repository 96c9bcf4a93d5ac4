#include "comm/registry.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"

namespace fairscale::comm {
namespace {

struct Entry {
  std::string name;
  int priority;
  BackendFactory factory;
};

struct Registry {
  absl::Mutex mu;
  std::vector<Entry> entries ABSL_GUARDED_BY(mu);
};

// Function-local and leaked: registrations run during static init in any order.
Registry& GetRegistry() {
  static Registry* registry = new Registry();
  return *registry;
}

}  // namespace

BackendRegistration::BackendRegistration(absl::string_view name, int priority,
                                         BackendFactory factory) {
  Registry& r = GetRegistry();
  absl::MutexLock lock(&r.mu);
  r.entries.push_back({std::string(name), priority, factory});
  std::stable_sort(r.entries.begin(), r.entries.end(),
                   [](const Entry& a, const Entry& b) { return a.priority > b.priority; });
}

std::vector<std::string> LinkedBackends() {
  Registry& r = GetRegistry();
  absl::MutexLock lock(&r.mu);
  std::vector<std::string> names;
  for (const Entry& e : r.entries) names.push_back(e.name);
  return names;
}

absl::StatusOr<std::shared_ptr<Communicator>> CreateCommunicator(absl::string_view name,
                                                                 const CommConfig& config) {
  BackendFactory factory = nullptr;
  std::string chosen;
  {
    Registry& r = GetRegistry();
    absl::MutexLock lock(&r.mu);
    for (const Entry& e : r.entries) {
      if (name.empty() || e.name == name) {
        factory = e.factory;
        chosen = e.name;
        break;
      }
    }
  }
  if (factory == nullptr) {
    std::vector<std::string> linked = LinkedBackends();
    if (linked.empty()) {
      return absl::NotFoundError(absl::StrCat(
          "no comm backend is linked into this binary", name.empty() ? "" : " (asked for '",
          name, name.empty() ? "" : "')",
          "; depend on //comm/tcp, //comm/ucx, //comm/nccl, //comm/inproc or "
          "//comm:all_backends"));
    }
    return absl::NotFoundError(absl::StrCat("comm backend '", name,
                                            "' is not linked into this binary; linked: ",
                                            absl::StrJoin(linked, ", ")));
  }
  if (config.size < 1 || config.rank < 0 || config.rank >= config.size) {
    return absl::InvalidArgumentError(absl::StrCat("[", chosen, "] invalid rank ", config.rank,
                                                   " for size ", config.size));
  }
  if (config.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("[", chosen, "] timeout must be positive, got ",
                                                   absl::FormatDuration(config.timeout)));
  }
  return factory(config);
}

}  // namespace fairscale::comm
