#include "examples/gpt/train_loop.h"

#include <ATen/ops/from_blob.h>
#include <torch/nn/functional/loss.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "examples/gpt/metrics_file.h"
#include "examples/gpt/svg_plot.h"
#include "train_state/step_dir.h"

namespace fairscale::examples::gpt::internal {

absl::StatusOr<GptConfig> JobGptConfig(const TrainConfig& config, int64_t vocab) {
  GptConfig gc = GptConfig()
                     .vocab(vocab)
                     .seq(config.seq)
                     .width(config.width)
                     .heads(config.heads)
                     .blocks(config.blocks)
                     .moe_experts(config.moe_experts);
  // A pipeline checkpoints whole stages per micro-batch (parallel_model.cc), not blocks.
  if (config.pipeline_stages == 1) {
    absl::StatusOr<int64_t> every_k = ParseCheckpointActivations(config.checkpoint_activations);
    if (!every_k.ok()) return every_k.status();
    gc.checkpoint_every_k(*every_k);
  }
  return gc;
}

std::string HumanBytes(double b) {
  if (b >= 1 << 30) return absl::StrFormat("%.1fG", b / (1 << 30));
  return absl::StrFormat("%.0fM", b / (1 << 20));
}

std::string HumanDuration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const int64_t t = static_cast<int64_t>(std::lround(s));
  if (t >= 3600) return absl::StrFormat("%dh%02dm", t / 3600, t / 60 % 60);
  if (t >= 60) return absl::StrFormat("%dm%02ds", t / 60, t % 60);
  return absl::StrFormat("%ds", t);
}

at::Tensor BatchLoss(ParallelModel& model, std::vector<int64_t> rows, int64_t seq,
                     int64_t vocab) {
  const int64_t n = static_cast<int64_t>(rows.size()) / (seq + 1);
  at::Tensor data = at::from_blob(rows.data(), {n, seq + 1}, at::kLong).clone();
  at::Tensor input = data.narrow(1, 0, seq);
  if (model.computes_loss()) return model.loss(input, data.narrow(1, 1, seq));
  at::Tensor logits = model.forward(input);
  return torch::nn::functional::cross_entropy(logits.to(at::kFloat).reshape({-1, vocab}),
                                              data.narrow(1, 1, seq).reshape({-1}));
}

std::string ProgressLine(const TrainConfig& config, int64_t step, double loss, double val,
                         absl::string_view extra, double tokens_per_s, double eta_s,
                         const std::vector<int64_t>& rss, int first_rank) {
  constexpr int kBar = 20;
  const int filled = static_cast<int>(kBar * step / std::max<int64_t>(1, config.steps));
  std::string line = absl::StrFormat(
      "step %*d/%d [%s%s] loss %.4f", static_cast<int>(std::to_string(config.steps).size()),
      step, config.steps, std::string(filled, '#'), std::string(kBar - filled, '.'), loss);
  if (std::isfinite(val)) absl::StrAppendFormat(&line, " val %.4f", val);
  absl::StrAppend(&line, extra);
  absl::StrAppendFormat(&line, " | %.0f tok/s | ETA %s | rss", tokens_per_s,
                        HumanDuration(eta_s));
  for (size_t i = 0; i < rss.size(); ++i) {
    absl::StrAppend(&line, " r", first_rank + static_cast<int>(i), " ", HumanBytes(rss[i]));
  }
  return line;
}

void PrintProgress(const TrainConfig& config, const std::string& line, int64_t step,
                   int64_t first, int64_t last) {
  if (isatty(STDOUT_FILENO)) {
    std::printf("\r%s\033[K", line.c_str());
    if (step == last) std::printf("\n");
  } else if (step == first || step == last ||
             (config.log_every > 0 && step % config.log_every == 0)) {
    std::printf("%s\n", line.c_str());
  }
  std::fflush(stdout);
}

absl::Status WriteLossPlot(const TrainConfig& config, const std::vector<nlohmann::json>& records,
                           int world, const std::string& mode) {
  if (config.plot_path.empty()) return absl::OkStatus();
  PlotSeries train{"train loss", "#1f77b4", {}}, val{"val loss", "#d62728", {}};
  for (const nlohmann::json& j : records) {
    const std::string type = j.value("type", "");
    if ((type != "train" && type != "val") || !j.contains("loss")) continue;
    const std::optional<double> loss = ReadMetricNumber(j["loss"]);
    if (!loss.has_value() || !std::isfinite(*loss)) continue;  // a NaN / inf has no point
    (type == "train" ? train : val).points.emplace_back(j["step"].get<double>(), *loss);
  }
  std::error_code ec;
  const std::filesystem::path parent = std::filesystem::path(config.plot_path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  return train_state::WriteFileAtomic(
      config.plot_path,
      LinePlotSvg({train, val},
                  absl::StrFormat("GPT %lldx%lld on KJV Genesis+Exodus, %d ranks, %s, %s",
                                  static_cast<long long>(config.blocks),
                                  static_cast<long long>(config.width), world, mode,
                                  config.precision),
                  "step", "cross-entropy loss (nats/char)"));
}

void PrintSummary(const TrainConfig& config, const TrainResult& result, double wall_s) {
  std::printf("train_gpt: done in %s: train loss %.4f, val loss %.4f\n",
              HumanDuration(wall_s).c_str(), result.train_loss, result.val_loss);
  // The full parameters' hash (also in the metrics' final record): two runs trained the same
  // model exactly when it matches (with --deterministic, at any world size).
  if (!result.full_param_hashes.empty()) {
    std::printf("  full parameter hash: %016llx%s\n",
                static_cast<unsigned long long>(result.full_param_hashes[0]),
                config.deterministic ? " (deterministic mode)" : "");
  }
  if (!config.metrics_path.empty()) std::printf("  metrics: %s\n", config.metrics_path.c_str());
  if (!config.plot_path.empty()) std::printf("  plot:    %s\n", config.plot_path.c_str());
  if (!config.checkpoint_dir.empty()) {
    std::printf("  checkpoints: %s\n", config.checkpoint_dir.c_str());
  }
  if (!result.sample.empty()) {
    std::printf("sample (temperature %.2f, top-k %lld):\n%s\n", config.temperature,
                static_cast<long long>(config.top_k), result.sample.c_str());
  }
  std::fflush(stdout);
}

double UnixSeconds() { return absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()); }

}  // namespace fairscale::examples::gpt::internal
