#include "train_state/fsdp_item.h"

#include <c10/util/Exception.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/sharded_checkpoint.h"

namespace fairscale::train_state {
namespace {

class FsdpSnapshot final : public Stateful::Snapshot {
 public:
  fsdp::ShardedCheckpointSnapshot snap;

  absl::StatusOr<WriteResult> write(const std::string& dir) override {
    absl::StatusOr<fsdp::ShardFileSummary> s = snap.write(dir);
    if (!s.ok()) return s.status();
    WriteResult r;
    r.files.push_back(s->name);
    r.info = {{"name", s->name},
              {"bytes", s->bytes},
              {"fnv1a", s->fnv1a},
              {"header_fnv1a", s->header_fnv1a}};
    return r;
  }

  absl::StatusOr<std::vector<std::string>> finalize(
      const std::string& dir, const std::vector<WriteResult>& results) override {
    if (snap.rank() != 0) return std::vector<std::string>();  // the manifest is rank 0's
    std::vector<fsdp::ShardFileSummary> summaries;
    for (const WriteResult& r : results) {
      const nlohmann::json& i = r.info;
      if (!i.is_object() || !i.contains("name") || !i["name"].is_string() ||
          !i.contains("bytes") || !i["bytes"].is_number_integer() || !i.contains("fnv1a") ||
          !i["fnv1a"].is_number_unsigned() || !i.contains("header_fnv1a") ||
          !i["header_fnv1a"].is_number_unsigned()) {
        return absl::InternalError(absl::StrCat("a rank's shard file summary is malformed: ",
                                                i.dump()));
      }
      summaries.push_back({i["name"].get<std::string>(), i["bytes"].get<int64_t>(),
                           i["fnv1a"].get<uint64_t>(), i["header_fnv1a"].get<uint64_t>()});
    }
    absl::Status s = fsdp::write_sharded_manifest(snap, summaries, dir);
    if (!s.ok()) return s;
    return std::vector<std::string>{"manifest.json"};
  }
};

class FsdpItem final : public Stateful {
 public:
  FsdpItem(fsdp::FullyShardedDataParallel model, torch::optim::Optimizer* optimizer)
      : model_(std::move(model)), optimizer_(optimizer) {}
  std::string kind() const override { return "fsdp_sharded"; }

  std::unique_ptr<Snapshot> snapshot(const SaveContext&, std::unique_ptr<Snapshot> reuse) override {
    std::unique_ptr<FsdpSnapshot> prev(dynamic_cast<FsdpSnapshot*>(reuse.release()));
    auto out = std::make_unique<FsdpSnapshot>();
    out->snap = fsdp::snapshot_sharded_checkpoint(model_, optimizer_,
                                                  prev != nullptr ? &prev->snap : nullptr);
    return out;
  }

  std::function<void()> restore(const RestoreContext& ctx) override {
    return fsdp::stage_sharded_checkpoint(model_, optimizer_, ctx.dir);
  }

 private:
  fsdp::FullyShardedDataParallel model_;
  torch::optim::Optimizer* optimizer_;
};

}  // namespace

std::shared_ptr<Stateful> fsdp_item(fsdp::FullyShardedDataParallel model,
                                    torch::optim::Optimizer* optimizer) {
  TORCH_CHECK(!model.is_empty(), "train_state::fsdp_item: the model is empty");
  return std::make_shared<FsdpItem>(std::move(model), optimizer);
}

}  // namespace fairscale::train_state
