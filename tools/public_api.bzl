"""The supported API of fairscale-cpp: every target another repository may depend on.

These targets, and no others, have `visibility = ["//visibility:public"]`. Every package defaults
to private; helpers shared inside this repository are visible to `//:__subpackages__` (which,
written in our BUILD files, means this repository's packages, also when it is consumed as
@fairscale_cpp), and may change or go away at any time.

tools/check_public_api.sh (run by .ci/run) fails when
`bazel query 'attr(visibility, "//visibility:public", //...)'` finds other targets than these
(making a target public, or private, is a decision recorded here), or when the table in README.md
("What your repository may depend on") names others.

//tools:deps_test derives its feature targets from this list with a query: every cc_library in it
except BACKENDS and whatever registers itself at static-init time (alwayslink). None of them may
reach a backend.
"""

# The training libraries (LibTorch idioms: ModuleHolders, options with chained setters). They
# take a Communicator; none links a backend.
FEATURE_LIBRARIES = [
    "//fsdp",  # FullyShardedDataParallel, wrap policies, state dicts, sharded checkpoints
    "//oss",  # OSS (optimizer state sharding), ShardedDataParallel
    "//amp",  # GradScaler, ShardedGradScaler, LayerwiseGradientScaler, Autocast
    "//checkpoint",  # activation checkpointing: checkpoint(), CheckpointWrapper
    "//checkpoint:memory_tracker",  # per-module memory tracer, where to checkpoint for a budget
    "//base:tracking_allocator",  # TrackingCpuAllocator, which MemoryTracker counts with
    "//offload",  # OffloadedAdam, OffloadModel
    "//pipe",  # Pipe, PipeGrid, balancing
    "//deterministic",  # deterministic mode: the micro-batch tree, tree-order reductions, exact norms
    "//pipe:fsdp_stage",  # FSDP inside each pipeline stage
    "//autograd_comm",  # differentiable collectives: tensor / sequence parallel mappings, all_to_all
    "//model_parallel",  # tensor-parallel layers: Column/RowParallelLinear, VocabParallelEmbedding, vocab-parallel cross-entropy, the tensor x pipeline x data grid
    "//model_parallel:pipe_grid",  # ToPipeGrid: the pipe::PipeGrid view of a ParallelGrid
    "//moe",  # MOELayer, Top1Gate, Top2Gate: mixture of experts over an expert-parallel group
    "//sync_batchnorm",  # SyncBatchNorm (batch statistics over a group), convert_sync_batchnorm
    "//adascale",  # AdaScale: the LR scaled by the gain ratio from per-rank gradient variance, scale-invariant progress
    "//adascale:fsdp",  # AdaScaleFsdp: AdaScale over FullyShardedDataParallel (local squares from fsdp's local gradient hook)
    "//adascale:oss",  # AdaScaleSdp: AdaScale over oss::ShardedDataParallel (local squares from its local gradient hook)
    "//slowmo",  # SlowMo, LocalSGD: local steps, an exact parameter average every H steps, the slow-momentum outer step
    "//mevo",  # mevo_cross_entropy, MevoLoss: the LM head's projection + cross-entropy in tiles, no [T, V] logits
    "//trace",  # Chrome traces, TracingCommunicator, the compute/communication profile
    "//launch:launcher",  # what fs_launch does, as a library (a job that launches itself)
    "//train_state",  # CheckpointManager, TrainState, the built-in items (sync and async saves)
    "//train_state:fsdp_item",  # an FSDP model + optimizer as a TrainState item
    "//train_state:sampler",  # DistributedSampler: the data order, resumable at any world size
    "//train_state:step_dir",  # step directories and the COMPLETE marker (no LibTorch)
    "//ft:hsdp",  # FaultTolerantHsdp: FSDP per replica group, cross-group average per quorum, state transfer to a returning group
]

# The communication layer (Google style: absl::Status). Backend-free as well.
COMM = [
    "//comm:interface",  # Communicator, Work, types: all a feature library needs
    "//comm:config",  # CommConfig
    "//comm:registry",  # CreateCommunicator / CreateCommunicatorFromEnv: binaries and tests
    "//comm:replace",  # ReplaceCommunicator: a failed communicator replaced in-process, per epoch
    "//ft",  # Membership: heartbeats, the per-step quorum of replica groups, epochs (in-process recovery)
    "//comm/torch",  # at::Tensor <-> Buffer
    "//comm/torch:c10d_store",  # the "c10d" store client (torchrun's agent store); links a registration
    "//comm/store",  # the Store interface
    "//comm/store:file_store",
    "//comm/store:hash_store",
    "//comm/store:prefix_store",
    "//comm/store:tcp_store",
]

# The backends: a binary (or test) chooses its network by linking one, or all.
BACKENDS = [
    "//comm/tcp",
    "//comm/ucx",
    "//comm/nccl",  # registers "nccl" under --config=cuda only
    "//comm/inproc",  # ranks as threads of one process
    "//comm:all_backends",
]

BINARIES = [
    "//launch:fs_launch",  # the torchrun-like launcher
    "//fsdp:consolidate_checkpoint",  # sharded checkpoint -> one state dict file
]

# Build settings: the repositories fairscale_cpp_dependencies() generates mark absent libraries
# with //bazel:incompatible; if_cuda() and REQUIRES_CUDA (bazel/defs.bzl) select on //bazel:cuda.
BUILD_SETTINGS = [
    "//bazel:cuda",
    "//bazel:incompatible",
]

PUBLIC_API = FEATURE_LIBRARIES + COMM + BACKENDS + BINARIES + BUILD_SETTINGS
