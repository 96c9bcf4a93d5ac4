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

// The torchrun contract, read from the environment:
//   RANK, WORLD_SIZE (required), LOCAL_RANK (optional), MASTER_ADDR, MASTER_PORT (required
//   when WORLD_SIZE > 1), FS_COMM_BACKEND (backend name, default: highest priority),
//   FS_COMM_TIMEOUT_S (default operation timeout in seconds),
//   TORCHELASTIC_USE_AGENT_STORE=True (the launcher hosts the TCPStore; otherwise rank 0 does),
//   FS_STORE_TOKEN (the job token the TCPStore server demands; fs_launch generates it),
//   FS_STORE_PREFIX (a namespace for every store key; fs_launch sets one per restart attempt).
// Without RANK and WORLD_SIZE, the rank and size come from the launcher that started the
// process, in this order: mpirun (OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK, or PMI_RANK /
// PMI_SIZE / MPI_LOCALRANKID; when both are set they must agree), then Slurm's srun
// (SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID; last, because mpirun inside an allocation
// inherits the batch step's). An explicit LOCAL_RANK wins over the launcher's local rank.
struct EnvConfig {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;
  int master_port = 0;
  std::string backend;
  absl::Duration timeout = absl::Minutes(10);
  bool use_agent_store = false;
  std::string store_token;
  std::string store_prefix;
  // Which variables gave rank and size: "RANK/WORLD_SIZE", "OMPI_COMM_WORLD_*", "PMI_*" or
  // "SLURM_*".
  std::string rank_source;
};

// Parses and validates the variables above; kInvalidArgument names the variable at fault.
absl::StatusOr<EnvConfig> ParseEnv();

// ParseEnv(), then a TCPStore at MASTER_ADDR:MASTER_PORT, then CreateCommunicator.
// `base` supplies the fields the environment does not (bind_address, options; timeout unless
// FS_COMM_TIMEOUT_S is set; a store, which then replaces the TCPStore). Rank 0 hosts the
// TCPStore server, bound to MASTER_ADDR, unless TORCHELASTIC_USE_AGENT_STORE=True (then every
// rank is a client of the launcher's); the TCPStore presents FS_STORE_TOKEN, and with
// FS_STORE_PREFIX it is wrapped in a PrefixStore. WORLD_SIZE=1 uses an in-memory HashStore.
absl::StatusOr<std::shared_ptr<Communicator>> CreateCommunicatorFromEnv(
    const CommConfig& base = {});

}  // namespace fairscale::comm
