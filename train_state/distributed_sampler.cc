#include "train_state/distributed_sampler.h"

#include <torch/serialize/archive.h>

#include <numeric>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/json_fields.h"
#include "base/torch_error.h"

namespace fairscale::train_state {
namespace {

constexpr char kArchiveKey[] = "fairscale_distributed_sampler";

// splitmix64 (Steele, Lea, Flood 2014; the reference generator of Vigna's xoshiro seeding): a
// fixed 64-bit recurrence, so the order does not depend on the standard library.
uint64_t SplitMix64(uint64_t& state) {
  state += 0x9E3779B97F4A7C15ULL;
  uint64_t z = state;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Uniform in [0, bound), bound >= 1, without modulo bias: reject the lowest (2^64 mod bound)
// values so that the accepted range is a multiple of bound.
uint64_t Below(uint64_t& state, uint64_t bound) {
  const uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound
  while (true) {
    const uint64_t r = SplitMix64(state);
    if (r >= threshold) return r % bound;
  }
}

std::string Bool(bool b) { return b ? "true" : "false"; }

// An unsigned integer written by state_dict() (nlohmann: unsigned), or a non-negative one built
// in C++ (nlohmann: signed).
absl::StatusOr<uint64_t> NonNegative(const base::JsonFields& f, const nlohmann::json& v,
                                     absl::string_view field) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer()) {
    absl::StatusOr<int64_t> x = f.Int(v, field, 0);
    if (!x.ok()) return x.status();
    return static_cast<uint64_t>(*x);
  }
  return f.WrongType(v, field, "a non-negative integer");
}

absl::StatusOr<bool> Boolean(const base::JsonFields& f, const nlohmann::json& v,
                             absl::string_view field) {
  if (!v.is_boolean()) return f.WrongType(v, field, "a boolean");
  return v.get<bool>();
}

}  // namespace

std::vector<size_t> epoch_order(size_t dataset_size, uint64_t seed, uint64_t epoch, bool shuffle) {
  std::vector<size_t> order(dataset_size);
  std::iota(order.begin(), order.end(), size_t{0});
  if (!shuffle || dataset_size < 2) return order;
  // The stream's start mixes seed and epoch through splitmix64 separately, so (seed, epoch) pairs
  // do not collide the way seed + epoch would ((1, 0) vs (0, 1)).
  uint64_t s = seed;
  uint64_t e = epoch ^ 0xD1B54A32D192ED03ULL;
  uint64_t state = SplitMix64(s) ^ SplitMix64(e);
  // Fisher-Yates, from the back.
  for (size_t i = dataset_size - 1; i > 0; --i) {
    const size_t j = static_cast<size_t>(Below(state, static_cast<uint64_t>(i) + 1));
    std::swap(order[i], order[j]);
  }
  return order;
}

struct DistributedSampler::State {
  State(size_t n, int r, int w, DistributedSamplerOptions o)
      : dataset_size(n), rank(r), world_size(w), options(o) {}

  const size_t dataset_size;
  const int rank;
  const int world_size;
  const DistributedSamplerOptions options;

  absl::Mutex mu;
  uint64_t epoch ABSL_GUARDED_BY(mu) = 0;
  // In [0, dataset_size): the epoch's end moves to (epoch + 1, 0) at once.
  size_t position ABSL_GUARDED_BY(mu) = 0;
  // An epoch ended and reset() has not been called since: next() returns nullopt.
  bool held ABSL_GUARDED_BY(mu) = false;
  // epoch_order(..., order_epoch, ...) when order_valid.
  std::vector<size_t> order ABSL_GUARDED_BY(mu);
  uint64_t order_epoch ABSL_GUARDED_BY(mu) = 0;
  bool order_valid ABSL_GUARDED_BY(mu) = false;

  std::string Context(absl::string_view method) const {
    return absl::StrCat("train_state::DistributedSampler::", method, " rank ", rank, "/",
                        world_size);
  }

  void EndEpoch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    ++epoch;
    position = 0;
    held = true;
  }

  const std::vector<size_t>& Order() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (!order_valid || order_epoch != epoch) {
      order = epoch_order(dataset_size, options.seed(), epoch, options.shuffle());
      order_epoch = epoch;
      order_valid = true;
    }
    return order;
  }
};

DistributedSampler::DistributedSampler(size_t dataset_size, int rank, int world_size,
                                       DistributedSamplerOptions options) {
  const char* context = "train_state::DistributedSampler";
  if (world_size < 1) {
    base::ThrowIfError(
        absl::InvalidArgumentError(absl::StrCat("world_size must be >= 1, got ", world_size)),
        context);
  }
  if (rank < 0 || rank >= world_size) {
    base::ThrowIfError(absl::InvalidArgumentError(absl::StrCat(
                           "rank must be in [0, world_size = ", world_size, "), got ", rank)),
                       context);
  }
  if (dataset_size < 1) {
    base::ThrowIfError(absl::InvalidArgumentError("dataset_size must be >= 1, got 0"), context);
  }
  state_ = std::make_shared<State>(dataset_size, rank, world_size, options);
}

void DistributedSampler::reset(torch::optional<size_t> new_size) {
  State& s = *state_;
  if (new_size.has_value() && *new_size != s.dataset_size) {
    base::ThrowIfError(
        absl::InvalidArgumentError(absl::StrCat(
            "new_size ", *new_size, " differs from this sampler's dataset_size ", s.dataset_size,
            " (another size is another order: build a new DistributedSampler for it)")),
        s.Context("reset"));
  }
  absl::MutexLock lock(&s.mu);
  s.held = false;
}

torch::optional<std::vector<size_t>> DistributedSampler::next(size_t batch_size) {
  State& s = *state_;
  const size_t world = static_cast<size_t>(s.world_size);
  size_t global = 0;
  if (batch_size < 1 || __builtin_mul_overflow(batch_size, world, &global)) {
    base::ThrowIfError(absl::InvalidArgumentError(absl::StrCat(
                           "batch_size must be >= 1 and batch_size * world_size must fit "
                           "size_t, got batch_size ",
                           batch_size, ", world_size ", world)),
                       s.Context("next"));
  }
  absl::MutexLock lock(&s.mu);
  if (s.held) return torch::nullopt;
  const size_t n = s.dataset_size;
  const size_t remaining = n - s.position;  // >= 1
  if (s.options.drop_last() && remaining < global) {
    s.EndEpoch();
    return torch::nullopt;
  }
  const std::vector<size_t>& order = s.Order();
  std::vector<size_t> local(batch_size);
  const size_t first = static_cast<size_t>(s.rank) * batch_size;  // offset in the global batch
  for (size_t j = 0; j < batch_size; ++j) {
    const size_t offset = first + j;
    // Entries past the end of the order pad by wrapping to its start (offset - remaining can be
    // >= n when the global batch is larger than the dataset).
    local[j] = offset < remaining ? order[s.position + offset] : order[(offset - remaining) % n];
  }
  if (global >= remaining || (s.options.drop_last() && remaining - global < global)) {
    s.EndEpoch();
  } else {
    s.position += global;
  }
  return local;
}

nlohmann::json DistributedSampler::state_dict() const {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  return nlohmann::json{
      {"seed", s.options.seed()},
      {"shuffle", s.options.shuffle()},
      {"drop_last", s.options.drop_last()},
      {"dataset_size", static_cast<uint64_t>(s.dataset_size)},
      {"epoch", s.epoch},
      {"position", static_cast<uint64_t>(s.position)},
  };
}

void DistributedSampler::load_state_dict(const nlohmann::json& state) {
  State& s = *state_;
  const std::string context = s.Context("load_state_dict");
  const base::JsonFields f("state ");
  if (!state.is_object())
    base::ThrowIfError(f.WrongType(state, "(top level)", "an object"), context);
  auto need = [&](const char* key) -> const nlohmann::json& {
    return *base::ValueOrThrow(f.Need(state, key, key), context);
  };
  auto mismatch = [&](const char* field, const std::string& saved, const std::string& mine) {
    base::ThrowIfError(absl::InvalidArgumentError(absl::StrCat(
                           "state ", field, " is ", saved, " but this sampler's ", field, " is ",
                           mine, ": the data order would differ from the saved run's")),
                       context);
  };

  const uint64_t seed = base::ValueOrThrow(NonNegative(f, need("seed"), "seed"), context);
  const bool shuffle = base::ValueOrThrow(Boolean(f, need("shuffle"), "shuffle"), context);
  const bool drop_last = base::ValueOrThrow(Boolean(f, need("drop_last"), "drop_last"), context);
  const uint64_t dataset_size =
      base::ValueOrThrow(NonNegative(f, need("dataset_size"), "dataset_size"), context);
  const uint64_t epoch = base::ValueOrThrow(NonNegative(f, need("epoch"), "epoch"), context);
  const uint64_t position =
      base::ValueOrThrow(NonNegative(f, need("position"), "position"), context);

  if (dataset_size != s.dataset_size) {
    mismatch("dataset_size", absl::StrCat(dataset_size), absl::StrCat(s.dataset_size));
  }
  if (seed != s.options.seed()) {
    mismatch("seed", absl::StrCat(seed), absl::StrCat(s.options.seed()));
  }
  if (shuffle != s.options.shuffle()) {
    mismatch("shuffle", Bool(shuffle), Bool(s.options.shuffle()));
  }
  if (drop_last != s.options.drop_last()) {
    mismatch("drop_last", Bool(drop_last), Bool(s.options.drop_last()));
  }
  if (position > dataset_size) {
    base::ThrowIfError(
        f.Error("position",
                absl::StrCat("must be in [0, dataset_size = ", dataset_size, "], got ", position)),
        context);
  }

  absl::MutexLock lock(&s.mu);
  s.held = false;
  if (position == s.dataset_size) {
    s.epoch = epoch + 1;
    s.position = 0;
  } else {
    s.epoch = epoch;
    s.position = static_cast<size_t>(position);
  }
}

void DistributedSampler::save(torch::serialize::OutputArchive& archive) const {
  archive.write(kArchiveKey, c10::IValue(state_dict().dump()));
}

void DistributedSampler::load(torch::serialize::InputArchive& archive) {
  const std::string context = state_->Context("load");
  c10::IValue value;
  if (!archive.try_read(kArchiveKey, value)) {
    base::ThrowIfError(absl::NotFoundError(absl::StrCat("the archive has no key '", kArchiveKey,
                                                        "' (not saved by DistributedSampler)")),
                       context);
  }
  if (!value.isString()) {
    base::ThrowIfError(absl::DataLossError(absl::StrCat("archive key '", kArchiveKey, "' holds a ",
                                                        value.tagKind(), ", expected a string")),
                       context);
  }
  nlohmann::json state = nlohmann::json::parse(value.toStringRef(), nullptr,
                                               /*allow_exceptions=*/false);
  if (state.is_discarded()) {
    base::ThrowIfError(
        absl::DataLossError(absl::StrCat("archive key '", kArchiveKey, "' holds no valid JSON")),
        context);
  }
  load_state_dict(state);
}

uint64_t DistributedSampler::epoch() const {
  absl::MutexLock lock(&state_->mu);
  return state_->epoch;
}

size_t DistributedSampler::position() const {
  absl::MutexLock lock(&state_->mu);
  return state_->position;
}

void DistributedSampler::set_epoch(uint64_t epoch) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  s.held = false;
  if (epoch == s.epoch) return;
  s.epoch = epoch;
  s.position = 0;
}

size_t DistributedSampler::dataset_size() const { return state_->dataset_size; }
int DistributedSampler::rank() const { return state_->rank; }
int DistributedSampler::world_size() const { return state_->world_size; }
const DistributedSamplerOptions& DistributedSampler::options() const { return state_->options; }

}  // namespace fairscale::train_state
