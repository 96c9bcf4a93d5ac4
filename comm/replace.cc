#include "comm/replace.h"

#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "comm/registry.h"

namespace fairscale::comm {
namespace {

// Raises "fscomm/<name>/epoch" to `epoch`; kFailedPrecondition when it is already higher.
absl::Status StartEpoch(Store& store, absl::string_view name, int64_t epoch, int rank) {
  const std::string key = absl::StrCat("fscomm/", name, "/epoch");
  const std::string want = absl::StrCat(epoch);
  std::string expected;  // a missing key reads as ""
  // Each failed CompareSet means another rank raised it meanwhile: a few rounds at most.
  for (int attempt = 0; attempt < 1000; ++attempt) {
    absl::StatusOr<std::string> now = store.CompareSet(key, expected, want);
    if (!now.ok()) {
      return absl::Status(now.status().code(),
                          absl::StrCat("recording epoch ", epoch, " of '", name,
                                       "' in the store: ", now.status().message()));
    }
    if (*now == want) return absl::OkStatus();
    int64_t current = 0;
    if (!absl::SimpleAtoi(*now, &current)) {
      return absl::InternalError(
          absl::StrCat("store key ", key, " holds '", *now, "', not an epoch number"));
    }
    if (current > epoch) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", rank, " asked for epoch ", epoch, " of communicator '", name,
          "', but epoch ", current,
          " has already started: this rank is stale (it missed a membership change); ask the "
          "quorum for the current epoch"));
    }
    expected = *std::move(now);
  }
  return absl::AbortedError(absl::StrCat("could not record epoch ", epoch, " of '", name,
                                         "' in the store: too much contention"));
}

}  // namespace

std::string EpochName(absl::string_view name, int64_t epoch) {
  return absl::StrCat(name.empty() ? "default" : name, "/epoch", epoch);
}

void ReleaseCommunicator(std::shared_ptr<Communicator> comm, absl::Status reason) {
  if (comm == nullptr) return;
  if (!reason.ok() && comm->status().ok()) comm->Abort(std::move(reason));
  if (comm.use_count() > 1) {
    FS_VLOG(1) << "communicator released but still referenced elsewhere ("
               << comm.use_count() - 1 << " more); its last holder destroys it";
  }
  comm.reset();  // the destructor is bounded: see replace.h
}

absl::StatusOr<std::shared_ptr<Communicator>> ReplaceCommunicator(
    std::shared_ptr<Communicator> failed, absl::string_view backend, const CommConfig& config,
    int64_t epoch) {
  const std::string name = config.name.empty() ? "default" : config.name;
  if (epoch < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ReplaceCommunicator('", name, "'): negative epoch ", epoch));
  }
  ReleaseCommunicator(std::move(failed));
  if (config.store == nullptr && config.size > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ReplaceCommunicator('", name, "') epoch ", epoch, ": CommConfig::store is required"));
  }
  if (config.store != nullptr) {
    if (absl::Status s = StartEpoch(*config.store, name, epoch, config.rank); !s.ok()) return s;
  }
  CommConfig next = config;
  next.name = EpochName(name, epoch);
  return CreateCommunicator(backend, next);
}

}  // namespace fairscale::comm
