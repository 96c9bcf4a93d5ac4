// Backend registry (//comm:registry): binaries and tests create communicators here; feature
// libraries never do (they receive a Communicator).
//
// A backend registers itself at static-init time from its own .cc, in a target with
// alwayslink = 1:
//
//   const BackendRegistration kRegistration("tcp", /*priority=*/10, &CreateTcp);
//
// so linking //comm/tcp (or //comm/ucx, //comm/nccl, //comm:all_backends) is how a binary
// chooses its network. CreateCommunicator("") picks the highest-priority linked backend.
#pragma once

#include <memory>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/config.h"
#include "comm/store/store.h"

namespace fairscale::comm {

using BackendFactory = absl::StatusOr<std::shared_ptr<Communicator>> (*)(const CommConfig&);

class BackendRegistration {
 public:
  BackendRegistration(absl::string_view name, int priority, BackendFactory factory);
};

// Names of the linked backends, highest priority first.
std::vector<std::string> LinkedBackends();

// Creates this rank's communicator with backend `name` ("" = highest priority linked).
// kNotFound lists the linked backends when `name` is unknown or none is linked.
// kInvalidArgument for a bad rank/size; rendezvous errors as the backend reports them.
absl::StatusOr<std::shared_ptr<Communicator>> CreateCommunicator(absl::string_view name,
                                                                 const CommConfig& config);

// Clients of rendezvous stores that speak another launcher's protocol, by protocol name:
// "c10d" is PyTorch's TCPStore, the store torchrun's agent hosts. Registered like backends, from
// a target with alwayslink = 1 (//comm/torch:c10d_store, which keeps LibTorch out of //comm):
//
//   const StoreClientRegistration kRegistration("c10d", &CreateC10dStoreClient);
struct StoreClientOptions {
  std::string host;
  int port = 0;
  // Bounds the connect and every request without a timeout of its own.
  absl::Duration timeout = absl::Minutes(5);
};
using StoreClientFactory =
    absl::StatusOr<std::unique_ptr<Store>> (*)(const StoreClientOptions&);

class StoreClientRegistration {
 public:
  StoreClientRegistration(absl::string_view protocol, StoreClientFactory factory);
};

// Protocols with a linked store client, sorted.
std::vector<std::string> LinkedStoreClients();

// Connects a client of `protocol`'s store at options.host:port. kNotFound names the target to
// link when no client of `protocol` is linked.
absl::StatusOr<std::unique_ptr<Store>> CreateStoreClient(absl::string_view protocol,
                                                         const StoreClientOptions& options);

// The environment contract. Rank and size, first source that is set wins:
//   RANK, WORLD_SIZE, LOCAL_RANK        torchrun / fs_launch
//   OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK, or PMI_RANK / PMI_SIZE / MPI_LOCALRANKID
//                                       mpirun (when both are set they must agree)
//   SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
//                                       srun; last, because mpirun or torchrun inside an
//                                       allocation inherit the batch step's. The batch step of
//                                       an sbatch script (SLURM_STEP_ID unset) with
//                                       SLURM_NTASKS > 1 is refused (kFailedPrecondition):
//                                       nothing starts the other ranks there; use srun.
// An explicit LOCAL_RANK wins over the launcher's local rank.
//
// The rendezvous (needed when the world size is > 1), first that applies:
//   MASTER_ADDR, MASTER_PORT            torchrun / fs_launch set them; under mpirun pass them
//                                       with `mpirun -x MASTER_ADDR=<rank 0's host>
//                                       -x MASTER_PORT=<free port>`. mpirun across hosts
//                                       (its local size < its size) without them, or with a
//                                       MASTER_ADDR that is loopback here, is kInvalidArgument
//                                       saying what to pass (no rendezvous timeout)
//   single-node mpirun without MASTER_ADDR (OMPI_COMM_WORLD_LOCAL_SIZE = _SIZE): a FileStore
//                                       in mpirun's per-job session directory
//                                       ($OMPI_MCA_orte_jobfam_session_dir/fairscale_store_<job
//                                       id>; mpirun deletes it when the job ends)
//   srun without MASTER_ADDR / MASTER_PORT: the first host of SLURM_STEP_NODELIST (else
//                                       SLURM_JOB_NODELIST, else SLURM_NODELIST), port
//                                       15000 + SLURM_JOB_ID % 20000
// Who hosts it: rank 0 (a TCPStore bound to MASTER_ADDR), unless TORCHELASTIC_USE_AGENT_STORE=True:
// then the launcher hosts it and every rank is a client, speaking
//   FS_STORE_PROTOCOL=fairscale         our TCPStore (fs_launch; presents FS_STORE_TOKEN), or
//   FS_STORE_PROTOCOL=c10d              PyTorch's TCPStore (torchrun's agent); needs
//                                       //comm/torch:c10d_store linked. Keys are prefixed
//                                       "/worker/attempt_<TORCHELASTIC_RESTART_COUNT>/" as
//                                       PyTorch's workers do, so an attempt never sees an
//                                       earlier one's keys.
// FS_STORE_PROTOCOL defaults to fairscale when FS_STORE_TOKEN is set (fs_launch always sets it)
// and to c10d otherwise (torchrun never sets it).
// Also: FS_COMM_BACKEND (backend name, default: highest priority), FS_COMM_TIMEOUT_S (default
// operation timeout in seconds; also bounds the rendezvous), FS_STORE_TOKEN (the job token our
// TCPStore server demands; fs_launch generates it), FS_STORE_PREFIX (a namespace for every store
// key; fs_launch sets one per restart attempt).
//
// Where a rank listens for its peers and which address it advertises to them
// (CommConfig::bind_address; comm/bind_address.h), first that applies:
//   FS_SOCKET_IFNAME=<interface>        that interface's IPv4 address (like GLOO_SOCKET_IFNAME;
//                                       an unknown interface, or one without an IPv4 address,
//                                       is kInvalidArgument listing the interfaces). The ucx
//                                       backend also gets it as UCX_NET_DEVICES, the nccl
//                                       backend as NCCL_SOCKET_IFNAME, unless that is set.
//   every rank on this host             127.0.0.1: LOCAL_WORLD_SIZE (torchrun / fs_launch),
//                                       OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS or
//                                       SLURM_STEP_NUM_NODES=1 says so, or there is no
//                                       MASTER_ADDR (mpirun's FileStore), or MASTER_ADDR is
//                                       loopback
//   otherwise                           the local address of the route to MASTER_ADDR (what
//                                       this host would use to reach rank 0's host)
// A caller's own `base.bind_address` (anything but the default 127.0.0.1) wins over both.
// A rank whose connection to a peer's advertised address is refused for seconds fails then
// (not after the rendezvous timeout), naming the address and FS_SOCKET_IFNAME.
struct EnvConfig {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;
  int master_port = 0;
  // Where master_addr / master_port came from, for messages: "MASTER_ADDR",
  // "SLURM_JOB_NODELIST", ...
  std::string master_addr_source;
  std::string master_port_source;
  // Non-empty: rendezvous through a FileStore in this directory instead of a TCPStore.
  std::string store_dir;
  std::string backend;
  absl::Duration timeout = absl::Minutes(10);
  bool use_agent_store = false;
  // "fairscale" or "c10d": the protocol of the launcher's store (use_agent_store).
  std::string store_protocol = "fairscale";
  int restart_count = 0;  // TORCHELASTIC_RESTART_COUNT
  std::string store_token;
  std::string store_prefix;
  // Which variables gave rank and size: "RANK/WORLD_SIZE", "OMPI_COMM_WORLD_*", "PMI_*" or
  // "SLURM_*".
  std::string rank_source;
  // Ranks on this host (LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS; the world
  // size under srun with SLURM_STEP_NUM_NODES=1); 0 when unknown.
  int local_world_size = 0;
  // FS_SOCKET_IFNAME; "" = unset.
  std::string socket_ifname;
};

// Whether a launcher started this process: any rank source above is set (RANK or WORLD_SIZE,
// OMPI_COMM_WORLD_RANK/_SIZE, PMI_RANK/_SIZE, SLURM_PROCID/SLURM_NTASKS). Binaries that launch
// their own ranks otherwise (train_gpt, demo) decide with this, so that `mpirun -np 2 prog`
// runs 2 ranks of one job, not 2 jobs. ParseEnv then says what is wrong or missing.
bool StartedByLauncher();

// Parses and validates the variables above; kInvalidArgument names the variable at fault.
absl::StatusOr<EnvConfig> ParseEnv();

// What CreateCommunicatorFromEnv(base) creates its communicator from: the parsed environment
// and the config (rank, size, timeout, bind address, and the rendezvous store described above,
// under FS_STORE_PREFIX; options as below). For a rank that makes communicators of its own over
// the job's store instead of one world communicator (the main job's --fault_tolerant mode: one
// per replica group, since a dead rank breaks a world communicator and a restarted group could
// not rejoin it). With WORLD_SIZE > 1 and neither TORCHELASTIC_USE_AGENT_STORE nor a FileStore,
// rank 0 hosts the store (env.use_agent_store false): it lives only as long as rank 0.
struct EnvCommConfig {
  EnvConfig env;
  CommConfig config;
};
absl::StatusOr<EnvCommConfig> CommConfigFromEnv(const CommConfig& base = {});

// CommConfigFromEnv(base), then CreateCommunicator(env.backend, config).
// `base` supplies the fields the environment does not (options; bind_address when not the
// default, see above; timeout unless FS_COMM_TIMEOUT_S is set; a store, which then replaces the
// rendezvous). With FS_STORE_PREFIX
// the store is wrapped in a PrefixStore. WORLD_SIZE=1 uses an in-memory HashStore.
absl::StatusOr<std::shared_ptr<Communicator>> CreateCommunicatorFromEnv(
    const CommConfig& base = {});

}  // namespace fairscale::comm
