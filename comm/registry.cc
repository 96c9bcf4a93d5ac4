#include "comm/registry.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "base/status_macros.h"
#include "comm/store/hash_store.h"
#include "comm/store/tcp_store.h"

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

// The value of an environment variable; nullopt when unset.
std::optional<std::string> Env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

absl::Status BadVar(absl::string_view name, absl::string_view value, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(name, "='", value, "' ", why));
}

// An integer variable within [min, max]. `required` when it must be set.
absl::StatusOr<std::optional<int>> IntVar(const char* name, int min, int max, bool required,
                                          absl::string_view why_required) {
  std::optional<std::string> v = Env(name);
  if (!v.has_value()) {
    if (required) {
      return absl::InvalidArgumentError(absl::StrCat(name, " is not set (", why_required, ")"));
    }
    return std::optional<int>();
  }
  int out = 0;
  if (!absl::SimpleAtoi(*v, &out)) return BadVar(name, *v, "is not an integer");
  if (out < min || out > max) {
    return BadVar(name, *v, absl::StrCat("is outside [", min, ", ", max, "]"));
  }
  return std::optional<int>(out);
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

absl::StatusOr<EnvConfig> ParseEnv() {
  constexpr int kMaxInt = std::numeric_limits<int>::max();
  constexpr absl::string_view kTorchrun = "set by torchrun / the launcher";
  EnvConfig env;
  FS_ASSIGN_OR_RETURN(std::optional<int> world,
                      IntVar("WORLD_SIZE", 1, kMaxInt, /*required=*/true, kTorchrun));
  env.world_size = *world;
  FS_ASSIGN_OR_RETURN(std::optional<int> rank,
                      IntVar("RANK", 0, kMaxInt, /*required=*/true, kTorchrun));
  if (*rank >= env.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("RANK='", *rank, "' is not below WORLD_SIZE='",
                                                   env.world_size, "'"));
  }
  env.rank = *rank;
  FS_ASSIGN_OR_RETURN(std::optional<int> local_rank,
                      IntVar("LOCAL_RANK", 0, kMaxInt, /*required=*/false, ""));
  env.local_rank = local_rank.value_or(0);

  // Several ranks need a rendezvous; a single rank may still be told where one is.
  const bool need_master = env.world_size > 1;
  const std::string why_master =
      absl::StrCat("required when WORLD_SIZE > 1; WORLD_SIZE='", env.world_size, "'");
  std::optional<std::string> addr = Env("MASTER_ADDR");
  if (addr.has_value() && addr->empty()) return BadVar("MASTER_ADDR", "", "is empty");
  if (!addr.has_value() && need_master) {
    return absl::InvalidArgumentError(absl::StrCat("MASTER_ADDR is not set (", why_master, ")"));
  }
  env.master_addr = addr.value_or("");
  FS_ASSIGN_OR_RETURN(std::optional<int> port,
                      IntVar("MASTER_PORT", 1, 65535, need_master, why_master));
  env.master_port = port.value_or(0);

  env.backend = Env("FS_COMM_BACKEND").value_or("");
  if (std::optional<std::string> t = Env("FS_COMM_TIMEOUT_S"); t.has_value()) {
    double seconds = 0;
    if (!absl::SimpleAtod(*t, &seconds) || !std::isfinite(seconds)) {
      return BadVar("FS_COMM_TIMEOUT_S", *t, "is not a number of seconds");
    }
    if (seconds <= 0) return BadVar("FS_COMM_TIMEOUT_S", *t, "must be positive");
    env.timeout = absl::Seconds(seconds);
  }
  if (std::optional<std::string> a = Env("TORCHELASTIC_USE_AGENT_STORE"); a.has_value()) {
    // torchrun writes "True"/"False"; accept the usual spellings of a boolean too.
    if (*a == "True" || *a == "true" || *a == "1") {
      env.use_agent_store = true;
    } else if (*a == "False" || *a == "false" || *a == "0" || a->empty()) {
      env.use_agent_store = false;
    } else {
      return BadVar("TORCHELASTIC_USE_AGENT_STORE", *a, "is not True or False");
    }
  }
  return env;
}

absl::StatusOr<std::shared_ptr<Communicator>> CreateCommunicatorFromEnv(const CommConfig& base) {
  FS_ASSIGN_OR_RETURN(EnvConfig env, ParseEnv());
  CommConfig config = base;
  config.rank = env.rank;
  config.size = env.world_size;
  if (std::getenv("FS_COMM_TIMEOUT_S") != nullptr) config.timeout = env.timeout;
  if (config.store == nullptr) {
    if (env.world_size == 1) {
      // Nobody to meet: an in-memory store does, and no port is taken.
      config.store = std::make_shared<HashStore>();
    } else {
      TCPStoreOptions options;
      options.host = env.master_addr;
      options.port = env.master_port;
      // With the agent store the launcher already serves MASTER_PORT; otherwise rank 0 does.
      options.is_server = !env.use_agent_store && env.rank == 0;
      options.timeout = config.timeout;
      FS_ASSIGN_OR_RETURN(std::unique_ptr<TCPStore> store, TCPStore::Create(options));
      config.store = std::move(store);
    }
  }
  return CreateCommunicator(env.backend, config);
}

}  // namespace fairscale::comm
