// Tests of DistributedSampler. Ranks are sampler objects in one process (the sampler needs no
// communication). The reference for a global sequence is written here from the definition: from
// position p with global batch B, the k-th global batch holds the order's entries p + k*B + i
// (i < B), taken modulo dataset_size (the padding wraps to the epoch's start); with drop_last
// there are floor((n - p) / B) such batches, with padding ceil((n - p) / B).
#include "train_state/distributed_sampler.h"

#include <torch/data/dataloader.h>
#include <torch/data/datasets/base.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/c10_error.h"

namespace fairscale::train_state {
namespace {

using ::fairscale::base::testing::IsOk;
using ::fairscale::testing::ErrorOf;
using ::fairscale::testing::ExpectError;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using Batch = std::vector<size_t>;

std::vector<DistributedSampler> MakeRanks(size_t n, int world, DistributedSamplerOptions options) {
  std::vector<DistributedSampler> ranks;
  for (int r = 0; r < world; ++r) ranks.emplace_back(n, r, world, options);
  return ranks;
}

// One global step: next(b) on every rank, the local batches concatenated in rank order; nullopt
// when every rank says the epoch ended (a disagreement fails the test).
torch::optional<Batch> GlobalStep(std::vector<DistributedSampler>& ranks, size_t b,
                                  std::vector<Batch>* per_rank = nullptr) {
  Batch global;
  int ended = 0;
  for (auto& s : ranks) {
    torch::optional<Batch> local = s.next(b);
    if (!local) {
      ++ended;
      continue;
    }
    EXPECT_EQ(local->size(), b);
    if (per_rank != nullptr) per_rank->push_back(*local);
    global.insert(global.end(), local->begin(), local->end());
  }
  EXPECT_TRUE(ended == 0 || ended == static_cast<int>(ranks.size())) << ended << " ranks ended";
  if (ended > 0) return torch::nullopt;
  return global;
}

// Global batches until the end of the epoch.
std::vector<Batch> RestOfEpoch(std::vector<DistributedSampler>& ranks, size_t b) {
  std::vector<Batch> out;
  while (auto g = GlobalStep(ranks, b)) out.push_back(*g);
  return out;
}

// The reference (see the top of the file): the global batches of size B from position p.
std::vector<Batch> Reference(const Batch& order, size_t p, size_t B, bool drop_last) {
  const size_t n = order.size();
  const size_t count = drop_last ? (n - p) / B : (n - p + B - 1) / B;
  std::vector<Batch> out(count);
  for (size_t k = 0; k < count; ++k) {
    for (size_t i = 0; i < B; ++i) out[k].push_back(order[(p + k * B + i) % n]);
  }
  return out;
}

Batch Concat(const std::vector<Batch>& batches) {
  Batch all;
  for (const Batch& b : batches) all.insert(all.end(), b.begin(), b.end());
  return all;
}

const size_t kSizes[] = {1, 2, 3, 5, 7, 12, 13, 24, 25, 100};

TEST(EpochOrder, PinnedGenerator) {
  // Literal values (also what a Python transcription of the algorithm in distributed_sampler.cc
  // gives): a change of the generator, or of how seed and epoch seed it, changes every saved run's
  // data order, and must be deliberate.
  const Batch order = epoch_order(100, /*seed=*/0, /*epoch=*/0, /*shuffle=*/true);
  EXPECT_THAT(Batch(order.begin(), order.begin() + 10),
              ElementsAreArray<size_t>({41, 45, 23, 0, 17, 26, 55, 99, 72, 79}));
}

TEST(EpochOrder, PermutationIdentityAndDeterminism) {
  for (size_t n : kSizes) {
    Batch identity(n);
    for (size_t i = 0; i < n; ++i) identity[i] = i;
    EXPECT_EQ(epoch_order(n, 7, 3, /*shuffle=*/false), identity);
    Batch shuffled = epoch_order(n, 7, 3, /*shuffle=*/true);
    EXPECT_EQ(shuffled, epoch_order(n, 7, 3, true)) << n;
    std::sort(shuffled.begin(), shuffled.end());
    EXPECT_EQ(shuffled, identity) << n;
  }
  // Epochs reshuffle; seeds differ; (seed, epoch) pairs do not alias.
  EXPECT_NE(epoch_order(100, 7, 0, true), epoch_order(100, 7, 1, true));
  EXPECT_NE(epoch_order(100, 7, 0, true), epoch_order(100, 8, 0, true));
  EXPECT_NE(epoch_order(100, 1, 0, true), epoch_order(100, 0, 1, true));
  EXPECT_NE(epoch_order(100, 7, 0, true), epoch_order(100, 7, 0, false));
}

// Every world size, dataset size, local batch, drop_last and shuffle: a full epoch is the
// reference; the union of the ranks' slices is the world-1 sampler's batch of B_global; ranks are
// disjoint within a global batch; with drop_last no sample repeats and floor(n/B)*B are seen; with
// padding every sample is seen and the padding is the first entries of the order.
TEST(DistributedSampler, FullEpochMatchesReferenceAtEveryWorldSize) {
  for (int world = 1; world <= 4; ++world) {
    for (size_t n : kSizes) {
      for (size_t b = 1; b <= 3; ++b) {
        for (bool drop_last : {false, true}) {
          for (bool shuffle : {false, true}) {
            SCOPED_TRACE(absl::StrCat("world ", world, " n ", n, " b ", b, " drop_last ", drop_last,
                                      " shuffle ", shuffle));
            const auto options =
                DistributedSamplerOptions().seed(42).shuffle(shuffle).drop_last(drop_last);
            const size_t B = b * world;
            const Batch order = epoch_order(n, 42, 0, shuffle);
            auto ranks = MakeRanks(n, world, options);
            auto single = MakeRanks(n, 1, options);
            std::vector<Batch> got;
            while (true) {
              std::vector<Batch> per_rank;
              auto g = GlobalStep(ranks, b, &per_rank);
              auto g1 = GlobalStep(single, B);
              ASSERT_EQ(g.has_value(), g1.has_value());
              if (!g) break;
              EXPECT_EQ(*g, *g1);  // the order does not depend on the world size
              ASSERT_EQ(per_rank.size(), static_cast<size_t>(world));
              for (int r = 0; r < world; ++r) {  // rank r holds slice r
                EXPECT_EQ(per_rank[r], Batch(g->begin() + r * b, g->begin() + (r + 1) * b));
              }
              got.push_back(*g);
            }
            EXPECT_EQ(got, Reference(order, 0, B, drop_last));
            const Batch all = Concat(got);
            const std::set<size_t> distinct(all.begin(), all.end());
            if (drop_last) {
              EXPECT_EQ(all.size(), n / B * B);
              EXPECT_EQ(distinct.size(), all.size());  // no sample twice, ranks disjoint
            } else {
              EXPECT_EQ(distinct.size(), n);  // every sample at least once
              ASSERT_GE(all.size(), n);
              EXPECT_EQ(Batch(all.begin(), all.begin() + n), order);
              for (size_t i = n; i < all.size(); ++i) EXPECT_EQ(all[i], order[(i - n) % n]);
            }
            // The end holds until reset(), and then the next epoch starts.
            for (auto& s : ranks) {
              EXPECT_FALSE(s.next(b).has_value());
              EXPECT_EQ(s.epoch(), 1u);
              EXPECT_EQ(s.position(), 0u);
              s.reset();
            }
            EXPECT_EQ(RestOfEpoch(ranks, b),
                      Reference(epoch_order(n, 42, 1, shuffle), 0, B, drop_last));
          }
        }
      }
    }
  }
}

TEST(DistributedSampler, HandWrittenBatchesWithoutShuffle) {
  // n = 7, world 2, local batch 2 (B = 4): [0 1 | 2 3], then [4 5 | 6 0] padded, or nothing more
  // with drop_last.
  auto ranks = MakeRanks(7, 2, DistributedSamplerOptions().shuffle(false));
  EXPECT_EQ(ranks[0].next(2), Batch({0, 1}));
  EXPECT_EQ(ranks[1].next(2), Batch({2, 3}));
  EXPECT_EQ(ranks[0].next(2), Batch({4, 5}));
  EXPECT_EQ(ranks[1].next(2), Batch({6, 0}));
  EXPECT_FALSE(ranks[0].next(2).has_value());

  auto dropping = MakeRanks(7, 2, DistributedSamplerOptions().shuffle(false).drop_last(true));
  EXPECT_EQ(dropping[1].next(2), Batch({2, 3}));
  EXPECT_FALSE(dropping[1].next(2).has_value());
  EXPECT_EQ(dropping[1].epoch(), 1u);

  // A dataset smaller than one global batch: padding wraps more than once.
  auto tiny = MakeRanks(2, 3, DistributedSamplerOptions().shuffle(false));
  EXPECT_EQ(tiny[0].next(2), Batch({0, 1}));
  EXPECT_EQ(tiny[1].next(2), Batch({0, 1}));
  EXPECT_EQ(tiny[2].next(2), Batch({0, 1}));
}

TEST(DistributedSampler, SameSeedSameOrderOtherSeedOtherOrder) {
  auto a = MakeRanks(100, 2, DistributedSamplerOptions().seed(5));
  auto b = MakeRanks(100, 2, DistributedSamplerOptions().seed(5));
  auto c = MakeRanks(100, 2, DistributedSamplerOptions().seed(6));
  const auto ea = RestOfEpoch(a, 3), eb = RestOfEpoch(b, 3), ec = RestOfEpoch(c, 3);
  EXPECT_EQ(ea, eb);
  EXPECT_NE(ea, ec);
  for (auto* ranks : {&a, &b}) {
    for (auto& s : *ranks) s.reset();
  }
  const auto ea1 = RestOfEpoch(a, 3);
  EXPECT_EQ(ea1, RestOfEpoch(b, 3));
  EXPECT_NE(ea1, ea);  // epoch 1 reshuffles
}

// Stop after k global batches at world W1 (local batch b1), save, resume at W2 (local batch b2):
// the concatenated global sequence is the uninterrupted order from 0 with B1 for k batches, then
// from k*B1 with B2; at W1 == W2 (and b1 == b2) every rank's batches are the uninterrupted run's.
TEST(DistributedSampler, ResumeAtAnyWorldSizeContinuesTheOrder) {
  for (size_t n : {13, 24, 25}) {
    for (bool drop_last : {false, true}) {
      for (int w1 = 1; w1 <= 4; ++w1) {
        for (int w2 = 1; w2 <= 4; ++w2) {
          for (size_t b1 = 1; b1 <= 3; ++b1) {
            for (size_t b2 : {b1, size_t{2}}) {
              const size_t B1 = b1 * w1, B2 = b2 * w2;
              const auto options = DistributedSamplerOptions().seed(3).drop_last(drop_last);
              const Batch order = epoch_order(n, 3, 0, true);
              const size_t full = drop_last ? n / B1 : (n + B1 - 1) / B1;
              for (size_t k = 0; k < full; ++k) {  // k < full: the epoch is not over at the save
                SCOPED_TRACE(absl::StrCat("n ", n, " drop_last ", drop_last, " W1 ", w1, " W2 ", w2,
                                          " b1 ", b1, " b2 ", b2, " k ", k));
                auto first = MakeRanks(n, w1, options);
                std::vector<Batch> got;
                for (size_t i = 0; i < k; ++i) got.push_back(*GlobalStep(first, b1));
                const nlohmann::json saved = first[0].state_dict();
                for (auto& s : first) EXPECT_EQ(s.state_dict(), saved);
                EXPECT_EQ(saved["position"].get<size_t>(), k * B1);

                auto second = MakeRanks(n, w2, options);
                for (auto& s : second) {
                  s.load_state_dict(saved);
                  s.reset();  // what the DataLoader does at begin(): must not rewind
                }
                const std::vector<Batch> rest = RestOfEpoch(second, b2);
                got.insert(got.end(), rest.begin(), rest.end());

                std::vector<Batch> want = Reference(order, 0, B1, drop_last);
                want.resize(k);
                const std::vector<Batch> want_rest = Reference(order, k * B1, B2, drop_last);
                want.insert(want.end(), want_rest.begin(), want_rest.end());
                ASSERT_EQ(got, want);
                // No sample twice, none skipped: the unpadded part is a prefix of the order.
                const Batch all = Concat(got);
                const size_t real = std::min(all.size(), n);
                EXPECT_EQ(Batch(all.begin(), all.begin() + real),
                          Batch(order.begin(), order.begin() + real));
                if (drop_last) {
                  EXPECT_LT(n - all.size(), B2);  // only a tail shorter than B2 is dropped
                } else {
                  EXPECT_GE(all.size(), n);
                }

                if (w1 == w2 && b1 == b2) {  // per rank, exactly the uninterrupted batches
                  auto whole = MakeRanks(n, w1, options);
                  auto resumed = MakeRanks(n, w1, options);
                  for (size_t i = 0; i < k; ++i) GlobalStep(whole, b1);
                  for (auto& s : resumed) s.load_state_dict(saved);
                  for (int r = 0; r < w1; ++r) {
                    while (true) {
                      auto x = whole[r].next(b1);
                      auto y = resumed[r].next(b1);
                      ASSERT_EQ(x, y);
                      if (!x) break;
                    }
                  }
                }
              }
            }
          }
        }
      }
    }
  }
}

TEST(DistributedSampler, ResetNeverRewindsAndStartsTheNextEpochAfterTheEnd) {
  DistributedSampler s(10, 0, 1, DistributedSamplerOptions().shuffle(false));
  s.reset();  // a fresh sampler: the loader's begin()
  EXPECT_EQ(s.next(3), Batch({0, 1, 2}));
  s.reset();  // a loop that stopped early and begins again
  EXPECT_EQ(s.position(), 3u);
  EXPECT_EQ(s.next(3), Batch({3, 4, 5}));

  DistributedSampler restored(10, 0, 1, DistributedSamplerOptions().shuffle(false));
  restored.load_state_dict(s.state_dict());
  restored.reset();
  EXPECT_EQ(restored.next(3), Batch({6, 7, 8}));
  EXPECT_EQ(restored.next(3), Batch({9, 0, 1}));  // padded: the epoch ends here
  EXPECT_EQ(restored.epoch(), 1u);
  EXPECT_EQ(restored.position(), 0u);
  EXPECT_FALSE(restored.next(3).has_value());
  EXPECT_FALSE(restored.next(3).has_value());  // held until reset (prefetching loaders ask again)
  restored.reset();
  EXPECT_EQ(restored.next(3), Batch({0, 1, 2}));

  // set_epoch: the current epoch keeps its position (PyTorch's per-epoch call after a restore);
  // another epoch starts at 0; after an end, set_epoch(epoch()) starts that epoch.
  restored.set_epoch(1);
  EXPECT_EQ(restored.position(), 3u);
  restored.set_epoch(5);
  EXPECT_EQ(restored.epoch(), 5u);
  EXPECT_EQ(restored.position(), 0u);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(restored.next(3).has_value());
  EXPECT_FALSE(restored.next(3).has_value());
  restored.set_epoch(restored.epoch());
  EXPECT_EQ(restored.epoch(), 6u);
  EXPECT_EQ(restored.next(3), Batch({0, 1, 2}));

  // A saved position == dataset_size (not written by state_dict) is the next epoch's start.
  nlohmann::json at_end = restored.state_dict();
  at_end["epoch"] = 2;
  at_end["position"] = 10;
  restored.load_state_dict(at_end);
  EXPECT_EQ(restored.epoch(), 3u);
  EXPECT_EQ(restored.position(), 0u);
}

TEST(DistributedSampler, CopiesShareOnePosition) {
  DistributedSampler s(10, 0, 1, DistributedSamplerOptions().shuffle(false));
  DistributedSampler copy = s;
  EXPECT_EQ(copy.next(4), Batch({0, 1, 2, 3}));
  EXPECT_EQ(s.position(), 4u);
  EXPECT_EQ(s.next(4), Batch({4, 5, 6, 7}));
  EXPECT_EQ(copy.state_dict(), s.state_dict());
}

// A dataset whose example i is the tensor [i].
class IndexDataset : public torch::data::datasets::Dataset<IndexDataset, torch::Tensor> {
 public:
  explicit IndexDataset(size_t n) : n_(n) {}
  torch::Tensor get(size_t index) override {
    return torch::full({1}, static_cast<int64_t>(index), torch::kLong);
  }
  torch::optional<size_t> size() const override { return n_; }

 private:
  size_t n_;
};

Batch Indices(const std::vector<torch::Tensor>& batch) {
  Batch out;
  for (const torch::Tensor& t : batch) out.push_back(static_cast<size_t>(t.item<int64_t>()));
  return out;
}

TEST(DistributedSampler, DataLoaderEpochsAndResume) {
  const size_t n = 23, b = 2;  // at least 4 global batches per epoch at every world size
  const auto options = DistributedSamplerOptions().seed(9);
  for (int world = 1; world <= 3; ++world) {
    SCOPED_TRACE(absl::StrCat("world ", world));
    const size_t B = b * world;
    for (int rank = 0; rank < world; ++rank) {
      DistributedSampler sampler(n, rank, world, options);
      auto loader = torch::data::make_data_loader(IndexDataset(n), sampler,
                                                  torch::data::DataLoaderOptions().batch_size(b));
      for (uint64_t epoch = 0; epoch < 2; ++epoch) {
        const std::vector<Batch> want = Reference(epoch_order(n, 9, epoch, true), 0, B, false);
        std::vector<Batch> got;
        EXPECT_EQ(sampler.epoch(), epoch);
        for (auto& batch : *loader) got.push_back(Indices(batch));
        ASSERT_EQ(got.size(), want.size());
        for (size_t i = 0; i < got.size(); ++i) {
          EXPECT_EQ(got[i], Batch(want[i].begin() + rank * b, want[i].begin() + (rank + 1) * b));
        }
        EXPECT_EQ(sampler.epoch(), epoch + 1);
      }

      // Stop after 2 batches of epoch 2, save, resume in a new sampler and loader: the rest of
      // epoch 2 follows. A loader that begins again without a restore continues too.
      const std::vector<Batch> want = Reference(epoch_order(n, 9, 2, true), 0, B, false);
      ASSERT_GE(want.size(), 4u);
      auto slice = [&](size_t i) {
        return Batch(want[i].begin() + rank * b, want[i].begin() + (rank + 1) * b);
      };
      nlohmann::json saved;
      size_t seen = 0;
      for (auto& batch : *loader) {
        EXPECT_EQ(Indices(batch), slice(seen));
        saved = sampler.state_dict();
        if (++seen == 2) break;
      }
      {
        auto it = loader->begin();  // begins again: continues with batch 2
        ASSERT_NE(it, loader->end());
        EXPECT_EQ(Indices(*it), slice(2));
      }
      DistributedSampler resumed(n, rank, world, options);
      resumed.load_state_dict(saved);
      auto loader2 = torch::data::make_data_loader(IndexDataset(n), resumed,
                                                   torch::data::DataLoaderOptions().batch_size(b));
      size_t i = 2;
      for (auto& batch : *loader2) EXPECT_EQ(Indices(batch), slice(i++));
      EXPECT_EQ(i, want.size());
      EXPECT_EQ(resumed.epoch(), 3u);
    }
  }
}

TEST(DistributedSampler, ArchiveRoundTrip) {
  DistributedSampler s(50, 1, 2, DistributedSamplerOptions().seed(77));
  s.set_epoch(4);
  ASSERT_TRUE(s.next(3).has_value());
  std::stringstream stream;
  {
    torch::serialize::OutputArchive out;
    s.save(out);
    out.save_to(stream);
  }
  DistributedSampler t(50, 0, 3, DistributedSamplerOptions().seed(77));
  torch::serialize::InputArchive in;
  in.load_from(stream);
  t.load(in);
  EXPECT_EQ(t.epoch(), 4u);
  EXPECT_EQ(t.position(), 6u);
  EXPECT_EQ(t.state_dict(), s.state_dict());

  torch::serialize::InputArchive empty_in;
  std::stringstream empty_stream;
  {
    torch::serialize::OutputArchive out;
    out.write("something_else", c10::IValue(int64_t{1}));
    out.save_to(empty_stream);
  }
  empty_in.load_from(empty_stream);
  EXPECT_THAT(ErrorOf([&] { t.load(empty_in); }),
              HasSubstr("no key 'fairscale_distributed_sampler'"));
}

TEST(DistributedSampler, BadStateNamesTheFieldAndLeavesTheSamplerUnchanged) {
  DistributedSampler s(20, 0, 2, DistributedSamplerOptions().seed(1));
  ASSERT_TRUE(s.next(2).has_value());
  const nlohmann::json good = s.state_dict();
  auto with = [&](const char* key, nlohmann::json value) {
    nlohmann::json j = good;
    j[key] = std::move(value);
    return j;
  };
  auto without = [&](const char* key) {
    nlohmann::json j = good;
    j.erase(key);
    return j;
  };
  auto expect = [&](const nlohmann::json& state, std::vector<std::string> needles) {
    SCOPED_TRACE(state.dump());
    EXPECT_THAT(ExpectError([&] { s.load_state_dict(state); }, needles), IsOk());
    EXPECT_EQ(s.state_dict(), good);
  };
  for (const char* key : {"seed", "shuffle", "drop_last", "dataset_size", "epoch", "position"}) {
    expect(without(key), {"load_state_dict", absl::StrCat("state ", key, ": missing")});
  }
  expect(nlohmann::json::array(), {"expected an object"});
  expect(with("epoch", "3"), {"state epoch: expected a non-negative integer, got string"});
  expect(with("epoch", -1), {"state epoch: must be in [0, "});
  expect(with("position", 1.5), {"state position: expected a non-negative integer"});
  expect(with("position", 21), {"state position: must be in [0, dataset_size = 20], got 21"});
  expect(with("shuffle", 1), {"state shuffle: expected a boolean, got number"});
  expect(with("drop_last", "false"), {"state drop_last: expected a boolean"});
  expect(with("seed", nullptr), {"state seed: expected a non-negative integer, got null"});
  expect(with("dataset_size", 21),
         {"INVALID_ARGUMENT", "state dataset_size is 21", "this sampler's dataset_size is 20"});
  expect(with("seed", 2), {"state seed is 2", "this sampler's seed is 1"});
  expect(with("shuffle", false), {"state shuffle is false", "this sampler's shuffle is true"});
  expect(with("drop_last", true), {"state drop_last is true", "this sampler's drop_last is false"});
  // Signed integers, as a C++ caller builds them, are accepted.
  nlohmann::json signed_ints = good;
  signed_ints["epoch"] = int64_t{3};
  signed_ints["position"] = int64_t{4};
  s.load_state_dict(signed_ints);
  EXPECT_EQ(s.epoch(), 3u);
  EXPECT_EQ(s.position(), 4u);
}

TEST(DistributedSampler, BadArgumentsNameTheArgument) {
  EXPECT_THAT(ErrorOf([] { DistributedSampler(10, 0, 0); }),
              HasSubstr("world_size must be >= 1, got 0"));
  EXPECT_THAT(ErrorOf([] { DistributedSampler(10, -1, 2); }),
              HasSubstr("rank must be in [0, world_size = 2), got -1"));
  EXPECT_THAT(ErrorOf([] { DistributedSampler(10, 2, 2); }),
              HasSubstr("rank must be in [0, world_size = 2), got 2"));
  EXPECT_THAT(ErrorOf([] { DistributedSampler(0, 0, 1); }),
              HasSubstr("dataset_size must be >= 1, got 0"));
  DistributedSampler s(10, 1, 2);
  EXPECT_THAT(ErrorOf([&] { s.next(0); }),
              HasSubstr("next rank 1/2: INVALID_ARGUMENT: batch_size"));
  EXPECT_THAT(ErrorOf([&] { s.reset(11); }),
              HasSubstr("new_size 11 differs from this sampler's dataset_size 10"));
  s.reset(10);  // the same size is fine
}

}  // namespace
}  // namespace fairscale::train_state
