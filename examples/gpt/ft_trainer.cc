#include "examples/gpt/ft_trainer.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/optim/adam.h>
#include <torch/optim/optimizer.h>
#include <torch/utils.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "examples/gpt/data.h"
#include "examples/gpt/metrics_file.h"
#include "examples/gpt/model.h"
#include "examples/gpt/parallel_model.h"
#include "examples/gpt/train_loop.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "ft/hsdp.h"
#include "ft/membership.h"

namespace fairscale::examples::gpt {
namespace {

using Clock = std::chrono::steady_clock;
using comm::MakeBuffer;
using comm::MakeConstBuffer;
using internal::UnixSeconds;

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

// How long ago this process started (/proc/self/stat's starttime against /proc/uptime): the
// "process start" part of a rejoining group's catch-up (exec, loading, flag parsing). 0 if
// unknown.
double ProcessAgeSeconds() {
  std::ifstream stat("/proc/self/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');
  if (paren == std::string::npos) return 0;
  std::istringstream fields(text.substr(paren + 2));
  std::string field;
  // Field 3 (state) is the first after the command; starttime is field 22.
  for (int i = 3; i < 22 && fields >> field; ++i) {
  }
  long long start_ticks = 0;
  if (!(fields >> start_ticks)) return 0;
  double uptime = 0;
  std::ifstream("/proc/uptime") >> uptime;
  const long ticks = ::sysconf(_SC_CLK_TCK);
  if (uptime <= 0 || ticks <= 0) return 0;
  return std::max(0.0, uptime - static_cast<double>(start_ticks) / ticks);
}

// The optimizer FaultTolerantHsdp steps: `inner` (the group's Adam over its FSDP shards) behind
// a step() that first clips the gradient norm. end_step() averages the gradients over the
// quorum's groups and then calls step(), so the clipping sees the averaged gradient, of which
// every group holds the same shards: FSDP's clip_grad_norm_ over the group is the global norm,
// as in trainer.cc's hybrid_shard. The state (save / load, what a joiner receives) is the inner
// optimizer's; zero_grad() works on the same tensors.
class ClipThenStep final : public torch::optim::Optimizer {
 public:
  ClipThenStep(torch::optim::Optimizer& inner, std::function<void()> clip)
      : Optimizer(inner.param_groups(), inner.defaults().clone()),
        inner_(inner),
        clip_(std::move(clip)) {}
  at::Tensor step(LossClosure closure = nullptr) override {
    if (clip_) clip_();
    return inner_.step(std::move(closure));
  }
  void save(torch::serialize::OutputArchive& archive) const override { inner_.save(archive); }
  void load(torch::serialize::InputArchive& archive) override { inner_.load(archive); }

 private:
  torch::optim::Optimizer& inner_;
  std::function<void()> clip_;
};

nlohmann::json Ints(const std::vector<int>& v) { return nlohmann::json(v); }

class FtTrainer {
 public:
  FtTrainer(const TrainConfig& config, const FtRankContext& context)
      : config_(config),
        ctx_(context),
        size_(static_cast<int>(config.hybrid_shard_group_size)),
        group_(context.rank / size_),
        shard_(context.rank % size_),
        num_groups_(context.world_size / size_),
        tokenizer_(Corpus()),
        data_(tokenizer_, Corpus()) {}

  // Tells the peers (membership: this group is dropped at the next round without waiting for
  // dead_after; the group communicator: this group's other ranks fail now).
  void ReportFailure(const absl::Status& status) {
    if (membership_) membership_->ReportFailure(status);
    if (ctx_.group) ctx_.group->Abort(status);
  }

  absl::StatusOr<TrainResult> Run() {
    const double age_at_entry = ProcessAgeSeconds();
    const auto entry = Clock::now();
    const auto process_age = [&] {
      return age_at_entry + std::chrono::duration<double>(Clock::now() - entry).count();
    };
    std::fprintf(stderr,
                 "%strain_gpt: fault-tolerant rank %d: replica group %d shard %d/%d, incarnation "
                 "%d, pid %d\n",
                 base::OutputRankPrefix(ctx_.rank).c_str(), ctx_.rank, group_, shard_, size_,
                 ctx_.incarnation, static_cast<int>(::getpid()));
    std::fflush(stderr);
    if (ctx_.group == nullptr || ctx_.group->size() != size_ || ctx_.group->rank() != shard_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the group communicator must be rank ", shard_, " of ", size_, " (group ", group_, ")"));
    }
    if (!config_.metrics_path.empty()) {  // under another launcher nothing created it
      std::error_code ec;
      const std::filesystem::path parent =
          std::filesystem::path(config_.metrics_path).parent_path();
      if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    }
    const int threads =
        config_.threads > 0
            ? config_.threads
            : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) /
                              std::max(1, ctx_.world_size));
    at::set_num_threads(threads);
    FS_ASSIGN_OR_RETURN(const GptConfig gc,
                        internal::JobGptConfig(config_, tokenizer_.vocab_size()));
    std::vector<int64_t> prompt;
    if (config_.sample_tokens > 0) {
      FS_ASSIGN_OR_RETURN(prompt, tokenizer_.Encode(config_.prompt));
    }
    // FULL_SHARD inside the group; the replication across groups is FaultTolerantHsdp's.
    TrainConfig group_config = config_;
    group_config.strategy = "full_shard";
    group_config.hybrid_shard_group_size = 0;
    torch::manual_seed(config_.seed);  // the same initial weights in every group
    FS_ASSIGN_OR_RETURN(model_, MakeParallelModel(group_config, gc, ctx_.group));
    fsdp::FullyShardedDataParallel* root = model_->fsdp_root();
    if (root == nullptr) return absl::InternalError("the fsdp mode has no FSDP root");

    ft::Membership::Options mo;
    mo.group = group_;
    mo.shard = shard_;
    mo.num_groups = num_groups_;
    mo.group_size = size_;
    mo.heartbeat_interval = absl::Milliseconds(config_.ft_heartbeat_ms);
    mo.dead_after = absl::Milliseconds(config_.ft_dead_after_ms);
    mo.min_groups = static_cast<int>(config_.ft_min_groups);
    mo.name = "ft";
    FS_ASSIGN_OR_RETURN(membership_, ft::Membership::Create(ctx_.store, mo));
    ClipThenStep optimizer(model_->optimizer(), config_.grad_clip > 0
                                                    ? std::function<void()>([this] {
                                                        model_->clip_grad_norm(config_.grad_clip);
                                                      })
                                                    : std::function<void()>());
    comm::CommConfig base = ctx_.base;
    base.name = "ft/";
    const absl::Duration timeout = absl::Seconds(config_.ft_timeout_s);
    ft::FaultTolerantHsdp hsdp(*root, optimizer, *membership_,
                               ft::HsdpOptions()
                                   .backend(ctx_.backend)
                                   .comm_config(base)
                                   .quorum_timeout(timeout)
                                   .commit_timeout(timeout)
                                   .collective_timeout(timeout));
    if (ctx_.rank == 0 && ctx_.incarnation == 0 && config_.progress) {
      std::printf(
          "train_gpt: %d ranks, fault-tolerant: %d replica groups x %d ranks (FSDP full_shard "
          "inside, gradients averaged over each step's quorum), %s, %lld params, vocab %lld, "
          "%lld tokens/step with every group\n",
          ctx_.world_size, num_groups_, size_, config_.precision.c_str(),
          static_cast<long long>(model_->num_params()), static_cast<long long>(gc.vocab()),
          static_cast<long long>(ctx_.world_size * config_.batch * config_.seq));
      std::fflush(stdout);
    }

    TrainResult result;
    double train_loss = std::numeric_limits<double>::quiet_NaN();
    double val_loss = std::numeric_limits<double>::quiet_NaN();
    double timed_s = 0;
    int64_t timed_steps = 0;
    int64_t first_progress = -1;  // the first step this rank printed as the writer
    bool joined = false;          // received the state and not yet committed a step
    double join_startup_s = 0, join_quorum_s = 0, join_transfer_s = 0;
    int join_source = -1;
    std::vector<int> groups;  // of the last committed step
    while (hsdp.step() < config_.steps) {
      const double begin_age = process_age();
      const ft::Quorum& q = hsdp.begin_step();
      const int64_t step = hsdp.step() + 1;  // 1-based, as in trainer.cc
      writer_ = shard_ == 0 && !q.groups.empty() && q.groups.front() == group_;
      {
        const ft::HsdpStepRecord& rec = hsdp.history().back();
        if (q.changed) {
          nlohmann::json m = {{"type", "membership"},
                              {"step", step},
                              {"round", q.round},
                              {"epoch", q.epoch},
                              {"groups", Ints(q.groups)},
                              {"dropped", Ints(q.dropped)},
                              {"joiners", Ints(q.joiners)},
                              {"reasons", q.dropped_reasons},
                              {"quorum_wait_s", MetricNumber(Seconds(rec.quorum_wait))},
                              {"transfer_s", MetricNumber(Seconds(rec.transfer_time))},
                              {"t", MetricNumber(UnixSeconds())}};
          changes_.push_back(m);
          // The writer of the job's first round starts the file afresh.
          if (writer_) {
            FS_RETURN_IF_ERROR(Write(m, /*truncate=*/q.round == 0 && ctx_.incarnation == 0));
          }
        }
        if (rec.received_state && !joined) {
          joined = true;
          join_startup_s = begin_age;
          join_quorum_s = Seconds(rec.quorum_wait);
          join_transfer_s = Seconds(rec.transfer_time);
          join_source = rec.source_group;
        }
      }
      const double lr = LearningRate(config_, step);
      for (auto& group : model_->optimizer().param_groups()) {
        static_cast<torch::optim::AdamOptions&>(group.options()).lr(lr);
      }
      const auto t0 = Clock::now();
      model_->zero_grad();
      at::Tensor loss = internal::BatchLoss(
          *model_,
          data_.Batch(config_.seed, step, ctx_.rank, Split::kTrain, config_.batch, config_.seq),
          config_.seq, tokenizer_.vocab_size());
      loss.backward();
      if (!hsdp.end_step()) continue;  // discarded on every rank; retried at a new epoch
      groups = q.groups;
      const double step_s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (joined) {
        joined = false;
        FS_RETURN_IF_ERROR(ReportJoin(step, join_source, join_startup_s, join_quorum_s,
                                      join_transfer_s, process_age()));
      }
      if (first_progress >= 0 || step > 1) timed_s += step_s, ++timed_steps;
      // The group's losses and peak RSS (one all-gather over the group per step).
      FS_ASSIGN_OR_RETURN(std::vector<double> all,
                          GroupGather({loss.item<double>(), static_cast<double>(PeakRssBytes())}));
      train_loss = 0;
      std::vector<int64_t> rss(size_);
      for (int r = 0; r < size_; ++r) {
        train_loss += all[2 * r] / size_;
        rss[r] = static_cast<int64_t>(all[2 * r + 1]);
      }
      if (!std::isfinite(train_loss)) {
        return absl::InternalError(absl::StrCat("step ", step, ": the loss is ", train_loss,
                                                " (diverged; try a smaller --lr)"));
      }
      const double avg_s = timed_steps > 0 ? timed_s / timed_steps : step_s;
      const int live = static_cast<int>(q.groups.size());
      const double tokens_per_s =
          static_cast<double>(live * size_ * config_.batch * config_.seq) / avg_s;
      const bool eval = step == config_.steps ||
                        (config_.eval_every > 0 && step % config_.eval_every == 0);
      if (eval) {
        FS_ASSIGN_OR_RETURN(val_loss, GroupValLoss());
      }
      if (writer_) {
        FS_RETURN_IF_ERROR(Write({{"type", "train"},
                                  {"step", step},
                                  {"loss", MetricNumber(train_loss)},
                                  {"lr", MetricNumber(lr)},
                                  {"step_s", MetricNumber(step_s)},
                                  {"tokens_per_s", MetricNumber(tokens_per_s)},
                                  {"groups", live},
                                  {"group", group_},
                                  {"epoch", q.epoch},
                                  {"peak_rss_bytes", rss},
                                  {"t", MetricNumber(UnixSeconds())}}));
        if (eval) {
          FS_RETURN_IF_ERROR(
              Write({{"type", "val"}, {"step", step}, {"loss", MetricNumber(val_loss)}}));
        }
        if (config_.progress) {
          if (first_progress < 0) first_progress = step;
          internal::PrintProgress(
              config_,
              internal::ProgressLine(config_, step, train_loss, val_loss,
                                     absl::StrFormat(" | groups %d/%d", live, num_groups_),
                                     tokens_per_s, avg_s * (config_.steps - step), rss,
                                     group_ * size_),
              step, first_progress, config_.steps);
        }
      }
      result.last_step = step;
      // After the step's records (the writer may be the rank killed).
      if (ctx_.rank == config_.fault_rank && step == config_.fault_step) {
        std::fprintf(stderr, "%strain_gpt: fault injection: SIGKILL after step %lld at t=%.3f\n",
                     base::OutputRankPrefix(ctx_.rank).c_str(), static_cast<long long>(step),
                     UnixSeconds());
        std::fflush(stderr);
        ::raise(SIGKILL);
      }
    }
    membership_->Leave();  // every group committed the last step: nothing more to agree on

    result.train_loss = train_loss;
    result.val_loss = val_loss;
    FS_ASSIGN_OR_RETURN(result.param_hashes, GroupHashes(model_->param_hash()));
    uint64_t full = 0;
    try {
      full = model_->full_param_hash();
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("summon_full_params: ", e.what()));
    }
    FS_ASSIGN_OR_RETURN(result.full_param_hashes, GroupHashes(full));
    std::printf("train_gpt: rank %d (group %d shard %d, incarnation %d): full parameter hash "
                "%016llx\n",
                ctx_.rank, group_, shard_, ctx_.incarnation, static_cast<unsigned long long>(full));
    std::fflush(stdout);
    if (config_.sample_tokens > 0) {  // collective in the group (FSDP forwards)
      std::vector<int64_t> ids = generate(
          [&](torch::Tensor t) { return model_->forward(t); }, prompt, config_.sample_tokens,
          config_.seq,
          SampleOptions().temperature(config_.temperature).top_k(config_.top_k).seed(config_.seed));
      result.sample = config_.prompt + tokenizer_.Decode(ids);
    }
    if (writer_) FS_RETURN_IF_ERROR(Finish(result, groups, process_age()));
    return result;
  }

 private:
  absl::Status Write(const nlohmann::json& record, bool truncate = false) {
    if (config_.metrics_path.empty()) return absl::OkStatus();
    return AppendMetricsRecord(config_.metrics_path, record, truncate);
  }

  // A group that received the state committed its first step: how long it took to catch up.
  absl::Status ReportJoin(int64_t step, int source, double startup_s, double quorum_s,
                          double transfer_s, double age_s) {
    if (shard_ != 0) return absl::OkStatus();
    std::printf(
        "train_gpt: group %d (incarnation %d) rejoined at step %lld from group %d: process start "
        "to its first quorum %.2fs, quorum wait %.2fs, state transfer %.3fs, first step "
        "committed %.2fs after the process started\n",
        group_, ctx_.incarnation, static_cast<long long>(step), source, startup_s, quorum_s,
        transfer_s, age_s);
    std::fflush(stdout);
    return Write({{"type", "join"},
                  {"step", step},
                  {"group", group_},
                  {"incarnation", ctx_.incarnation},
                  {"source_group", source},
                  {"startup_s", MetricNumber(startup_s)},
                  {"quorum_wait_s", MetricNumber(quorum_s)},
                  {"transfer_s", MetricNumber(transfer_s)},
                  {"first_commit_s", MetricNumber(age_s)},
                  {"t", MetricNumber(UnixSeconds())}});
  }

  // The final writer's records and summary, with the membership history as this rank saw it.
  absl::Status Finish(const TrainResult& result, const std::vector<int>& groups, double wall_s) {
    nlohmann::json hashes = nlohmann::json::array(), full_hashes = nlohmann::json::array();
    for (uint64_t h : result.param_hashes) hashes.push_back(absl::StrFormat("%016x", h));
    for (uint64_t h : result.full_param_hashes) full_hashes.push_back(absl::StrFormat("%016x", h));
    const std::string mode = absl::StrFormat("fault-tolerant hybrid_shard %dx%d", num_groups_,
                                             size_);
    FS_RETURN_IF_ERROR(Write({{"type", "final"},
                              {"step", config_.steps},
                              {"mode", mode},
                              {"train_loss", MetricNumber(result.train_loss)},
                              {"val_loss", MetricNumber(result.val_loss)},
                              {"wall_s", MetricNumber(wall_s)},
                              {"groups", Ints(groups)},
                              {"group", group_},
                              {"param_fnv1a64", hashes},
                              {"full_param_fnv1a64", full_hashes},
                              {"membership", changes_}}));
    if (config_.sample_tokens > 0) {
      FS_RETURN_IF_ERROR(
          Write({{"type", "sample"}, {"step", config_.steps}, {"text", result.sample}}));
    }
    if (!config_.metrics_path.empty()) {
      // Every writer's records (the file, not this process's share of it).
      FS_RETURN_IF_ERROR(internal::WriteLossPlot(
          config_, ReadMetricsForResume(config_.metrics_path, config_.steps).records,
          ctx_.world_size, mode));
    }
    if (!config_.progress) return absl::OkStatus();
    std::printf("train_gpt: membership history (as group %d saw it):\n", group_);
    for (const nlohmann::json& m : changes_) {
      std::string line = absl::StrFormat("  step %d epoch %d: groups %s", m["step"].get<int64_t>(),
                                         m["epoch"].get<int64_t>(), m["groups"].dump());
      if (!m["dropped"].empty()) {
        absl::StrAppend(&line, ", dropped ", m["dropped"].dump(), " (",
                        absl::StrJoin(m["reasons"].get<std::vector<std::string>>(), "; "), ")");
      }
      if (!m["joiners"].empty()) absl::StrAppend(&line, ", joiners ", m["joiners"].dump());
      absl::StrAppendFormat(&line, ", quorum wait %.2fs", *ReadMetricNumber(m["quorum_wait_s"]));
      if (!m["joiners"].empty()) {
        absl::StrAppendFormat(&line, ", transfer %.3fs", *ReadMetricNumber(m["transfer_s"]));
      }
      std::printf("%s\n", line.c_str());
    }
    internal::PrintSummary(config_, result, wall_s);
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<double>> GroupGather(std::vector<double> mine) {
    std::vector<double> all(mine.size() * size_);
    FS_RETURN_IF_ERROR(ctx_.group
                           ->AllGather(MakeConstBuffer(mine.data(), mine.size()),
                                       MakeBuffer(all.data(), all.size()))
                           .Wait());
    return all;
  }

  // Exchanged as two 32-bit halves in doubles (exact), as trainer.cc does.
  absl::StatusOr<std::vector<uint64_t>> GroupHashes(uint64_t h) {
    FS_ASSIGN_OR_RETURN(
        std::vector<double> all,
        GroupGather({static_cast<double>(h >> 32), static_cast<double>(h & 0xffffffffu)}));
    std::vector<uint64_t> out(size_);
    for (int r = 0; r < size_; ++r) {
      out[r] = static_cast<uint64_t>(all[2 * r]) << 32 | static_cast<uint64_t>(all[2 * r + 1]);
    }
    return out;
  }

  // The mean loss of eval_batches fixed validation batches per rank over this group's ranks
  // (trainer.cc's ValLoss over the group: every group evaluates on its own).
  absl::StatusOr<double> GroupValLoss() {
    torch::NoGradGuard no_grad;
    double sum = 0;
    for (int64_t i = 0; i < config_.eval_batches; ++i) {
      sum += internal::BatchLoss(*model_,
                                 data_.Batch(config_.seed, -1 - i, ctx_.rank, Split::kVal,
                                             config_.batch, config_.seq),
                                 config_.seq, tokenizer_.vocab_size())
                 .item<double>();
    }
    FS_ASSIGN_OR_RETURN(std::vector<double> all, GroupGather({sum}));
    double total = 0;
    for (double v : all) total += v;
    return total / (size_ * std::max<int64_t>(1, config_.eval_batches));
  }

  TrainConfig config_;
  FtRankContext ctx_;
  int size_, group_, shard_, num_groups_;
  CharTokenizer tokenizer_;
  TokenData data_;
  std::unique_ptr<ParallelModel> model_;
  std::unique_ptr<ft::Membership> membership_;
  bool writer_ = false;                  // shard 0 of the current quorum's lowest group
  std::vector<nlohmann::json> changes_;  // the membership records this rank saw
};

}  // namespace

std::string FtGroupCommName(int group, int incarnation) {
  return absl::StrCat("ft/g", group, "/i", incarnation);
}

absl::StatusOr<TrainResult> TrainFaultTolerantRank(const TrainConfig& config,
                                                   const FtRankContext& context) {
  FS_RETURN_IF_ERROR(config.Validate());
  if (!config.fault_tolerant) {
    return absl::InvalidArgumentError("TrainFaultTolerantRank needs config.fault_tolerant");
  }
  if (context.world_size % config.hybrid_shard_group_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("hybrid_shard_group_size ", config.hybrid_shard_group_size,
                     " does not divide the rank count ", context.world_size));
  }
  const int s = static_cast<int>(config.hybrid_shard_group_size);
  const std::string where = absl::StrCat("rank ", context.rank, "/", context.world_size,
                                         " (group ", context.rank / s, " shard ",
                                         context.rank % s, ", incarnation ", context.incarnation,
                                         ")");
  absl::Status status;
  std::unique_ptr<FtTrainer> trainer;
  try {
    trainer = std::make_unique<FtTrainer>(config, context);
    absl::StatusOr<TrainResult> r = trainer->Run();
    if (r.ok()) return r;
    status = absl::Status(r.status().code(), absl::StrCat(where, ": ", r.status().message()));
  } catch (const ft::NothingToRejoin& e) {
    // Back after every other group finished and left: the run is over (kCancelled: exit 0).
    return absl::CancelledError(absl::StrCat(where, ": ", e.what_without_backtrace()));
  } catch (const c10::Error& e) {
    status = absl::InternalError(absl::StrCat(where, ": ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    status = absl::InternalError(absl::StrCat(where, ": ", e.what()));
  }
  if (trainer) trainer->ReportFailure(status);
  return status;
}

}  // namespace fairscale::examples::gpt
