#include "train_state/checkpoint_manager.h"

#include <c10/util/Exception.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "base/torch_error.h"

namespace fairscale::train_state {
namespace fs = std::filesystem;

TrainState& TrainState::add(const std::string& name, std::shared_ptr<Stateful> item) {
  base::ThrowIfError(CheckPlainName(name, "item name"), "TrainState::add");
  TORCH_CHECK(item != nullptr, "TrainState::add: item '", name, "' is null");
  for (const auto& [n, i] : items_) {
    TORCH_CHECK(n != name, "TrainState::add: item '", name, "' added twice");
  }
  items_.emplace_back(name, std::move(item));
  return *this;
}

struct CheckpointManager::Job {
  int64_t step = 0;
  nlohmann::json metadata;
  struct Item {
    std::string name, kind;
    std::unique_ptr<Stateful::Snapshot> snapshot;
  };
  std::vector<Item> items;
};

namespace {

absl::Status Mkdir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::DataLossError(absl::StrCat("cannot create directory ", dir, ": ", ec.message()));
  return absl::OkStatus();
}

std::string StatusJson(const absl::Status& s) {
  if (s.ok()) return std::string();
  return s.ToString();
}

}  // namespace

CheckpointManager::CheckpointManager(std::shared_ptr<comm::Communicator> comm,
                                     CheckpointManagerOptions options)
    : comm_(std::move(comm)), options_(std::move(options)) {
  TORCH_CHECK(comm_ != nullptr, "CheckpointManager: communicator is null");
  TORCH_CHECK(!options_.root().empty(), "CheckpointManager: root is empty");
  TORCH_CHECK(options_.keep_last() >= 1, "CheckpointManager: keep_last must be >= 1, got ",
              options_.keep_last());
  TORCH_CHECK(options_.keep_every() >= 0, "CheckpointManager: keep_every must be >= 0, got ",
              options_.keep_every());
  TORCH_CHECK(options_.timeout_s() > 0, "CheckpointManager: timeout_s must be > 0, got ",
              options_.timeout_s());
  const std::string what = absl::StrCat("CheckpointManager('", options_.root(), "') rank ",
                                        comm_->rank(), "/", comm_->size());
  comm::OpOptions opts;
  opts.timeout = absl::Seconds(options_.timeout_s());
  own_ = base::ValueOrThrow(comm_->Split(0, comm_->rank(), opts), what + ": split");
  absl::Status s = comm_->rank() == 0 ? Mkdir(options_.root()) : absl::OkStatus();
  base::ThrowIfError(Agree(s, "creating the root"), what);
}

CheckpointManager::~CheckpointManager() {
  if (worker_.joinable()) worker_.join();
  absl::MutexLock lock(&mu_);
  if (!worker_status_.ok()) {
    FS_LOG(ERROR) << "CheckpointManager: the last asynchronous save failed: " << worker_status_;
  }
}

absl::StatusOr<std::vector<std::string>> CheckpointManager::Exchange(const std::string& mine,
                                                                     const std::string& what) {
  comm::OpOptions opts;
  opts.timeout = absl::Seconds(options_.timeout_s());
  const int n = own_->size();
  const int64_t len = static_cast<int64_t>(mine.size());
  std::vector<int64_t> lens(n);
  absl::Status s = own_->AllGather(comm::MakeConstBuffer(&len, 1),
                                   comm::MakeBuffer(lens.data(), lens.size()), opts)
                       .Wait();
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
  const int64_t max = *std::max_element(lens.begin(), lens.end());
  std::vector<std::string> out(n);
  if (max == 0) return out;
  std::vector<uint8_t> send(static_cast<size_t>(max), 0), recv(static_cast<size_t>(max) * n);
  std::copy(mine.begin(), mine.end(), send.begin());
  s = own_->AllGather(comm::MakeConstBuffer(send.data(), send.size()),
                      comm::MakeBuffer(recv.data(), recv.size()), opts)
          .Wait();
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
  for (int r = 0; r < n; ++r) {
    out[r].assign(reinterpret_cast<const char*>(recv.data()) + r * max,
                  static_cast<size_t>(lens[r]));
  }
  return out;
}

absl::Status CheckpointManager::Agree(const absl::Status& mine, const std::string& what) {
  absl::StatusOr<std::vector<std::string>> all = Exchange(StatusJson(mine), what);
  if (!all.ok()) return all.status();
  if (!mine.ok()) return absl::Status(mine.code(), absl::StrCat(what, ": ", mine.message()));
  for (size_t r = 0; r < all->size(); ++r) {
    if (!(*all)[r].empty()) {
      return absl::AbortedError(absl::StrCat(what, ": rank ", r, " failed: ", (*all)[r]));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> CheckpointManager::ExchangeResults(
    const absl::Status& mine, const nlohmann::json& payload, const std::string& what,
    const std::string& stage) {
  const std::string sent =
      mine.ok() ? "+" + payload.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                : "-" + mine.ToString();
  FS_ASSIGN_OR_RETURN(std::vector<std::string> all, Exchange(sent, what + ": " + stage));
  if (!mine.ok()) return absl::Status(mine.code(), absl::StrCat(what, ": ", mine.message()));
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty() || all[r][0] != '+') {
      return absl::AbortedError(absl::StrCat(what, ": rank ", r, " failed: ",
                                             all[r].empty() ? "" : all[r].substr(1)));
    }
    all[r].erase(0, 1);
  }
  return all;
}

absl::Status CheckpointManager::RunSave(Job& job) {
  try {
    return RunSaveUnchecked(job);
  } catch (const c10::Error& e) {
    return absl::InternalError(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return absl::InternalError(e.what());
  }
}

absl::Status CheckpointManager::RunSaveUnchecked(Job& job) {
  const int rank = own_->rank();
  const std::string step_dir = StepDir(options_.root(), job.step);
  const std::string what = absl::StrCat("checkpoint save of step ", job.step, " (", step_dir,
                                        ") rank ", rank, "/", own_->size());
  // Rank 0 clears leftovers of an interrupted save of this step and creates the directories.
  absl::Status s;
  if (rank == 0) {
    std::error_code ec;
    if (fs::exists(step_dir, ec)) s = RemoveStepDir(step_dir);
    for (const Job::Item& item : job.items) {
      if (s.ok()) s = Mkdir(absl::StrCat(step_dir, "/", item.name));
    }
  }
  FS_RETURN_IF_ERROR(Agree(s, what + ": creating the step directory"));

  // Every rank writes its files; the ranks exchange what they wrote.
  nlohmann::json mine = nlohmann::json::object();
  for (const Job::Item& item : job.items) {
    if (!s.ok()) break;
    const std::string dir = absl::StrCat(step_dir, "/", item.name);
    absl::StatusOr<WriteResult> r = absl::InternalError("not written");
    try {  // write() must not throw; if it does, this rank still takes part in the exchange
      r = item.snapshot->write(dir);
    } catch (const std::exception& e) {
      r = absl::InternalError(e.what());
    }
    if (!r.ok()) {
      s = absl::Status(r.status().code(),
                       absl::StrCat("item '", item.name, "': ", r.status().message()));
      break;
    }
    nlohmann::json files = nlohmann::json::array();
    for (const std::string& f : r->files) {
      s = CheckRelativePath(f, "file");
      if (!s.ok()) break;
      absl::StatusOr<FileDigest> d = DigestFile(dir, f);
      if (!d.ok()) {
        s = d.status();
        break;
      }
      files.push_back({f, d->bytes, d->fnv1a64});
    }
    mine[item.name] = {{"files", files}, {"info", r->info}};
  }
  FS_ASSIGN_OR_RETURN(std::vector<std::string> all,
                      ExchangeResults(s, mine, what, "exchanging what each rank wrote"));

  // Every rank finalizes the items with every rank's results (most items do nothing, FSDP's
  // writes its manifest on rank 0); the ranks exchange what that wrote; rank 0 writes COMPLETE
  // last and applies the retention policy. Whatever happens, every rank meets in each exchange.
  std::vector<std::vector<WriteResult>> results(job.items.size());
  nlohmann::json finalized = nlohmann::json::object();
  try {
    for (size_t r = 0; r < all.size(); ++r) {
      const nlohmann::json j = nlohmann::json::parse(all[r]);
      for (size_t i = 0; i < job.items.size(); ++i) {
        const nlohmann::json& e = j.at(job.items[i].name);
        WriteResult w;
        w.info = e.at("info");
        for (const auto& f : e.at("files")) w.files.push_back(f.at(0).get<std::string>());
        results[i].push_back(std::move(w));
      }
    }
    for (size_t i = 0; s.ok() && i < job.items.size(); ++i) {
      const Job::Item& item = job.items[i];
      const std::string dir = absl::StrCat(step_dir, "/", item.name);
      absl::StatusOr<std::vector<std::string>> extra = item.snapshot->finalize(dir, results[i]);
      if (!extra.ok()) {
        s = absl::Status(extra.status().code(),
                         absl::StrCat("item '", item.name, "': ", extra.status().message()));
        break;
      }
      nlohmann::json files = nlohmann::json::array();
      for (const std::string& f : *extra) {
        s = CheckRelativePath(f, "file");
        if (!s.ok()) break;
        absl::StatusOr<FileDigest> d = DigestFile(dir, f);
        if (!d.ok()) {
          s = d.status();
          break;
        }
        files.push_back({f, d->bytes, d->fnv1a64});
      }
      finalized[item.name] = files;
    }
  } catch (const std::exception& e) {
    s = absl::InternalError(e.what());
  }
  FS_ASSIGN_OR_RETURN(std::vector<std::string> all2,
                      ExchangeResults(s, finalized, what, "exchanging what finalizing wrote"));
  if (rank == 0) {
    try {
      s = WriteMarkerOnRank0(job, step_dir, all, all2);
    } catch (const std::exception& e) {
      s = absl::InternalError(e.what());
    }
  }
  return Agree(s, what + ": writing the marker");
}

absl::Status CheckpointManager::WriteMarkerOnRank0(Job& job, const std::string& step_dir,
                                                   const std::vector<std::string>& written,
                                                   const std::vector<std::string>& finalized) {
  absl::Status s;
  {
    Marker marker;
    marker.step = job.step;
    marker.world_size = static_cast<int>(written.size());
    marker.metadata = job.metadata;
    for (const Job::Item& item : job.items) {
      Marker::Item& m = marker.items[item.name];
      m.kind = item.kind;
      std::set<std::string> names;
      for (const std::vector<std::string>* round : {&written, &finalized}) {
        for (const std::string& payload : *round) {
          const nlohmann::json j = nlohmann::json::parse(payload);
          const nlohmann::json& files =
              round == &written ? j.at(item.name).at("files") : j.at(item.name);
          for (const auto& f : files) {
            FileDigest d{f.at(0).get<std::string>(), f.at(1).get<uint64_t>(),
                         f.at(2).get<uint64_t>()};
            if (!names.insert(d.name).second) {
              return absl::InternalError(absl::StrCat("item '", item.name, "': file ", d.name,
                                                      " written twice (by two ranks?)"));
            }
            m.files.push_back(std::move(d));
          }
        }
      }
    }
    if (s.ok()) s = WriteMarker(step_dir, marker);
    if (s.ok()) {
      for (const StepEntry& e : StepsToDelete(ListSteps(options_.root()), options_.keep_last(),
                                              options_.keep_every())) {
        absl::Status r = RemoveStepDir(e.dir);
        if (!r.ok()) FS_LOG(WARNING) << "CheckpointManager retention: " << r;
      }
    }
  }
  return s;
}

void CheckpointManager::save(int64_t step, TrainState& state, const nlohmann::json& metadata) {
  const std::string what = absl::StrCat("CheckpointManager::save(step ", step, ") rank ",
                                        comm_->rank(), "/", comm_->size());
  wait();
  TORCH_CHECK(step >= 0, what, ": step must be >= 0");
  TORCH_CHECK(metadata.is_object(), what, ": metadata must be a JSON object");
  TORCH_CHECK(!state.items().empty(), what, ": the state has no items");
  const std::optional<int64_t> newest = latest_complete();
  TORCH_CHECK(!newest || step > *newest, what, ": step ", step,
              " is not after the newest complete checkpoint (step ", *newest, " in ",
              options_.root(), "); restore it, or save a later step");
  auto job = std::make_unique<Job>();
  job->step = step;
  job->metadata = metadata;
  for (const auto& [name, item] : state.items()) {
    std::unique_ptr<Stateful::Snapshot> reuse;
    for (auto& [n, snap] : reuse_) {
      if (n == name) reuse = std::move(snap);
    }
    std::unique_ptr<Stateful::Snapshot> snap =
        item->snapshot(SaveContext{step, comm_->rank(), comm_->size()}, std::move(reuse));
    TORCH_CHECK(snap != nullptr, what, ": item '", name, "' returned no snapshot");
    job->items.push_back({name, item->kind(), std::move(snap)});
  }
  reuse_.clear();
  if (!options_.async()) {
    absl::Status s = RunSave(*job);
    for (Job::Item& i : job->items) reuse_.emplace_back(i.name, std::move(i.snapshot));
    base::ThrowIfError(s, what);
    return;
  }
  absl::MutexLock lock(&mu_);
  running_ = true;
  job_ = std::move(job);
  Job* raw = job_.get();
  worker_ = std::thread([this, raw] {
    absl::Status s = RunSave(*raw);
    absl::MutexLock lock(&mu_);
    worker_status_ = s;
    running_ = false;
  });
}

void CheckpointManager::wait() {
  if (worker_.joinable()) worker_.join();
  absl::Status s;
  {
    absl::MutexLock lock(&mu_);
    s = worker_status_;
    worker_status_ = absl::OkStatus();
    if (job_ != nullptr) {
      for (Job::Item& i : job_->items) reuse_.emplace_back(i.name, std::move(i.snapshot));
      job_.reset();
    }
  }
  base::ThrowIfError(s, absl::StrCat("CheckpointManager rank ", comm_->rank(), "/",
                                     comm_->size(), ": asynchronous save"));
}

bool CheckpointManager::in_flight() const {
  absl::MutexLock lock(&mu_);
  return running_;
}

std::optional<int64_t> CheckpointManager::latest_complete() const {
  for (const StepEntry& e : ListSteps(options_.root())) {
    if (e.complete) return e.step;
  }
  return std::nullopt;
}

std::vector<int64_t> CheckpointManager::all_steps() const {
  std::vector<int64_t> out;
  for (const StepEntry& e : ListSteps(options_.root())) {
    if (e.complete) out.push_back(e.step);
  }
  std::reverse(out.begin(), out.end());
  return out;
}

std::optional<int64_t> CheckpointManager::restore(TrainState& state,
                                                  std::optional<int64_t> step) {
  const std::string what =
      absl::StrCat("CheckpointManager::restore(", step ? absl::StrCat("step ", *step) : "latest",
                   ") rank ", comm_->rank(), "/", comm_->size());
  wait();
  // Rank 0 picks the checkpoint and checks its files; every rank follows its verdict.
  std::string verdict;
  if (own_->rank() == 0) {
    absl::Status s;
    std::optional<int64_t> chosen;
    std::vector<int64_t> complete;
    for (const StepEntry& e : ListSteps(options_.root())) {
      if (e.complete) complete.push_back(e.step);
    }
    if (step) {
      if (std::find(complete.begin(), complete.end(), *step) == complete.end()) {
        s = absl::NotFoundError(absl::StrCat(
            "no complete checkpoint of step ", *step, " under ", options_.root(),
            complete.empty() ? " (it holds none)"
                             : absl::StrCat(" (complete steps: ", absl::StrJoin(complete, ", "), ")")));
      } else {
        chosen = *step;
      }
    } else if (!complete.empty()) {
      chosen = complete.front();
    }
    if (s.ok() && chosen) {
      const std::string dir = StepDir(options_.root(), *chosen);
      absl::StatusOr<Marker> m = ReadMarker(dir, *chosen);
      s = m.status();
      if (s.ok() && options_.verify_on_restore()) s = VerifyFiles(dir, *m);
    }
    verdict = !s.ok() ? absl::StrCat("-", s.ToString())
                      : chosen ? absl::StrCat("+", *chosen) : std::string("0");
  }
  absl::StatusOr<std::vector<std::string>> all = Exchange(verdict, what + ": choosing the step");
  base::ThrowIfError(all.status(), what);
  const std::string& v = (*all)[0];
  TORCH_CHECK(!v.empty() && v[0] != '-', what, ": ", v.empty() ? "" : v.substr(1));
  if (v == "0") {
    restored_.reset();
    return std::nullopt;
  }
  int64_t chosen = 0;
  TORCH_CHECK(absl::SimpleAtoi(v.substr(1), &chosen), what, ": bad verdict ", v);
  const std::string step_dir = StepDir(options_.root(), chosen);

  // Every rank reads the marker and checks the state against it.
  absl::StatusOr<Marker> marker = ReadMarker(step_dir, chosen);
  absl::Status s = marker.status();
  if (s.ok()) {
    std::vector<std::string> missing, extra, kinds;
    std::set<std::string> names;
    for (const auto& [name, item] : state.items()) {
      names.insert(name);
      auto it = marker->items.find(name);
      if (it == marker->items.end()) {
        missing.push_back(name);
      } else if (it->second.kind != item->kind()) {
        kinds.push_back(absl::StrCat("'", name, "' is ", it->second.kind,
                                     " in the checkpoint, ", item->kind(), " here"));
      }
    }
    for (const auto& [name, item] : marker->items) {
      if (!names.count(name)) extra.push_back(name);
    }
    if (!missing.empty() || !extra.empty() || !kinds.empty()) {
      std::vector<std::string> parts;
      if (!missing.empty()) {
        parts.push_back(absl::StrCat("item(s) not in the checkpoint: ", absl::StrJoin(missing, ", ")));
      }
      if (!extra.empty()) {
        parts.push_back(absl::StrCat("item(s) of the checkpoint not in the state: ",
                                     absl::StrJoin(extra, ", ")));
      }
      if (!kinds.empty()) parts.push_back(absl::StrJoin(kinds, "; "));
      s = absl::InvalidArgumentError(absl::StrCat("checkpoint ", step_dir,
                                                  " does not match the state: ",
                                                  absl::StrJoin(parts, "; ")));
    }
  }
  base::ThrowIfError(Agree(s, what), what);

  // Stage every item (agreeing after each, so that no rank enters an item's collective
  // restore after another failed), then apply them all.
  std::vector<std::function<void()>> apply;
  for (const auto& [name, item] : state.items()) {
    RestoreContext ctx;
    ctx.rank = comm_->rank();
    ctx.world_size = comm_->size();
    ctx.dir = absl::StrCat(step_dir, "/", name);
    ctx.step = chosen;
    ctx.saved_world_size = marker->world_size;
    for (const FileDigest& f : marker->items.at(name).files) ctx.files.push_back(f.name);
    absl::Status staged;
    try {
      apply.push_back(item->restore(ctx));
    } catch (const c10::Error& e) {
      staged = absl::DataLossError(absl::StrCat("item '", name, "': ", e.what_without_backtrace()));
    } catch (const std::exception& e) {
      staged = absl::DataLossError(absl::StrCat("item '", name, "': ", e.what()));
    }
    base::ThrowIfError(Agree(staged, absl::StrCat(what, ": ", step_dir)),
                       "nothing was changed");
  }
  for (auto& f : apply) {
    if (f) f();
  }
  // Leftovers of an interrupted save after the restored step.
  if (own_->rank() == 0) {
    for (const StepEntry& e : ListSteps(options_.root())) {
      if (!e.complete && e.step > chosen) {
        absl::Status r = RemoveStepDir(e.dir);
        if (!r.ok()) FS_LOG(WARNING) << "CheckpointManager: " << r;
      }
    }
  }
  restored_ = *std::move(marker);
  return chosen;
}

}  // namespace fairscale::train_state
