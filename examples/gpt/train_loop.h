// Pieces of a rank's training loop that the job's two loops share (//examples/gpt:trainer, not
// its API): trainer.cc (one world communicator) and ft_trainer.cc (--fault_tolerant: replica
// groups under ft::FaultTolerantHsdp). The loss of a batch, the validation loss of the fixed
// validation batches, the progress line and its printing, the loss plot and the final summary.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "examples/gpt/parallel_model.h"
#include "examples/gpt/trainer.h"

namespace fairscale::examples::gpt::internal {

// The job's Gpt: vocab, seq, width, heads, blocks, experts and (outside pipeline mode, which
// checkpoints whole stages) the activation checkpointing of the blocks.
absl::StatusOr<GptConfig> JobGptConfig(const TrainConfig& config, int64_t vocab);

std::string HumanBytes(double b);      // "12M", "1.5G"
std::string HumanDuration(double s);   // "42s", "3m07s", "1h02m"; "?" when unknown

// The mean next-token cross-entropy of `rows` ([n, seq + 1] row-major token ids, as
// TokenData::Batch returns them) under `model` (its forward, or its own loss()).
at::Tensor BatchLoss(ParallelModel& model, std::vector<int64_t> rows, int64_t seq, int64_t vocab);

// "step  12/400 [#.....] loss 2.3456 val 2.4000<extra> | 1234 tok/s | ETA 1m02s | rss r0 12M ..."
// with one rss entry per element of `rss`, labelled first_rank, first_rank + 1, ...
std::string ProgressLine(const TrainConfig& config, int64_t step, double loss, double val,
                         absl::string_view extra, double tokens_per_s, double eta_s,
                         const std::vector<int64_t>& rss, int first_rank = 0);

// Prints `line` as the progress line of `step`: redrawn in place on a terminal (a newline at
// `last`), else at `first`, `last` and every config.log_every steps.
void PrintProgress(const TrainConfig& config, const std::string& line, int64_t step,
                   int64_t first, int64_t last);

// The loss plot (config.plot_path; nothing when empty) of the "train" and "val" records.
absl::Status WriteLossPlot(const TrainConfig& config, const std::vector<nlohmann::json>& records,
                           int world, const std::string& mode);

// The end of a run on the rank that reports: "train_gpt: done in ...", the full-parameter hash,
// the output paths and the sample.
void PrintSummary(const TrainConfig& config, const TrainResult& result, double wall_s);

// Seconds since the Unix epoch: the "t" of metrics records, to line them up with other
// processes' (a killed rank's fault-injection line, another writer's records).
double UnixSeconds();

}  // namespace fairscale::examples::gpt::internal
