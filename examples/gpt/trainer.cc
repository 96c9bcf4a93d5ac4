#include "examples/gpt/trainer.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>
#include <unistd.h>

#include <csignal>
#include <cerrno>
#include <cstring>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/match.h"
#include "base/logging.h"
#include "absl/strings/numbers.h"
#include "amp/sharded_grad_scaler.h"
#include "deterministic/collectives.h"
#include "deterministic/tree.h"
#include "base/status_macros.h"
#include "examples/gpt/checkpoints.h"
#include "examples/gpt/data.h"
#include "examples/gpt/metrics_file.h"
#include "examples/gpt/model.h"
#include "examples/gpt/parallel_model.h"
#include "examples/gpt/train_loop.h"
#include "trace/chrome_trace.h"
#include "trace/profile.h"
#include "trace/recorder.h"
#include "trace/tracing_communicator.h"
#include "train_state/checkpoint_manager.h"
#include "train_state/items.h"
#include "train_state/step_dir.h"

namespace fairscale::examples::gpt {
namespace {

using Clock = std::chrono::steady_clock;
using comm::MakeBuffer;
using comm::MakeConstBuffer;

using internal::HumanDuration;
using internal::UnixSeconds;

// Rank 0's metrics file. On resume the records after the checkpoint's step (written by the
// interrupted run) are dropped, so the file reads as one uninterrupted run; malformed lines are
// dropped with a warning naming the file and line (metrics_file.h).
class Metrics {
 public:
  absl::Status Open(const std::string& path, int64_t keep_through_step) {
    path_ = path;
    if (path.empty()) return absl::OkStatus();
    KeptMetrics kept;
    if (keep_through_step > 0) kept = ReadMetricsForResume(path, keep_through_step);
    for (const std::string& w : kept.warnings) {
      std::fprintf(stderr, "train_gpt: warning: %s\n", w.c_str());
    }
    records_ = std::move(kept.records);
    std::error_code ec;
    const std::filesystem::path parent = std::filesystem::path(path).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    FS_RETURN_IF_ERROR(train_state::WriteFileAtomic(path, kept.text));
    out_.open(path, std::ios::app);
    if (!out_) return absl::UnavailableError(absl::StrCat("cannot open metrics file ", path));
    return absl::OkStatus();
  }
  void Write(const nlohmann::json& j) {
    records_.push_back(j);
    if (!out_.is_open()) return;
    out_ << j.dump() << "\n";
    out_.flush();
  }
  const std::vector<nlohmann::json>& records() const { return records_; }

 private:
  std::string path_;
  std::ofstream out_;
  std::vector<nlohmann::json> records_;
};

// The trainer's own item of the training state (kind "json": rank 0's "trainer/state.json"): the
// loss scaler's state when there is one ({} otherwise, so a run may resume with or without
// --loss_scale; the scaler then starts afresh). The data need no item: the batch of a step is a
// function of (seed, step, rank), and the step is the checkpoint's. Fault injection in the
// save (--fault_kill=R:S:save): rank R's write() of step S SIGKILLs the process after its own
// files are written (this item is added last, and a save writes the items in order), before
// rank 0 writes COMPLETE.
class TrainerItem final : public train_state::Stateful {
 public:
  TrainerItem(amp::ShardedGradScaler* scaler, int rank, int64_t fault_step)
      : inner_(train_state::json_item([this] { return Get(); },
                                      [this](const nlohmann::json& j) { Set(j); })),
        scaler_(scaler),
        rank_(rank),
        fault_step_(fault_step) {}
  std::string kind() const override { return inner_->kind(); }
  std::unique_ptr<Snapshot> snapshot(const train_state::SaveContext& context,
                                     std::unique_ptr<Snapshot> reuse) override {
    std::unique_ptr<Snapshot> snap = inner_->snapshot(context, std::move(reuse));
    if (context.step != fault_step_) return snap;
    return std::make_unique<KillAfterWrite>(std::move(snap), rank_, context.step);
  }
  // Checks the file's fields before anything is applied (the file is read again by the inner
  // item: a few bytes).
  std::function<void()> restore(const train_state::RestoreContext& context) override {
    const std::string path = context.dir + "/state.json";
    absl::StatusOr<std::string> text = train_state::ReadFile(path);
    TORCH_CHECK(text.ok(), text.status().ToString());
    const nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
    TORCH_CHECK(j.is_object(), "checkpoint file ", path, " is not a JSON object");
    if (j.contains("grad_scaler")) {
      const nlohmann::json& g = j["grad_scaler"];
      TORCH_CHECK(g.is_object() && g.contains("scale") && g["scale"].is_number() &&
                      g["scale"].get<double>() > 0 && g.contains("growth_tracker") &&
                      g["growth_tracker"].is_number_integer() &&
                      g["growth_tracker"].get<int64_t>() >= 0,
                  "checkpoint file ", path, ": grad_scaler is ", g.dump(),
                  ", not {\"scale\": number > 0, \"growth_tracker\": integer >= 0}");
    }
    return inner_->restore(context);
  }

 private:
  class KillAfterWrite final : public Snapshot {
   public:
    KillAfterWrite(std::unique_ptr<Snapshot> inner, int rank, int64_t step)
        : inner_(std::move(inner)), rank_(rank), step_(step) {}
    absl::StatusOr<train_state::WriteResult> write(const std::string& dir) override {
      absl::StatusOr<train_state::WriteResult> r = inner_->write(dir);
      std::fprintf(stderr,
                   "%strain_gpt: fault injection: SIGKILL in the checkpoint save of step %lld "
                   "(this rank's files written, COMPLETE not yet)\n",
                   base::OutputRankPrefix(rank_).c_str(), static_cast<long long>(step_));
      std::fflush(stderr);
      ::raise(SIGKILL);
      return r;
    }

   private:
    std::unique_ptr<Snapshot> inner_;
    int rank_;
    int64_t step_;
  };

  nlohmann::json Get() const {
    nlohmann::json j = nlohmann::json::object();
    if (scaler_ != nullptr) {
      const amp::GradScalerState st = scaler_->state_dict();
      j["grad_scaler"] = {{"scale", st.scale}, {"growth_tracker", st.growth_tracker}};
    }
    return j;
  }
  // Called when the restore is applied (every item staged without error).
  void Set(const nlohmann::json& j) {
    if (scaler_ == nullptr || !j.is_object() || !j.contains("grad_scaler")) return;
    amp::GradScalerState st = scaler_->state_dict();  // checked by restore()
    st.scale = j["grad_scaler"]["scale"].get<double>();
    st.growth_tracker = j["grad_scaler"]["growth_tracker"].get<int64_t>();
    scaler_->load_state_dict(st);
  }

  std::shared_ptr<train_state::Stateful> inner_;
  amp::ShardedGradScaler* scaler_;
  int rank_;
  int64_t fault_step_;  // -1: none
};

// Runs the job on one rank; throws c10::Error / std::exception for errors below the Status
// layer (LibTorch, FSDP), which TrainRank converts.
class Trainer {
 public:
  Trainer(const TrainConfig& config, std::shared_ptr<comm::Communicator> comm)
      : config_(config),
        plain_comm_(comm),
        comm_(std::move(comm)),
        rank_(comm_->rank()),
        world_(comm_->size()),
        tokenizer_(Corpus()),
        data_(tokenizer_, Corpus()) {
    // Tracing: every collective (FSDP's included) goes through the recording wrapper.
    recorder_ = std::make_shared<trace::Recorder>(rank_, !config_.trace_path.empty());
    if (recorder_->enabled()) {
      recorder_->SetThreadName("main");
      comm_ = std::make_shared<trace::TracingCommunicator>(comm_, recorder_);
    }
  }

  absl::StatusOr<TrainResult> Run() {
    int threads = config_.threads > 0
                      ? config_.threads
                      : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / world_);
    if (config_.deterministic) {
      threads = 1;  // LibTorch's CPU reductions split by thread count
      try {
        layout_ = deterministic::MicroBatchLayout::Make(config_.micro_batches, world_, rank_);
      } catch (const c10::Error& e) {
        return absl::InvalidArgumentError(e.what_without_backtrace());
      }
    }
    at::set_num_threads(threads);
    FS_ASSIGN_OR_RETURN(const GptConfig gc,
                        internal::JobGptConfig(config_, tokenizer_.vocab_size()));
    torch::manual_seed(config_.seed);  // the same initial weights on every rank
    FS_ASSIGN_OR_RETURN(model_, MakeParallelModel(config_, gc, comm_));
    optim_ = &model_->optimizer();
    data_rank_ = model_->data_rank(rank_);
    replicas_ = model_->data_replicas(world_);
    if (config_.loss_scale) scaler_ = std::make_unique<amp::ShardedGradScaler>(comm_);
    FS_RETURN_IF_ERROR(MakeCheckpointManager());

    TrainResult result;
    std::vector<int64_t> prompt;
    if (config_.sample_tokens > 0) {  // a bad prompt fails now, not after training
      FS_ASSIGN_OR_RETURN(prompt, tokenizer_.Encode(config_.prompt));
    }
    FS_ASSIGN_OR_RETURN(result.start_step, MaybeResume());
    if (rank_ == 0) FS_RETURN_IF_ERROR(metrics_.Open(config_.metrics_path, result.start_step));
    if (rank_ == 0 && result.start_step > 0) {
      // The global batch is world size x batch: at another world size it changes (see README).
      metrics_.Write({{"type", "resume"},
                      {"step", result.start_step},
                      {"from_world_size", resumed_from_world_},
                      {"world_size", world_},
                      {"global_batch", GlobalBatch()},
                      {"steps", config_.steps},
                      {"schedule_steps", config_.schedule_length()},
                      {"full_param_fnv1a64", absl::StrFormat("%016x", resumed_full_param_hash_)}});
    }
    if (!config_.checkpoint_dir.empty() && config_.resume == ResumeMode::kNever &&
        config_.overwrite_checkpoints) {
      // A run from step 0 owns the directory: the old checkpoints go before it saves.
      if (rank_ == 0) FS_RETURN_IF_ERROR(RemoveAllCheckpoints(config_.checkpoint_dir));
      FS_RETURN_IF_ERROR(comm_->Barrier().Wait());
    }
    if (rank_ == 0 && config_.progress) {
      std::string options;
      if (config_.checkpoint_activations != "none") {
        absl::StrAppend(&options,
                        config_.pipeline_stages > 1 ? ", checkpointed stage forwards: "
                                                    : ", checkpointed blocks: ",
                        config_.checkpoint_activations);
      }
      if (config_.optimizer_offload == "disk") {
        absl::StrAppend(&options, ", Adam state on disk in ", config_.offload_dir);
      }
      if (result.start_step > 0) {
        absl::StrAppend(&options, ", resumed at step ", result.start_step);
        if (resumed_from_world_ != world_) {
          absl::StrAppend(&options, " (saved at ", resumed_from_world_, " ranks)");
        }
        absl::StrAppendFormat(&options, ", full parameters %016x", resumed_full_param_hash_);
        if (config_.steps > config_.schedule_length()) {
          absl::StrAppendFormat(&options,
                                ", extended from %d to %d steps (learning rate held at %g after "
                                "step %d)",
                                config_.schedule_length(), config_.steps,
                                LearningRate(config_, config_.steps), config_.schedule_length());
        }
      }
      std::printf("train_gpt: %d rank%s, %s, %s, %lld params, vocab %lld, %lld tokens/step%s\n",
                  world_, world_ == 1 ? "" : "s", ModeLabel().c_str(), config_.precision.c_str(),
                  static_cast<long long>(num_params_), static_cast<long long>(gc.vocab()),
                  static_cast<long long>(GlobalBatch() * config_.seq),
                  options.c_str());
      std::fflush(stdout);
    }

    const int64_t last = config_.stop_after > 0 ? std::min(config_.stop_after, config_.steps)
                                                : config_.steps;
    const auto run_start = Clock::now();
    double timed_s = 0;  // steps after the first of this run (which includes warm-up costs)
    int64_t timed_steps = 0;
    double val_loss = std::numeric_limits<double>::quiet_NaN();
    double train_loss = std::numeric_limits<double>::quiet_NaN();
    for (const nlohmann::json& j : metrics_.records()) {  // the last losses before a resume
      // (ReadMetricsForResume kept only records whose loss reads as a number.)
      const std::string type = j.value("type", "");
      if (type == "train" && j.contains("loss")) train_loss = *ReadMetricNumber(j["loss"]);
      if (type == "val" && j.contains("loss")) val_loss = *ReadMetricNumber(j["loss"]);
    }
    for (int64_t step = result.start_step + 1; step <= last; ++step) {
      const auto t0 = Clock::now();
      const double lr = LearningRate(config_, step);
      for (torch::optim::Optimizer* o : {optim_, model_->expert_optimizer()}) {
        if (o == nullptr) continue;
        for (auto& group : o->param_groups()) {
          static_cast<torch::optim::AdamOptions&>(group.options()).lr(lr);
        }
      }
      model_->start_step(step);
      double aux_loss = std::numeric_limits<double>::quiet_NaN();
      at::Tensor loss;
      std::vector<double> micro_losses;  // deterministic mode: this rank's, in order
      if (layout_) {
        // Deterministic mode: this rank's block of the step's micro-batches, a forward and a
        // backward each; the library reduces after the last one.
        trace::Scope scope(recorder_.get(), "forward+backward", trace::kCategoryCompute,
                           {{"step", step}});
        model_->zero_grad();
        if (model_->computes_loss()) {
          // A pipeline replica runs its block of the micro-batches as the pipe's chunks; the
          // pipe reduces over the replicas and returns the step's tree-mean loss.
          loss = Loss(ReplicaRows(step, Split::kTrain));
        }
        for (int64_t j = layout_->first();
             !model_->computes_loss() && j < layout_->first() + layout_->per_rank(); ++j) {
          at::Tensor l = Loss(data_.Batch(config_.seed, step, static_cast<int>(j), Split::kTrain,
                                          config_.batch, config_.seq));
          micro_losses.push_back(l.item<double>());
          if (scaler_) {
            scaler_->scale(l).backward();
          } else {
            l.backward();
          }
        }
      } else {
        trace::Scope scope(recorder_.get(), "forward", trace::kCategoryCompute, {{"step", step}});
        model_->zero_grad();
        loss = Loss(data_.Batch(config_.seed, step, data_rank_, Split::kTrain, config_.batch,
                                config_.seq));
      }
      if (!layout_ && !model_->computes_loss()) {  // the pipeline ran its backward in Loss()
        trace::Scope scope(recorder_.get(), "backward", trace::kCategoryCompute, {{"step", step}});
        at::Tensor objective = loss;
        if (at::Tensor aux = model_->aux_loss(); aux.defined()) {  // mixture of experts
          aux_loss = aux.item<double>();
          objective = loss + config_.moe_aux_loss_coef * aux;
        }
        if (scaler_) {
          scaler_->scale(objective).backward();
        } else {
          objective.backward();
        }
      }
      const double loss_scale = scaler_ ? scaler_->get_scale() : 1.0;  // this step's
      bool stepped = true;
      {
        trace::Scope scope(recorder_.get(), "optimizer", trace::kCategoryCompute,
                           {{"step", step}});
        if (config_.grad_clip > 0) {
          if (scaler_) scaler_->unscale_(*optim_);  // clip the true gradients
          model_->clip_grad_norm(config_.grad_clip);
        }
        if (scaler_) {
          stepped = scaler_->step(*optim_);  // the same verdict on every rank
          scaler_->update();
        } else {
          optim_->step();
          if (torch::optim::Optimizer* experts = model_->expert_optimizer()) experts->step();
        }
      }
      if (rank_ == config_.fault_rank && step == config_.fault_step && !config_.fault_in_save) {
        std::fprintf(stderr, "%strain_gpt: fault injection: SIGKILL after step %lld at t=%.3f\n",
                     base::OutputRankPrefix(rank_).c_str(), static_cast<long long>(step),
                     UnixSeconds());
        std::fflush(stderr);
        ::raise(SIGKILL);
      }
      const double step_s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (step > result.start_step + 1) timed_s += step_s, ++timed_steps;

      // One all-gather per step: every rank's loss and peak RSS.
      FS_ASSIGN_OR_RETURN(std::vector<double> all,
                          Gather({layout_ ? 0.0 : loss.item<double>(),
                                  static_cast<double>(PeakRssBytes())}));
      train_loss = 0;
      std::vector<int64_t> rss(world_);
      for (int r = 0; r < world_; ++r) {
        train_loss += all[2 * r] / world_;
        rss[r] = static_cast<int64_t>(all[2 * r + 1]);
      }
      if (layout_ && model_->computes_loss()) {
        train_loss = loss.item<double>();
      } else if (layout_) {
        // The micro-batch losses' mean over the canonical tree: the same bits at any world size.
        FS_ASSIGN_OR_RETURN(train_loss, TreeMean(micro_losses, "train loss"));
      }
      if (!std::isfinite(train_loss)) {
        return absl::InternalError(absl::StrCat("step ", step, ": the loss is ", train_loss,
                                                " (diverged; try a smaller --lr)"));
      }
      const double avg_s = timed_steps > 0 ? timed_s / timed_steps : step_s;
      const double tokens_per_s =
          static_cast<double>(GlobalBatch() * config_.seq) / avg_s;
      const bool eval = step == config_.steps ||
                        (config_.eval_every > 0 && step % config_.eval_every == 0);
      if (eval) {
        trace::Scope scope(recorder_.get(), "eval", trace::kCategoryCompute, {{"step", step}});
        FS_ASSIGN_OR_RETURN(val_loss, ValLoss());
      }
      if (rank_ == 0) {
        // Floating-point fields through MetricNumber: a NaN / inf reads back (metrics_file.h).
        nlohmann::json j = {{"type", "train"},
                            {"step", step},
                            {"loss", MetricNumber(train_loss)},
                            {"lr", MetricNumber(lr)},
                            {"step_s", MetricNumber(step_s)},
                            {"t", MetricNumber(UnixSeconds())},
                            {"tokens_per_s", MetricNumber(tokens_per_s)},
                            {"peak_rss_bytes", rss}};
        if (scaler_) {
          j["loss_scale"] = MetricNumber(loss_scale);
          j["step_skipped"] = !stepped;
        }
        if (config_.moe_experts > 0) j["aux_loss"] = MetricNumber(aux_loss);  // rank 0's
        metrics_.Write(j);
        if (eval) {
          metrics_.Write({{"type", "val"}, {"step", step}, {"loss", MetricNumber(val_loss)}});
        }
        if (config_.progress) {
          internal::PrintProgress(
              config_,
              internal::ProgressLine(config_, step, train_loss, val_loss, "", tokens_per_s,
                                     avg_s * (last - step), rss),
              step, result.start_step + 1, last);
        }
      }
      if (!config_.checkpoint_dir.empty() &&
          ((config_.checkpoint_every > 0 && step % config_.checkpoint_every == 0) ||
           step == config_.steps)) {
        trace::Scope scope(recorder_.get(), "checkpoint", "io", {{"step", step}});
        FS_RETURN_IF_ERROR(SaveCheckpoint(step));
      }
      result.last_step = step;
    }
    FS_RETURN_IF_ERROR(WaitForCheckpoint());
    FS_RETURN_IF_ERROR(FinishTrace());
    result.train_loss = train_loss;
    result.val_loss = val_loss;
    FS_ASSIGN_OR_RETURN(result.param_hashes, ParamHashes());
    FS_ASSIGN_OR_RETURN(result.full_param_hashes, FullParamHashes());
    if (last < config_.steps) return result;  // stopped early, as if killed

    // The pipeline has no rank holding the whole model; the tensor-parallel forward gathers the
    // logits on every rank (all ranks sample in lockstep, as under FSDP).
    if (config_.sample_tokens > 0 && config_.pipeline_stages > 1) {
      if (rank_ == 0 && config_.progress) {
        std::printf("train_gpt: no sample in pipeline mode (no rank holds the whole model)\n");
      }
    } else if (config_.sample_tokens > 0) {
      std::vector<int64_t> ids = generate(
          [&](torch::Tensor t) { return model_->forward(t); }, prompt, config_.sample_tokens, config_.seq,
          SampleOptions().temperature(config_.temperature).top_k(config_.top_k).seed(config_.seed));
      result.sample = config_.prompt + tokenizer_.Decode(ids);
    }
    if (rank_ == 0) {
      const double wall_s = std::chrono::duration<double>(Clock::now() - run_start).count();
      nlohmann::json hashes = nlohmann::json::array();
      for (uint64_t h : result.param_hashes) hashes.push_back(absl::StrFormat("%016x", h));
      nlohmann::json full_hashes = nlohmann::json::array();
      for (uint64_t h : result.full_param_hashes) full_hashes.push_back(absl::StrFormat("%016x", h));
      metrics_.Write({{"type", "final"},
                      {"step", config_.steps},
                      {"mode", ModeLabel()},
                      {"train_loss", MetricNumber(train_loss)},
                      {"val_loss", MetricNumber(val_loss)},
                      {"wall_s", MetricNumber(wall_s)},
                      {"param_fnv1a64", hashes},
                      {"full_param_fnv1a64", full_hashes}});
      if (config_.sample_tokens > 0) {
        metrics_.Write({{"type", "sample"}, {"step", config_.steps}, {"text", result.sample}});
      }
      FS_RETURN_IF_ERROR(WritePlot());
      if (config_.progress) internal::PrintSummary(config_, result, wall_s);
    }
    return result;
  }

 private:
  // Sequences per step over all ranks: M micro-batches of `batch` in deterministic mode, else
  // `batch` per data-parallel replica.
  int64_t GlobalBatch() const {
    return (layout_ ? config_.micro_batches : replicas_) * config_.batch;
  }

  // Deterministic pipeline mode: this replica's micro-batches of `step` (of `split`), back to
  // back: [replica c, (replica + 1) c) with c = M / replicas.
  std::vector<int64_t> ReplicaRows(int64_t step, Split split) {
    const int64_t c = config_.micro_batches / replicas_;
    std::vector<int64_t> rows;
    for (int64_t j = data_rank_ * c; j < (data_rank_ + 1) * c; ++j) {
      std::vector<int64_t> b =
          data_.Batch(config_.seed, step, static_cast<int>(j), split, config_.batch, config_.seq);
      rows.insert(rows.end(), b.begin(), b.end());
    }
    return rows;
  }

  at::Tensor Loss(std::vector<int64_t> rows) {
    return internal::BatchLoss(*model_, std::move(rows), config_.seq, tokenizer_.vocab_size());
  }

  std::string ModeLabel() const { return model_->label(); }

  // Deterministic mode: the tree mean of the step's micro-batch values (collective).
  absl::StatusOr<double> TreeMean(const std::vector<double>& mine, const std::string& what) {
    try {
      return deterministic::Mean(*comm_, *layout_, mine, what);
    } catch (const c10::Error& e) {
      return absl::InternalError(e.what_without_backtrace());
    }
  }

  // Mean loss over eval_batches fixed validation batches per rank, averaged over ranks;
  // deterministic mode: over the validation split's micro-batches 0..M-1 (the tree mean).
  absl::StatusOr<double> ValLoss() {
    torch::NoGradGuard no_grad;
    if (layout_ && model_->computes_loss()) {
      return Loss(ReplicaRows(-1, Split::kVal)).item<double>();  // the pipe's tree mean
    }
    if (layout_) {
      std::vector<double> mine;
      for (int64_t j = layout_->first(); j < layout_->first() + layout_->per_rank(); ++j) {
        mine.push_back(Loss(data_.Batch(config_.seed, -1, static_cast<int>(j), Split::kVal,
                                        config_.batch, config_.seq))
                           .item<double>());
      }
      return TreeMean(mine, "validation loss");
    }
    double sum = 0;
    for (int64_t i = 0; i < config_.eval_batches; ++i) {
      // Fixed batches (step key -1 - i): every evaluation scores the same text.
      sum += Loss(data_.Batch(config_.seed, -1 - i, data_rank_, Split::kVal, config_.batch,
                              config_.seq))
                 .item<double>();
    }
    double total = 0;
    FS_RETURN_IF_ERROR(comm_->AllReduce(MakeConstBuffer(&sum, 1), MakeBuffer(&total, 1),
                                        comm::ReduceOp::kSum)
                           .Wait());
    return total / (world_ * std::max<int64_t>(1, config_.eval_batches));
  }

  absl::StatusOr<std::vector<double>> Gather(std::vector<double> mine) {
    std::vector<double> all(mine.size() * world_);
    FS_RETURN_IF_ERROR(comm_->AllGather(MakeConstBuffer(mine.data(), mine.size()),
                                        MakeBuffer(all.data(), all.size()))
                           .Wait());
    return all;
  }

  // Each rank writes its events, then rank 0 merges them into config_.trace_path and prints the
  // profile table. The barrier runs on the plain communicator: it is not part of the trace.
  absl::Status FinishTrace() {
    if (!recorder_->enabled()) return absl::OkStatus();
    recorder_->set_enabled(false);
    const std::string& path = config_.trace_path;
    FS_RETURN_IF_ERROR(recorder_->WriteChromeTrace(trace::RankTracePath(path, rank_)));
    FS_RETURN_IF_ERROR(plain_comm_->Barrier().Wait());
    if (rank_ != 0) return absl::OkStatus();
    std::vector<std::string> inputs;
    for (int r = 0; r < world_; ++r) inputs.push_back(trace::RankTracePath(path, r));
    FS_RETURN_IF_ERROR(trace::MergeChromeTraces(inputs, path));
    for (const std::string& input : inputs) std::remove(input.c_str());
    if (config_.progress) std::printf("  trace:   %s (open in ui.perfetto.dev)\n", path.c_str());
    if (config_.profile) {
      FS_ASSIGN_OR_RETURN(std::vector<trace::ProfileSummary> summaries,
                          trace::SummarizeTraceFile(path));
      std::printf("profile (compute = forward/backward/optimizer/eval less blocking waits):\n%s",
                  trace::FormatProfileTable(summaries).c_str());
    }
    std::fflush(stdout);
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<uint64_t>> ParamHashes() { return GatherHashes(model_->param_hash()); }

  // Collective (FSDP gathers every unit's full parameters).
  absl::StatusOr<std::vector<uint64_t>> FullParamHashes() {
    uint64_t h = 0;
    try {
      h = model_->full_param_hash();
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("rank ", rank_, ": summon_full_params: ", e.what()));
    }
    return GatherHashes(h);
  }

  absl::StatusOr<std::vector<uint64_t>> GatherHashes(uint64_t h) {
    // Exchanged as two 32-bit halves in doubles (exact), since the gather helper carries doubles.
    FS_ASSIGN_OR_RETURN(std::vector<double> all,
                        Gather({static_cast<double>(h >> 32), static_cast<double>(h & 0xffffffffu)}));
    std::vector<uint64_t> out(world_);
    for (int r = 0; r < world_; ++r) {
      out[r] = static_cast<uint64_t>(all[2 * r]) << 32 | static_cast<uint64_t>(all[2 * r + 1]);
    }
    return out;
  }

  // The job's training state (the mode's model and optimizer items, then the trainer's own) and
  // the manager of --checkpoint_dir (collective: it splits off a communicator of its own, from
  // the untraced one: checkpoint traffic is not part of the trace).
  absl::Status MakeCheckpointManager() {
    if (config_.checkpoint_dir.empty()) return absl::OkStatus();
    try {
      model_->add_state(state_);
      const int64_t fault_step =
          rank_ == config_.fault_rank && config_.fault_in_save ? config_.fault_step : -1;
      state_.add("trainer", std::make_shared<TrainerItem>(scaler_.get(), rank_, fault_step));
      manager_ = std::make_unique<train_state::CheckpointManager>(
          plain_comm_, train_state::CheckpointManagerOptions(config_.checkpoint_dir)
                           .keep_last(config_.keep_checkpoints)
                           .async(config_.async_checkpoint));
    } catch (const c10::Error& e) {
      return absl::UnavailableError(absl::StrCat("checkpoints in ", config_.checkpoint_dir, ": ",
                                                 e.what_without_backtrace()));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<int64_t> MaybeResume() {
    num_params_ = model_->num_params();
    if (config_.resume == ResumeMode::kNever) {
      // Starting from step 0 deletes every step directory (RemoveAllCheckpoints): not
      // silently. Every rank checks, so every rank fails with the same message.
      if (!config_.overwrite_checkpoints && !config_.checkpoint_dir.empty()) {
        FS_RETURN_IF_ERROR(RefuseToOverwriteCheckpoints(config_.checkpoint_dir));
      }
      return 0;
    }
    if (config_.checkpoint_dir.empty()) {
      return absl::InvalidArgumentError("resume needs a checkpoint directory (--checkpoint_dir)");
    }
    const std::string& root = config_.checkpoint_dir;
    // The marker first (every rank reads it): the config must match before anything loads.
    absl::StatusOr<std::optional<LatestCheckpoint>> found = FindLatestCheckpoint(root);
    if (!found.ok()) return WithOlderCheckpointHint(found.status(), root);
    if (!found->has_value()) {
      if (config_.resume == ResumeMode::kAuto) return 0;
      return NoCompleteCheckpointError(root);
    }
    const LatestCheckpoint latest = **found;
    if (config_.moe_experts > 0 && latest.marker.world_size != world_) {
      // Each rank's experts are its own checkpoint stage: resharding them is not implemented.
      return absl::FailedPreconditionError(absl::StrCat(
          "resume: ", latest.dir, " was saved by ", latest.marker.world_size,
          " ranks; with --moe_experts=", config_.moe_experts, " each rank saved its own ",
          config_.moe_experts / std::max(1, latest.marker.world_size),
          " experts, which restore only at the same rank count (run with --nproc_per_node=",
          latest.marker.world_size, ")"));
    }
    FS_ASSIGN_OR_RETURN(config_.schedule_steps,
                        ResumeScheduleSteps(config_, latest.dir, latest.marker.step,
                                            MarkerConfig(latest.marker)));
    // The manager verifies every file (rank 0) and stages every item before applying any: a
    // damaged checkpoint changes nothing. Collective.
    try {
      manager_->restore(state_, latest.marker.step);
    } catch (const c10::Error& e) {
      return WithOlderCheckpointHint(
          absl::DataLossError(absl::StrCat("resume: cannot load ", latest.dir, ": ",
                                           e.what_without_backtrace())),
          root);
    }
    // The full parameters (gathered) must be bitwise those the checkpoint was saved with, at
    // any world size.
    FS_ASSIGN_OR_RETURN(std::vector<uint64_t> full, FullParamHashes());
    resumed_full_param_hash_ = full[0];
    resumed_from_world_ = latest.marker.world_size;
    const std::optional<std::string> saved = MarkerFullParamHash(latest.marker);
    if (!saved.has_value() || *saved != absl::StrFormat("%016x", full[0])) {
      return WithOlderCheckpointHint(
          absl::DataLossError(absl::StrFormat(
              "resume: checkpoint %s: the full parameters after loading hash to %016x "
              "(FNV-1a), the run that saved them recorded %s",
              latest.dir, full[0], saved.value_or("none"))),
          root);
    }
    return latest.marker.step;
  }

  absl::Status SaveCheckpoint(int64_t step) {
    const std::string dir = train_state::StepDir(config_.checkpoint_dir, step);
    // The gathered full parameters' hash, recorded so that a resume (at any world size) can
    // check it loaded exactly them. Collective.
    FS_ASSIGN_OR_RETURN(std::vector<uint64_t> full, FullParamHashes());
    const std::string hash = absl::StrFormat("%016x", full[0]);
    const nlohmann::json metadata = {
        {"config", config_.ToJson()}, {"full_param_fnv1a64", hash}, {"mode", ModeLabel()}};
    try {
      manager_->save(step, state_, metadata);  // async: throws the previous save's error
    } catch (const c10::Error& e) {
      return absl::UnavailableError(
          absl::StrCat("cannot save checkpoint ", dir, ": ", e.what_without_backtrace()));
    }
    nlohmann::json items = nlohmann::json::object();
    for (const auto& [name, item] : state_.items()) items[name] = item->kind();
    // Async: the snapshot is taken and the files are being written; a failure is reported by
    // the next save or at the end of the run.
    metrics_.Write({{"type", "checkpoint"},
                    {"step", step},
                    {"world_size", world_},
                    {"items", items},
                    {"async", config_.async_checkpoint},
                    {"full_param_fnv1a64", hash}});
    return absl::OkStatus();
  }

  // The asynchronous save in flight, if any, finished (its error, naming the step's files).
  absl::Status WaitForCheckpoint() {
    if (manager_ == nullptr) return absl::OkStatus();
    try {
      manager_->wait();
    } catch (const c10::Error& e) {
      return absl::UnavailableError(
          absl::StrCat("cannot save checkpoint: ", e.what_without_backtrace()));
    }
    return absl::OkStatus();
  }

  absl::Status WritePlot() {
    return internal::WriteLossPlot(config_, metrics_.records(), world_, ModeLabel());
  }

  TrainConfig config_;
  std::shared_ptr<comm::Communicator> plain_comm_;  // the caller's, untraced
  std::shared_ptr<comm::Communicator> comm_;        // plain_comm_, or its tracing wrapper
  std::shared_ptr<trace::Recorder> recorder_;
  int rank_, world_;
  CharTokenizer tokenizer_;
  TokenData data_;
  std::unique_ptr<ParallelModel> model_;            // the data-parallel mode
  torch::optim::Optimizer* optim_ = nullptr;        // model_->optimizer()
  std::unique_ptr<amp::ShardedGradScaler> scaler_;  // with loss_scale
  std::optional<deterministic::MicroBatchLayout> layout_;  // deterministic mode
  Metrics metrics_;
  train_state::TrainState state_;                            // with checkpoint_dir
  std::unique_ptr<train_state::CheckpointManager> manager_;  // with checkpoint_dir
  int64_t num_params_ = 0;
  // The batch this rank trains on and the number of distinct batches per step (ParallelModel).
  int data_rank_ = 0;
  int replicas_ = 1;
  // Set by MaybeResume: the world size that wrote the checkpoint and the full-parameter hash
  // after loading it.
  int resumed_from_world_ = 0;
  uint64_t resumed_full_param_hash_ = 0;
};

}  // namespace

int64_t PeakRssBytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) {
      int64_t kb = 0;
      std::istringstream(line.substr(6)) >> kb;
      return kb * 1024;
    }
  }
  return 0;
}

absl::StatusOr<TrainResult> TrainRank(const TrainConfig& config,
                                      std::shared_ptr<comm::Communicator> comm) {
  FS_RETURN_IF_ERROR(config.Validate());
  const std::string where = absl::StrCat("rank ", comm->rank(), "/", comm->size());
  try {
    Trainer trainer(config, std::move(comm));
    absl::StatusOr<TrainResult> r = trainer.Run();
    if (!r.ok()) {
      return absl::Status(r.status().code(), absl::StrCat(where, ": ", r.status().message()));
    }
    return r;
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat(where, ": ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(where, ": ", e.what()));
  }
}

}  // namespace fairscale::examples::gpt
