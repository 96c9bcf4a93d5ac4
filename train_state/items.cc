#include "train_state/items.h"

#include <ATen/core/Generator.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <filesystem>
#include <set>
#include <map>
#include <mutex>
#include <sstream>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "amp/grad_scaler.h"
#include "oss/oss.h"
#include "base/json_fields.h"
#include "train_state/step_dir.h"

namespace fairscale::train_state {
namespace {

absl::Status WriteJson(const std::string& path, const nlohmann::json& j) {
  return WriteFileAtomic(path, j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace));
}

// Reads and parses a JSON file of an item; c10::Error naming the file otherwise.
nlohmann::json ReadJson(const RestoreContext& ctx, const std::string& name) {
  const std::string path = absl::StrCat(ctx.dir, "/", name);
  TORCH_CHECK(std::find(ctx.files.begin(), ctx.files.end(), name) != ctx.files.end(),
              "the checkpoint lists no ", path);
  absl::StatusOr<std::string> text = ReadFile(path);
  TORCH_CHECK(text.ok(), text.status().ToString());
  nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(!j.is_discarded(), "checkpoint file ", path, " is not valid JSON");
  return j;
}

// A snapshot that writes one JSON file (on the ranks that write).
class JsonFileSnapshot final : public Stateful::Snapshot {
 public:
  JsonFileSnapshot(std::string name, nlohmann::json value, bool writes)
      : name_(std::move(name)), value_(std::move(value)), writes_(writes) {}
  absl::StatusOr<WriteResult> write(const std::string& dir) override {
    WriteResult r;
    if (!writes_) return r;
    absl::Status s = WriteJson(absl::StrCat(dir, "/", name_), value_);
    if (!s.ok()) return s;
    r.files.push_back(name_);
    return r;
  }

 private:
  std::string name_;
  nlohmann::json value_;
  bool writes_;
};

// ---- json -----------------------------------------------------------------------------------

class JsonItem final : public Stateful {
 public:
  JsonItem(std::function<nlohmann::json()> get, std::function<void(const nlohmann::json&)> set)
      : get_(std::move(get)), set_(std::move(set)) {}
  std::string kind() const override { return "json"; }
  std::unique_ptr<Snapshot> snapshot(const SaveContext& ctx, std::unique_ptr<Snapshot>) override {
    return std::make_unique<JsonFileSnapshot>("state.json", get_(), ctx.rank == 0);
  }
  std::function<void()> restore(const RestoreContext& ctx) override {
    nlohmann::json value = ReadJson(ctx, "state.json");
    return [this, value = std::move(value)] { set_(value); };
  }

 private:
  std::function<nlohmann::json()> get_;
  std::function<void(const nlohmann::json&)> set_;
};

// ---- sampler --------------------------------------------------------------------------------

class SamplerItem final : public Stateful {
 public:
  explicit SamplerItem(DistributedSampler sampler) : sampler_(std::move(sampler)) {}
  std::string kind() const override { return "sampler"; }
  std::unique_ptr<Snapshot> snapshot(const SaveContext& ctx, std::unique_ptr<Snapshot>) override {
    return std::make_unique<JsonFileSnapshot>("state.json", sampler_.state_dict(), ctx.rank == 0);
  }
  std::function<void()> restore(const RestoreContext& ctx) override {
    nlohmann::json value = ReadJson(ctx, "state.json");
    // Checked on a separate sampler of the same configuration (copies would share the
    // position), so that nothing changes before every item staged.
    DistributedSampler probe(sampler_.dataset_size(), sampler_.rank(), sampler_.world_size(),
                             sampler_.options());
    probe.load_state_dict(value);
    return [this, value = std::move(value)] { sampler_.load_state_dict(value); };
  }

 private:
  DistributedSampler sampler_;
};

// ---- grad scaler ----------------------------------------------------------------------------

class GradScalerItem final : public Stateful {
 public:
  explicit GradScalerItem(amp::GradScaler& scaler) : scaler_(scaler) {}
  std::string kind() const override { return "grad_scaler"; }
  std::unique_ptr<Snapshot> snapshot(const SaveContext& ctx, std::unique_ptr<Snapshot>) override {
    const amp::GradScalerState s = scaler_.state_dict();
    nlohmann::json j = {{"enabled", s.enabled},
                        {"scale", s.scale},
                        {"growth_factor", s.growth_factor},
                        {"backoff_factor", s.backoff_factor},
                        {"growth_interval", s.growth_interval},
                        {"growth_tracker", s.growth_tracker}};
    return std::make_unique<JsonFileSnapshot>("state.json", std::move(j), ctx.rank == 0);
  }
  std::function<void()> restore(const RestoreContext& ctx) override {
    const nlohmann::json j = ReadJson(ctx, "state.json");
    const base::JsonFields f(absl::StrCat("checkpoint file ", ctx.dir, "/state.json: "));
    amp::GradScalerState s;
    auto need = [&](const char* key) -> const nlohmann::json& {
      auto v = f.Need(j, key, key);
      TORCH_CHECK(v.ok(), v.status().message());
      return **v;
    };
    TORCH_CHECK(need("enabled").is_boolean(), f.WrongType(need("enabled"), "enabled", "a boolean").message());
    s.enabled = need("enabled").get<bool>();
    auto number = [&](const char* key) {
      auto v = f.Number(need(key), key);
      TORCH_CHECK(v.ok(), v.status().message());
      return *v;
    };
    auto integer = [&](const char* key) {
      auto v = f.Int(need(key), key, 0);
      TORCH_CHECK(v.ok(), v.status().message());
      return *v;
    };
    s.scale = number("scale");
    s.growth_factor = number("growth_factor");
    s.backoff_factor = number("backoff_factor");
    s.growth_interval = integer("growth_interval");
    s.growth_tracker = integer("growth_tracker");
    return [this, s] { scaler_.load_state_dict(s); };
  }

 private:
  amp::GradScaler& scaler_;
};

// ---- rng ------------------------------------------------------------------------------------

struct Generators {
  std::vector<at::Generator> all;  // CPU, then every CUDA device's default
  static Generators Current() {
    Generators g;
    g.all.push_back(at::detail::getDefaultCPUGenerator());
    if (at::hasCUDA()) {
      const auto& hooks = at::detail::getCUDAHooks();
      for (int64_t d = 0; d < hooks.getNumGPUs(); ++d) {
        g.all.push_back(hooks.getDefaultCUDAGenerator(static_cast<c10::DeviceIndex>(d)));
      }
    }
    return g;
  }
};

std::string StateBytes(at::Generator& g) {
  at::Tensor state;
  {
    std::lock_guard<std::mutex> lock(g.mutex());
    state = g.get_state();
  }
  return std::string(static_cast<const char*>(state.data_ptr()),
                     static_cast<size_t>(state.nbytes()));
}

class RngItem final : public Stateful {
 public:
  explicit RngItem(bool reseed) : reseed_(reseed) {}
  std::string kind() const override { return "rng"; }
  std::unique_ptr<Snapshot> snapshot(const SaveContext& ctx, std::unique_ptr<Snapshot>) override {
    nlohmann::json states = nlohmann::json::array();
    for (at::Generator& g : Generators::Current().all) {
      states.push_back({{"device", g.device().str()}, {"state", absl::Base64Escape(StateBytes(g))}});
    }
    return std::make_unique<JsonFileSnapshot>(absl::StrCat("rng_rank", ctx.rank, ".json"),
                                              nlohmann::json{{"generators", states}}, true);
  }
  std::function<void()> restore(const RestoreContext& ctx) override {
    if (ctx.saved_world_size != ctx.world_size) {
      TORCH_CHECK(reseed_, "the RNG states in ", ctx.dir, " are of ", ctx.saved_world_size,
                  " ranks, this run has ", ctx.world_size,
                  ": per-rank streams cannot be mapped (use rng_item(/*reseed_on_world_change="
                  "*/true) to keep the current states)");
      return [] {};
    }
    const std::string name = absl::StrCat("rng_rank", ctx.rank, ".json");
    const nlohmann::json j = ReadJson(ctx, name);
    const std::string path = absl::StrCat(ctx.dir, "/", name);
    TORCH_CHECK(j.is_object() && j.contains("generators") && j["generators"].is_array(),
                "checkpoint file ", path, ": generators: missing or not an array");
    Generators current = Generators::Current();
    const nlohmann::json& gens = j["generators"];
    TORCH_CHECK(gens.size() == current.all.size(), "checkpoint file ", path, " holds ",
                gens.size(), " generator states, this process has ", current.all.size(),
                " (CPU + CUDA devices)");
    std::vector<at::Tensor> states;
    for (size_t i = 0; i < gens.size(); ++i) {
      const nlohmann::json& e = gens[i];
      TORCH_CHECK(e.is_object() && e.contains("state") && e["state"].is_string() &&
                      e.contains("device") && e["device"].is_string(),
                  "checkpoint file ", path, ": generators[", i, "] is malformed");
      TORCH_CHECK(e["device"].get<std::string>() == current.all[i].device().str(),
                  "checkpoint file ", path, ": generators[", i, "] is of device ",
                  e["device"].get<std::string>(), ", here ", current.all[i].device().str());
      std::string bytes;
      TORCH_CHECK(absl::Base64Unescape(e["state"].get<std::string>(), &bytes),
                  "checkpoint file ", path, ": generators[", i, "].state is not base64");
      const std::string now = StateBytes(current.all[i]);
      TORCH_CHECK(bytes.size() == now.size(), "checkpoint file ", path, ": generators[", i,
                  "].state has ", bytes.size(), " bytes, this build's has ", now.size());
      at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
      std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
      states.push_back(t);
    }
    return [current, states]() mutable {
      for (size_t i = 0; i < states.size(); ++i) {
        std::lock_guard<std::mutex> lock(current.all[i].mutex());
        current.all[i].set_state(states[i]);
      }
    };
  }

 private:
  bool reseed_;
};

// ---- replicated module ----------------------------------------------------------------------

class ModuleSnapshot final : public Stateful::Snapshot {
 public:
  std::vector<std::pair<std::string, at::Tensor>> tensors;  // host copies
  bool writes = false;
  absl::StatusOr<WriteResult> write(const std::string& dir) override {
    WriteResult r;
    if (!writes) return r;
    const std::string path = dir + "/module.pt";
    try {
      torch::serialize::OutputArchive archive;
      for (const auto& [name, t] : tensors) archive.write(name, t, /*is_buffer=*/false);
      std::ostringstream out;
      archive.save_to(out);
      absl::Status s = WriteFileAtomic(path, out.str());
      if (!s.ok()) return s;
    } catch (const c10::Error& e) {
      return absl::DataLossError(absl::StrCat("cannot write ", path, ": ",
                                              e.what_without_backtrace()));
    }
    r.files.push_back("module.pt");
    return r;
  }
};

std::vector<std::pair<std::string, at::Tensor>> NamedTensors(torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : m.named_parameters()) out.emplace_back(p.key(), p.value());
  for (const auto& b : m.named_buffers()) out.emplace_back(b.key(), b.value());
  return out;
}

class ModuleItem final : public Stateful {
 public:
  explicit ModuleItem(std::shared_ptr<torch::nn::Module> m) : module_(std::move(m)) {}
  std::string kind() const override { return "module"; }
  std::unique_ptr<Snapshot> snapshot(const SaveContext& ctx,
                                     std::unique_ptr<Snapshot> reuse) override {
    std::unique_ptr<ModuleSnapshot> snap(dynamic_cast<ModuleSnapshot*>(reuse.release()));
    if (snap == nullptr) snap = std::make_unique<ModuleSnapshot>();
    snap->writes = ctx.rank == 0;
    if (!snap->writes) {
      snap->tensors.clear();
      return snap;
    }
    const auto now = NamedTensors(*module_);
    bool same = snap->tensors.size() == now.size();
    for (size_t i = 0; same && i < now.size(); ++i) {
      same = snap->tensors[i].first == now[i].first &&
             snap->tensors[i].second.sizes() == now[i].second.sizes() &&
             snap->tensors[i].second.scalar_type() == now[i].second.scalar_type();
    }
    c10::NoGradGuard no_grad;
    if (!same) {
      snap->tensors.clear();
      for (const auto& [n, t] : now) {
        snap->tensors.emplace_back(n, at::empty(t.sizes(), t.options().device(at::kCPU)));
      }
    }
    for (size_t i = 0; i < now.size(); ++i) snap->tensors[i].second.copy_(now[i].second);
    return snap;
  }
  std::function<void()> restore(const RestoreContext& ctx) override {
    const std::string path = ctx.dir + "/module.pt";
    TORCH_CHECK(std::find(ctx.files.begin(), ctx.files.end(), "module.pt") != ctx.files.end(),
                "the checkpoint lists no ", path);
    torch::serialize::InputArchive archive;
    archive.load_from(path);
    std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (destination, loaded)
    for (const auto& [name, t] : NamedTensors(*module_)) {
      at::Tensor loaded;
      TORCH_CHECK(archive.try_read(name, loaded), "checkpoint file ", path, " has no tensor '",
                  name, "'");
      TORCH_CHECK(loaded.sizes() == t.sizes() && loaded.scalar_type() == t.scalar_type(),
                  "checkpoint file ", path, ": '", name, "' is ", loaded.toString(), " ",
                  loaded.sizes(), ", the module's is ", t.toString(), " ", t.sizes());
      copies.emplace_back(t, loaded);
    }
    return [copies] {
      c10::NoGradGuard no_grad;
      for (const auto& [dst, src] : copies) dst.copy_(src);
    };
  }

 private:
  std::shared_ptr<torch::nn::Module> module_;
};

// ---- optimizers (oss, replicated) -----------------------------------------------------------

class BytesSnapshot final : public Stateful::Snapshot {
 public:
  BytesSnapshot(std::string name, std::string bytes, bool writes)
      : name_(std::move(name)), bytes_(std::move(bytes)), writes_(writes) {}
  absl::StatusOr<WriteResult> write(const std::string& dir) override {
    WriteResult r;
    if (!writes_) return r;
    absl::Status s = WriteFileAtomic(absl::StrCat(dir, "/", name_), bytes_);
    if (!s.ok()) return s;
    r.files.push_back(name_);
    return r;
  }
  // The buffer, for the next snapshot to refill (its capacity is kept).
  std::string release_bytes() { return std::move(bytes_); }

 private:
  std::string name_, bytes_;
  bool writes_;
};

// An optimizer saved as one torch::serialize archive by rank 0 ("optimizer.pt", the layout of
// an unsharded torch::optim optimizer) and loaded from it by every rank: a ZeRO-sharded OSS
// (which consolidates its state on rank 0 first, collectively, and keeps its partition's part
// when loading) or a plain optimizer replicated on every rank.
class OptimizerArchiveItem final : public Stateful {
 public:
  OptimizerArchiveItem(std::string kind, torch::optim::Optimizer& optimizer,
                       std::function<void()> before_save)
      : kind_(std::move(kind)), optimizer_(optimizer), before_save_(std::move(before_save)) {}
  std::string kind() const override { return kind_; }
  // The archive is serialized straight into the previous snapshot's buffer (its capacity reused:
  // no allocation once the state stops growing).
  std::unique_ptr<Snapshot> snapshot(const SaveContext& ctx,
                                     std::unique_ptr<Snapshot> reuse) override {
    if (before_save_) before_save_();
    std::string bytes;
    if (auto* prev = dynamic_cast<BytesSnapshot*>(reuse.get())) bytes = prev->release_bytes();
    bytes.clear();
    if (ctx.rank == 0) {
      torch::serialize::OutputArchive archive;
      optimizer_.save(archive);
      archive.save_to([&bytes](const void* data, size_t n) {
        bytes.append(static_cast<const char*>(data), n);
        return n;
      });
    } else {
      bytes.shrink_to_fit();
    }
    return std::make_unique<BytesSnapshot>("optimizer.pt", std::move(bytes), ctx.rank == 0);
  }
  std::function<void()> restore(const RestoreContext& ctx) override {
    const std::string path = ctx.dir + "/optimizer.pt";
    TORCH_CHECK(std::find(ctx.files.begin(), ctx.files.end(), "optimizer.pt") != ctx.files.end(),
                "the checkpoint lists no ", path);
    auto archive = std::make_shared<torch::serialize::InputArchive>();
    archive->load_from(path);  // a damaged archive fails here, before anything changes
    return [this, archive] { optimizer_.load(*archive); };
  }

 private:
  std::string kind_;
  torch::optim::Optimizer& optimizer_;
  std::function<void()> before_save_;
};

// ---- pipeline stages ------------------------------------------------------------------------

std::string StageDir(int stage) { return absl::StrCat("stage", stage); }

absl::Status MakeDir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::DataLossError(absl::StrCat("cannot create directory ", dir, ": ", ec.message()));
  return absl::OkStatus();
}

class StageSnapshot final : public Stateful::Snapshot {
 public:
  StageSnapshot(int stage, int replica, int replicas, std::unique_ptr<Stateful::Snapshot> inner)
      : stage_(stage), replica_(replica), replicas_(replicas), inner_(std::move(inner)) {}
  absl::StatusOr<WriteResult> write(const std::string& dir) override {
    const std::string sub = absl::StrCat(dir, "/", StageDir(stage_));
    absl::Status s = MakeDir(sub);
    if (!s.ok()) return s;
    absl::StatusOr<WriteResult> r = inner_->write(sub);
    if (!r.ok()) return r.status();
    WriteResult out;
    for (const std::string& f : r->files) out.files.push_back(StageDir(stage_) + "/" + f);
    out.info = {{"stage", stage_}, {"replica", replica_}, {"inner", r->info}};
    return out;
  }
  absl::StatusOr<std::vector<std::string>> finalize(
      const std::string& dir, const std::vector<WriteResult>& results) override {
    // This stage's replicas' results, by replica.
    std::vector<WriteResult> mine(static_cast<size_t>(replicas_));
    std::vector<bool> seen(mine.size(), false);
    const std::string prefix = StageDir(stage_) + "/";
    for (const WriteResult& r : results) {
      const nlohmann::json& i = r.info;
      if (!i.is_object() || !i.contains("stage") || !i["stage"].is_number_integer() ||
          !i.contains("replica") || !i["replica"].is_number_integer()) {
        return absl::InternalError(absl::StrCat("a rank's stage result is malformed: ", i.dump()));
      }
      if (i["stage"].get<int>() != stage_) continue;
      const int replica = i["replica"].get<int>();
      if (replica < 0 || replica >= replicas_ || seen[replica]) {
        return absl::InternalError(absl::StrCat("stage ", stage_, ": replica ", replica,
                                                " is out of range or reported twice"));
      }
      seen[replica] = true;
      mine[replica].info = i["inner"];
      for (const std::string& f : r.files) mine[replica].files.push_back(f.substr(prefix.size()));
    }
    for (int r = 0; r < replicas_; ++r) {
      if (!seen[r]) {
        return absl::InternalError(absl::StrCat("stage ", stage_, ": replica ", r,
                                                " reported nothing (stage / replica arguments "
                                                "disagree between ranks?)"));
      }
    }
    absl::StatusOr<std::vector<std::string>> extra =
        inner_->finalize(dir + "/" + StageDir(stage_), mine);
    if (!extra.ok()) return extra.status();
    std::vector<std::string> out;
    for (const std::string& f : *extra) out.push_back(prefix + f);
    return out;
  }
  std::unique_ptr<Stateful::Snapshot> release_inner() { return std::move(inner_); }

 private:
  int stage_, replica_, replicas_;
  std::unique_ptr<Stateful::Snapshot> inner_;
};

class StageItem final : public Stateful {
 public:
  StageItem(int stage, int num_stages, int replica, int replicas, std::shared_ptr<Stateful> inner)
      : stage_(stage), num_stages_(num_stages), replica_(replica), replicas_(replicas),
        inner_(std::move(inner)) {}
  std::string kind() const override { return "stages/" + inner_->kind(); }
  std::unique_ptr<Snapshot> snapshot(const SaveContext& ctx,
                                     std::unique_ptr<Snapshot> reuse) override {
    TORCH_CHECK(ctx.world_size == num_stages_ * replicas_, "stage_item: ", num_stages_,
                " stages x ", replicas_, " replicas != world size ", ctx.world_size);
    std::unique_ptr<Snapshot> inner_reuse;
    if (auto* prev = dynamic_cast<StageSnapshot*>(reuse.get())) inner_reuse = prev->release_inner();
    return std::make_unique<StageSnapshot>(
        stage_, replica_, replicas_,
        inner_->snapshot(SaveContext{ctx.step, replica_, replicas_}, std::move(inner_reuse)));
  }
  std::function<void()> restore(const RestoreContext& ctx) override {
    std::set<int> stages;
    RestoreContext inner = ctx;
    inner.files.clear();
    const std::string prefix = StageDir(stage_) + "/";
    for (const std::string& f : ctx.files) {
      int s = -1;
      const size_t slash = f.find('/');
      TORCH_CHECK(slash != std::string::npos && f.compare(0, 5, "stage") == 0 &&
                      absl::SimpleAtoi(f.substr(5, slash - 5), &s),
                  "the checkpoint's ", ctx.dir, " holds ", f, ", not a stage's file");
      stages.insert(s);
      if (s == stage_) inner.files.push_back(f.substr(prefix.size()));
    }
    const int saved_stages = static_cast<int>(stages.size());
    TORCH_CHECK(saved_stages == num_stages_ && *stages.begin() == 0 &&
                    *stages.rbegin() == num_stages_ - 1,
                "the checkpoint's ", ctx.dir, " holds ", saved_stages,
                " pipeline stages, this run has ", num_stages_);
    TORCH_CHECK(ctx.saved_world_size % num_stages_ == 0, "the checkpoint's world size ",
                ctx.saved_world_size, " is not a multiple of its ", num_stages_, " stages");
    inner.rank = replica_;
    inner.world_size = replicas_;
    inner.saved_world_size = ctx.saved_world_size / num_stages_;
    inner.dir = ctx.dir + "/" + StageDir(stage_);
    return inner_->restore(inner);
  }

 private:
  int stage_, num_stages_, replica_, replicas_;
  std::shared_ptr<Stateful> inner_;
};

}  // namespace

std::shared_ptr<Stateful> stage_item(int stage, int num_stages, int replica, int replicas,
                                     std::shared_ptr<Stateful> inner) {
  TORCH_CHECK(inner != nullptr, "train_state::stage_item: inner is null");
  TORCH_CHECK(num_stages >= 1 && stage >= 0 && stage < num_stages,
              "train_state::stage_item: stage ", stage, " of ", num_stages);
  TORCH_CHECK(replicas >= 1 && replica >= 0 && replica < replicas,
              "train_state::stage_item: replica ", replica, " of ", replicas);
  return std::make_shared<StageItem>(stage, num_stages, replica, replicas, std::move(inner));
}

std::shared_ptr<Stateful> oss_item(oss::OSS& optimizer) {
  return std::make_shared<OptimizerArchiveItem>(
      "oss", optimizer, [&optimizer] { optimizer.consolidate_state_dict(0); });
}

std::shared_ptr<Stateful> optimizer_item(torch::optim::Optimizer& optimizer) {
  return std::make_shared<OptimizerArchiveItem>("optimizer", optimizer, nullptr);
}

std::shared_ptr<Stateful> json_item(std::function<nlohmann::json()> get,
                                    std::function<void(const nlohmann::json&)> set) {
  TORCH_CHECK(get && set, "train_state::json_item: get and set must both be set");
  return std::make_shared<JsonItem>(std::move(get), std::move(set));
}

std::shared_ptr<Stateful> sampler_item(DistributedSampler sampler) {
  return std::make_shared<SamplerItem>(std::move(sampler));
}

std::shared_ptr<Stateful> grad_scaler_item(amp::GradScaler& scaler) {
  return std::make_shared<GradScalerItem>(scaler);
}

std::shared_ptr<Stateful> rng_item(bool reseed_on_world_change) {
  return std::make_shared<RngItem>(reseed_on_world_change);
}

std::shared_ptr<Stateful> module_item(std::shared_ptr<torch::nn::Module> module) {
  TORCH_CHECK(module != nullptr, "train_state::module_item: module is null");
  return std::make_shared<ModuleItem>(std::move(module));
}

}  // namespace fairscale::train_state
