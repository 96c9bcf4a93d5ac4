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
#include "base/logging.h"
#include "base/status_macros.h"
#include "comm/bind_address.h"
#include "comm/slurm_hostlist.h"
#include "comm/store/file_store.h"
#include "comm/store/hash_store.h"
#include "comm/store/prefix_store.h"
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

namespace {

struct StoreClients {
  absl::Mutex mu;
  std::vector<std::pair<std::string, StoreClientFactory>> entries ABSL_GUARDED_BY(mu);
};

StoreClients& GetStoreClients() {
  static StoreClients* clients = new StoreClients();
  return *clients;
}

}  // namespace

StoreClientRegistration::StoreClientRegistration(absl::string_view protocol,
                                                 StoreClientFactory factory) {
  StoreClients& c = GetStoreClients();
  absl::MutexLock lock(&c.mu);
  c.entries.emplace_back(std::string(protocol), factory);
  std::sort(c.entries.begin(), c.entries.end());
}

std::vector<std::string> LinkedStoreClients() {
  StoreClients& c = GetStoreClients();
  absl::MutexLock lock(&c.mu);
  std::vector<std::string> names;
  for (const auto& e : c.entries) names.push_back(e.first);
  return names;
}

absl::StatusOr<std::unique_ptr<Store>> CreateStoreClient(absl::string_view protocol,
                                                         const StoreClientOptions& options) {
  StoreClientFactory factory = nullptr;
  {
    StoreClients& c = GetStoreClients();
    absl::MutexLock lock(&c.mu);
    for (const auto& e : c.entries) {
      if (e.first == protocol) factory = e.second;
    }
  }
  if (factory == nullptr) {
    std::vector<std::string> linked = LinkedStoreClients();
    return absl::NotFoundError(absl::StrCat(
        "no '", protocol, "' store client is linked into this binary",
        protocol == "c10d" ? "; depend on //comm/torch:c10d_store" : "",
        linked.empty() ? "" : absl::StrCat(" (linked: ", absl::StrJoin(linked, ", "), ")")));
  }
  return factory(options);
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

namespace {

// Where a rank and a world size can come from, in order of precedence. torchrun / fs_launch's
// variables win; then the MPI launchers' (mpirun exports both OMPI_* and, with some PMI
// plugins, PMI_*: they must agree); Slurm's last, because mpirun inside an sbatch allocation
// inherits the batch step's SLURM_PROCID / SLURM_NTASKS, which describe the script, not the
// ranks.
struct RankSource {
  const char* name;  // for EnvConfig::rank_source
  const char* rank;
  const char* size;
  const char* local_rank;
};
constexpr RankSource kTorchrunSource = {"RANK/WORLD_SIZE", "RANK", "WORLD_SIZE", "LOCAL_RANK"};
constexpr RankSource kMpiSources[] = {
    {"OMPI_COMM_WORLD_*", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK"},
    {"PMI_*", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"},
};
constexpr RankSource kSlurmSource = {"SLURM_*", "SLURM_PROCID", "SLURM_NTASKS",
                                     "SLURM_LOCALID"};

bool IsSet(const RankSource& s) {
  return std::getenv(s.rank) != nullptr || std::getenv(s.size) != nullptr;
}

struct RankAndSize {
  int rank = 0;
  int size = 1;
};

// Reads one source's rank and size: both must be set, and rank < size.
absl::StatusOr<RankAndSize> ReadSource(const RankSource& s, absl::string_view why_required) {
  constexpr int kMaxInt = std::numeric_limits<int>::max();
  RankAndSize out;
  FS_ASSIGN_OR_RETURN(std::optional<int> size,
                      IntVar(s.size, 1, kMaxInt, /*required=*/true, why_required));
  FS_ASSIGN_OR_RETURN(std::optional<int> rank,
                      IntVar(s.rank, 0, kMaxInt, /*required=*/true, why_required));
  if (*rank >= *size) {
    return absl::InvalidArgumentError(absl::StrCat(s.rank, "='", *rank, "' is not below ",
                                                   s.size, "='", *size, "'"));
  }
  out.rank = *rank;
  out.size = *size;
  return out;
}

// The batch step of an sbatch script has SLURM_PROCID=0 and SLURM_NTASKS=N but no SLURM_STEP_ID
// (srun sets it for every step it starts); Slurm's own id of the batch step is 0xfffffffb.
bool IsSlurmBatchStep() {
  for (const char* name : {"SLURM_STEP_ID", "SLURM_STEPID"}) {
    std::optional<std::string> v = Env(name);
    if (v.has_value()) return *v == "batch" || *v == "4294967291";
  }
  return true;
}

// MASTER_ADDR from a Slurm node list when MASTER_ADDR is unset: the first host.
absl::Status MasterFromSlurm(EnvConfig* env) {
  for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
    std::optional<std::string> v = Env(name);
    if (!v.has_value()) continue;
    absl::StatusOr<std::string> first = FirstSlurmHost(*v);
    if (!first.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, " is not a Slurm host list: ", first.status().message(),
          "; set MASTER_ADDR to rank 0's host instead"));
    }
    env->master_addr = *first;
    env->master_addr_source = name;
    return absl::OkStatus();
  }
  return absl::OkStatus();
}

}  // namespace

bool StartedByLauncher() {
  if (IsSet(kTorchrunSource) || IsSet(kSlurmSource)) return true;
  for (const RankSource& s : kMpiSources) {
    if (IsSet(s)) return true;
  }
  return false;
}

absl::StatusOr<EnvConfig> ParseEnv() {
  constexpr int kMaxInt = std::numeric_limits<int>::max();
  EnvConfig env;
  const RankSource* source = &kTorchrunSource;
  std::string why = "set by torchrun / fs_launch";
  if (!IsSet(kTorchrunSource)) {
    why = "set by torchrun / fs_launch, or OMPI_COMM_WORLD_* / PMI_* / SLURM_* under mpirun / "
          "Slurm";
    if (IsSet(kMpiSources[0]) || IsSet(kMpiSources[1])) {
      source = IsSet(kMpiSources[0]) ? &kMpiSources[0] : &kMpiSources[1];
      why = "set by mpirun";
    } else if (IsSet(kSlurmSource)) {
      source = &kSlurmSource;
      why = "set by srun";
    }
  }
  FS_ASSIGN_OR_RETURN(RankAndSize rs, ReadSource(*source, why));
  if (source == &kSlurmSource && rs.size > 1 && IsSlurmBatchStep()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "SLURM_PROCID='", rs.rank, "' SLURM_NTASKS='", rs.size,
        "' come from the batch step of an sbatch script (SLURM_STEP_ID is not set): nothing "
        "starts the other ", rs.size - 1, " rank(s) here, so this process would wait for them "
        "until it times out. Start one process per task with `srun <program>` in the script "
        "(or use torchrun / mpirun / fs_launch, whose variables win), or run one process with "
        "SLURM_NTASKS unset"));
  }
  if (source == &kMpiSources[0] && IsSet(kMpiSources[1])) {
    // Both MPI views describe the same launch: a disagreement means a mixed-up environment.
    FS_ASSIGN_OR_RETURN(RankAndSize pmi, ReadSource(kMpiSources[1], "set by mpirun"));
    if (pmi.rank != rs.rank || pmi.size != rs.size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "OMPI_COMM_WORLD_RANK='", rs.rank, "' OMPI_COMM_WORLD_SIZE='", rs.size,
          "' disagree with PMI_RANK='", pmi.rank, "' PMI_SIZE='", pmi.size, "'"));
    }
  }
  env.rank = rs.rank;
  env.world_size = rs.size;
  env.rank_source = source->name;
  // An explicit LOCAL_RANK wins over the MPI / Slurm spelling.
  FS_ASSIGN_OR_RETURN(std::optional<int> local_rank,
                      IntVar("LOCAL_RANK", 0, kMaxInt, /*required=*/false, ""));
  if (!local_rank.has_value() && source != &kTorchrunSource) {
    FS_ASSIGN_OR_RETURN(local_rank,
                        IntVar(source->local_rank, 0, kMaxInt, /*required=*/false, ""));
  }
  env.local_rank = local_rank.value_or(0);
  // Ranks on this host: the launcher's count, the same way round as LOCAL_RANK.
  FS_ASSIGN_OR_RETURN(std::optional<int> local_size,
                      IntVar("LOCAL_WORLD_SIZE", 1, kMaxInt, /*required=*/false, ""));
  if (!local_size.has_value() && source == &kMpiSources[0]) {
    FS_ASSIGN_OR_RETURN(local_size, IntVar("OMPI_COMM_WORLD_LOCAL_SIZE", 1, kMaxInt,
                                           /*required=*/false, ""));
  } else if (!local_size.has_value() && source == &kMpiSources[1]) {
    FS_ASSIGN_OR_RETURN(local_size,
                        IntVar("MPI_LOCALNRANKS", 1, kMaxInt, /*required=*/false, ""));
  } else if (!local_size.has_value() && source == &kSlurmSource &&
             Env("SLURM_STEP_NUM_NODES") == "1") {
    local_size = env.world_size;
  }
  env.local_world_size = local_size.value_or(0);
  env.socket_ifname = Env("FS_SOCKET_IFNAME").value_or("");

  // Several ranks need a rendezvous; a single rank may still be told where one is.
  const bool need_master = env.world_size > 1;
  std::optional<std::string> addr = Env("MASTER_ADDR");
  if (addr.has_value() && addr->empty()) return BadVar("MASTER_ADDR", "", "is empty");
  if (addr.has_value()) {
    env.master_addr = *addr;
    env.master_addr_source = "MASTER_ADDR";
  } else if (source == &kSlurmSource) {
    FS_RETURN_IF_ERROR(MasterFromSlurm(&env));
  } else if (source == &kMpiSources[0] && need_master) {
    // One node: mpirun's per-job session directory is shared by the ranks and removed by
    // mpirun at the end, so a FileStore there needs no address, port or cleanup.
    std::optional<std::string> local_size = Env("OMPI_COMM_WORLD_LOCAL_SIZE");
    std::optional<std::string> session = Env("OMPI_MCA_orte_jobfam_session_dir");
    std::optional<std::string> job = Env("OMPI_MCA_ess_base_jobid");
    if (local_size == absl::StrCat(env.world_size) && session.has_value() && !session->empty() &&
        job.has_value() && !job->empty() && !Env("MASTER_PORT").has_value()) {
      env.store_dir = absl::StrCat(*session, "/fairscale_store_", *job);
    }
  }
  if (env.master_addr.empty() && need_master && env.store_dir.empty()) {
    std::string msg = absl::StrCat("MASTER_ADDR is not set (required when WORLD_SIZE > 1; ",
                                   source->size, "='", env.world_size, "')");
    if (source == &kMpiSources[0] || source == &kMpiSources[1]) {
      // Say why the one-node FileStore does not apply when mpirun told us the ranks are spread.
      std::optional<std::string> local_size = Env("OMPI_COMM_WORLD_LOCAL_SIZE");
      if (source == &kMpiSources[0] && local_size.has_value() &&
          *local_size != absl::StrCat(env.world_size)) {
        absl::StrAppend(&msg, "; the ranks are on several hosts (OMPI_COMM_WORLD_LOCAL_SIZE='",
                        *local_size, "' here), so they cannot meet in mpirun's session directory");
      }
      absl::StrAppend(&msg, "; under mpirun across nodes pass rank 0's host and a free port: "
                            "mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=29500 ... "
                            "(ranks on other hosts get only the variables named with -x)");
    } else if (source == &kSlurmSource) {
      absl::StrAppend(&msg, "; under srun it defaults to the first host of SLURM_JOB_NODELIST, "
                            "which is not set either");
    }
    return absl::InvalidArgumentError(msg);
  }
  const bool mpi = source == &kMpiSources[0] || source == &kMpiSources[1];
  if (mpi && need_master && env.local_world_size > 0 && env.local_world_size < env.world_size &&
      IsLoopbackHost(env.master_addr)) {
    // mpirun placed ranks on other hosts (its local size counts the ranks on this one), which
    // cannot reach this host's loopback: rank 0's TCPStore would listen there and the others
    // would dial their own, so the rendezvous could only time out. (Two torchrun agents on one
    // machine are "nodes" with a loopback MASTER_ADDR that works; only mpirun's count is sure.)
    return absl::InvalidArgumentError(absl::StrCat(
        "MASTER_ADDR='", env.master_addr, "' is a loopback address on this host, but mpirun placed "
        "the ranks on several hosts (", env.local_world_size, " of the ", env.world_size,
        " on this one): rank 0's store would listen where the other hosts cannot reach it. Pass "
        "an address of rank 0's host that the other hosts reach: mpirun -x MASTER_ADDR=<its IP "
        "on their network> -x MASTER_PORT=29500 ..., or map its name to that address in "
        "/etc/hosts (Debian maps a host's own name to 127.0.1.1)"));
  }
  std::optional<int> port;
  if (Env("MASTER_PORT").has_value() || env.store_dir.empty()) {
    const bool slurm_default = source == &kSlurmSource && Env("SLURM_JOB_ID").has_value() &&
                               !Env("MASTER_PORT").has_value();
    if (slurm_default) {
      // Every task of the step derives the same port; jobs sharing a node rarely collide.
      FS_ASSIGN_OR_RETURN(std::optional<int> job,
                          IntVar("SLURM_JOB_ID", 0, kMaxInt, /*required=*/true, ""));
      port = 15000 + *job % 20000;
      env.master_port_source = "SLURM_JOB_ID";
    } else {
      const std::string why_port = absl::StrCat(
          "required when WORLD_SIZE > 1; ", source->size, "='", env.world_size, "'",
          source == &kMpiSources[0] || source == &kMpiSources[1]
              ? "; under mpirun: mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=29500 ..."
              : "");
      FS_ASSIGN_OR_RETURN(port, IntVar("MASTER_PORT", 1, 65535, need_master, why_port));
      if (port.has_value()) env.master_port_source = "MASTER_PORT";
    }
  }
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
  std::optional<std::string> token = Env("FS_STORE_TOKEN");
  env.store_token = token.value_or("");
  env.store_prefix = Env("FS_STORE_PREFIX").value_or("");
  // torchrun never sets FS_STORE_TOKEN and fs_launch always does.
  env.store_protocol = token.has_value() ? "fairscale" : "c10d";
  if (std::optional<std::string> p = Env("FS_STORE_PROTOCOL"); p.has_value()) {
    if (*p != "fairscale" && *p != "c10d") {
      return BadVar("FS_STORE_PROTOCOL", *p,
                    "is not 'fairscale' (fs_launch's store) or 'c10d' (torchrun's)");
    }
    env.store_protocol = *p;
  }
  FS_ASSIGN_OR_RETURN(std::optional<int> restart,
                      IntVar("TORCHELASTIC_RESTART_COUNT", 0, kMaxInt, /*required=*/false, ""));
  env.restart_count = restart.value_or(0);
  return env;
}

namespace {

// The rendezvous store ParseEnv described (world size > 1).
absl::StatusOr<std::shared_ptr<Store>> RendezvousStore(const EnvConfig& env,
                                                       absl::Duration timeout) {
  if (!env.store_dir.empty()) {
    FileStoreOptions options;
    options.timeout = timeout;
    absl::StatusOr<std::unique_ptr<FileStore>> store = FileStore::Create(env.store_dir, options);
    if (!store.ok()) {
      return absl::Status(store.status().code(),
                          absl::StrCat("FileStore in mpirun's session directory ", env.store_dir,
                                       ": ", store.status().message()));
    }
    return std::shared_ptr<Store>(std::move(*store));
  }
  if (env.use_agent_store && env.store_protocol == "c10d") {
    StoreClientOptions options;
    options.host = env.master_addr;
    options.port = env.master_port;
    options.timeout = timeout;
    absl::StatusOr<std::unique_ptr<Store>> client = CreateStoreClient("c10d", options);
    if (!client.ok()) {
      if (client.status().code() != absl::StatusCode::kNotFound) return client.status();
      return absl::NotFoundError(absl::StrCat(
          "TORCHELASTIC_USE_AGENT_STORE=True without FS_STORE_TOKEN: the launcher (torchrun) "
          "hosts PyTorch's c10d TCPStore at ", env.master_addr, ":", env.master_port, ", but ",
          client.status().message(), "; under fs_launch set FS_STORE_PROTOCOL=fairscale"));
    }
    // PyTorch's workers use this namespace too: a restarted attempt never sees the keys of an
    // earlier one in the agent's store, which outlives attempts.
    return std::shared_ptr<Store>(std::make_shared<PrefixStore>(
        absl::StrCat("/worker/attempt_", env.restart_count), std::move(*client)));
  }
  TCPStoreOptions options;
  options.host = env.master_addr;
  options.port = env.master_port;
  // With the agent store the launcher already serves MASTER_PORT; otherwise rank 0 does.
  options.is_server = !env.use_agent_store && env.rank == 0;
  options.timeout = timeout;
  options.token = env.store_token;
  FS_ASSIGN_OR_RETURN(std::unique_ptr<TCPStore> store, TCPStore::Create(options));
  return std::shared_ptr<Store>(std::move(store));
}

}  // namespace

absl::StatusOr<EnvCommConfig> CommConfigFromEnv(const CommConfig& base) {
  FS_ASSIGN_OR_RETURN(EnvConfig env, ParseEnv());
  CommConfig config = base;
  config.rank = env.rank;
  config.size = env.world_size;
  if (std::getenv("FS_COMM_TIMEOUT_S") != nullptr) config.timeout = env.timeout;
  if (std::optional<std::string> t = Env("FS_COMM_STALL_TIMEOUT_S"); t.has_value()) {
    double seconds = 0;
    if (!absl::SimpleAtod(*t, &seconds) || !std::isfinite(seconds) || seconds < 0 ||
        seconds > 86400) {
      return BadVar("FS_COMM_STALL_TIMEOUT_S", *t,
                    "is not a number of seconds in [0, 86400] (0 turns the heartbeats off)");
    }
    if (seconds == 0) {
      config.options["algo.heartbeat_ms"] = "0";
    } else {
      const int64_t ms = std::max<int64_t>(100, static_cast<int64_t>(seconds * 1000));
      config.options["algo.stall_timeout_ms"] = absl::StrCat(ms);
      // At least 4 beats per stall timeout.
      config.options["algo.heartbeat_ms"] = absl::StrCat(std::min<int64_t>(1000, ms / 4));
    }
  }
  if (env.world_size > 1 && base.bind_address == CommConfig().bind_address) {
    BindAddressInputs in;
    in.socket_ifname = env.socket_ifname;
    in.master_addr = env.master_addr;
    in.single_node = env.local_world_size == env.world_size || !env.store_dir.empty();
    FS_ASSIGN_OR_RETURN(BindAddressChoice choice, ChooseBindAddress(in));
    if (choice.address != config.bind_address) {
      FS_LOG(INFO) << "rank " << env.rank << "/" << env.world_size << ": listening for peers on "
                   << choice.address << " (" << choice.reason << ")";
    }
    config.bind_address = choice.address;
    config.network_interface = choice.interface;
  }
  if (config.store == nullptr) {
    if (env.world_size == 1) {
      // Nobody to meet: an in-memory store does, and no port is taken.
      config.store = std::make_shared<HashStore>();
    } else {
      FS_ASSIGN_OR_RETURN(config.store, RendezvousStore(env, config.timeout));
    }
    if (!env.store_prefix.empty()) {
      // The launcher's namespace for this attempt: keys of an earlier attempt stay invisible.
      config.store = std::make_shared<PrefixStore>(env.store_prefix, std::move(config.store));
    }
  }
  return EnvCommConfig{std::move(env), std::move(config)};
}

absl::StatusOr<std::shared_ptr<Communicator>> CreateCommunicatorFromEnv(const CommConfig& base) {
  FS_ASSIGN_OR_RETURN(EnvCommConfig e, CommConfigFromEnv(base));
  return CreateCommunicator(e.env.backend, e.config);
}

}  // namespace fairscale::comm
