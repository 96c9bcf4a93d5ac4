// TpGpt (tp_model.h) against the dense Gpt (model.h) at T = 1, 2, 4 (ranks as threads over the
// inproc backend): the dense model is built once in the main thread with torch::manual_seed
// (rank threads share torch's global RNG, so no rank body draws from it) and every rank loads
// its weights with load_dense_state_dict. Loss, logits, every parameter gradient (= the dense
// gradient's slice, the fused QKV one strided), 5 Adam steps (losses and full state dict), all
// within 1e-5 (f32); the full state dict exported at T = 2 loads into the dense Gpt (same
// logits); the fused-QKV reordering on explicit rows; indivisible sizes.
#include "examples/gpt/tp_model.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "comm/communicator.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "examples/gpt/model.h"
#include "model_parallel/layers.h"
#include "testing/c10_error.h"
#include "testing/near.h"

namespace fairscale::examples::gpt {
namespace {

using comm::Communicator;
using comm::testing::Check;
using comm::testing::ExpectAllOk;
using comm::testing::RunInprocRanks;
using fairscale::testing::CatchErrors;
using fairscale::testing::ExpectError;
using fairscale::testing::Near;
using fairscale::testing::Shape;
using model_parallel::TensorDict;

constexpr double kTol = 1e-5;
constexpr int kAdamSteps = 5;

GptConfig SmallConfig() { return GptConfig().vocab(64).seq(16).width(32).heads(4).blocks(2); }

at::Tensor Tokens(at::IntArrayRef shape, int64_t vocab, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(0, vocab, shape, gen, at::TensorOptions().dtype(at::kLong));
}



absl::Status NearDicts(const TensorDict& got, const TensorDict& want, double tol,
                       const std::string& what) {
  FS_RETURN_IF_ERROR(Check(got.size() == want.size(),
                           absl::StrCat(what, ": ", got.size(), " keys, want ", want.size())));
  for (const auto& item : want) {
    const at::Tensor* g = got.find(item.key());
    FS_RETURN_IF_ERROR(Check(g != nullptr, absl::StrCat(what, ": no '", item.key(), "'")));
    FS_RETURN_IF_ERROR(Near(*g, item.value(), tol, absl::StrCat(what, " '", item.key(), "'")));
  }
  return absl::OkStatus();
}

// The key bias (the middle third of each qkv.bias) does not change the attention (softmax is
// invariant to adding q . b_k to a whole row), so its true gradient is 0 and what autograd gives
// is round-off (checked to be below 1e-6 in MaxKeyBiasGrad); Adam divides a gradient by its own
// magnitude, so it turns that round-off into steps of about lr whose sign depends on the
// summation order. After Adam, compare everything but that third at 1e-5.
absl::Status NearAfterAdam(const TensorDict& got, const TensorDict& want, const std::string& what) {
  TensorDict got_cut, want_cut;
  for (const auto& item : want) {
    const at::Tensor* g = got.find(item.key());
    if (g == nullptr) return absl::InternalError(absl::StrCat(what, ": no '", item.key(), "'"));
    if (absl::EndsWith(item.key(), ".qkv.bias")) {
      const int64_t c = item.value().size(0) / 3;
      got_cut.insert(item.key() + "[q]", g->narrow(0, 0, c));
      got_cut.insert(item.key() + "[v]", g->narrow(0, 2 * c, c));
      want_cut.insert(item.key() + "[q]", item.value().narrow(0, 0, c));
      want_cut.insert(item.key() + "[v]", item.value().narrow(0, 2 * c, c));
    } else {
      got_cut.insert(item.key(), *g);
      want_cut.insert(item.key(), item.value());
    }
  }
  return NearDicts(got_cut, want_cut, kTol, what);
}

double MaxKeyBiasGrad(const TensorDict& grads) {
  double m = 0;
  for (const auto& item : grads) {
    if (!absl::EndsWith(item.key(), ".qkv.bias")) continue;
    const int64_t c = item.value().size(0) / 3;
    m = std::max(m, item.value().narrow(0, c, c).abs().max().item<double>());
  }
  return m;
}

// Rank r's part of the dense tensor `full` named `key`, written out independently of
// tp_model.cc: rows (vocab / output shards), columns (row-parallel inputs), the strided
// [Q_r; K_r; V_r] rows for the fused QKV, everything else whole.
at::Tensor RankSlice(const std::string& key, const at::Tensor& full, int r, int t) {
  auto rows = [&](const at::Tensor& x, int64_t start, int64_t n) { return x.narrow(0, start, n); };
  if (absl::EndsWith(key, ".qkv.weight") || absl::EndsWith(key, ".qkv.bias")) {
    const int64_t c = full.size(0) / 3, k = c / t;
    return at::cat({rows(full, r * k, k), rows(full, c + r * k, k), rows(full, 2 * c + r * k, k)});
  }
  if (key == "embed.tok.weight" || absl::StartsWith(key, "lm_head.head.") ||
      absl::EndsWith(key, ".fc1.weight") || absl::EndsWith(key, ".fc1.bias")) {
    const int64_t k = full.size(0) / t;
    return rows(full, r * k, k);
  }
  if (absl::EndsWith(key, ".proj.weight") || absl::EndsWith(key, ".fc2.weight")) {
    const int64_t k = full.size(1) / t;
    return full.narrow(1, r * k, k);
  }
  return full;
}

TensorDict Params(torch::nn::Module& m) {
  TensorDict out;
  for (const auto& p : m.named_parameters()) out.insert(p.key(), p.value().detach().clone());
  return out;
}

TensorDict Grads(torch::nn::Module& m) {
  TensorDict out;
  for (const auto& p : m.named_parameters()) out.insert(p.key(), p.value().grad().clone());
  return out;
}

// lr 1e-2; eps 1e-6 instead of 1e-8: Adam divides a gradient by its own magnitude, so for an
// element whose gradient is near 0 (< 1e-6 or so) a round-off difference between the dense and
// the tensor-parallel sums (another summation order) becomes a visible step difference; with
// eps 1e-8, 5 steps differed by up to 2.4e-5 in fc1.weight at T = 2.
torch::optim::AdamOptions AdamOpts() { return torch::optim::AdamOptions(1e-2).eps(1e-6); }

// A dense Gpt initialized from torch's global RNG seeded with `seed`. Main thread only: the rank
// threads share that RNG.
Gpt SeededGpt(const GptConfig& config, uint64_t seed) {
  torch::manual_seed(seed);
  return Gpt(config);
}

// Each parameter of `model` (its gradient if `grads`) against rank's slice (RankSlice) of the
// dense tensor of the same name in `full`.
absl::Status NearSlices(torch::nn::Module& model, const TensorDict& full, bool grads, int rank,
                        int world, double tol, const std::string& what) {
  for (const auto& p : model.named_parameters()) {
    const at::Tensor* f = full.find(p.key());
    FS_RETURN_IF_ERROR(Check(f != nullptr, what + ": no dense " + p.key()));
    // TpGptImpl::is_split() names exactly the parameters that are slices (at T = 1 a slice is
    // the whole tensor, so there is nothing to tell apart).
    FS_RETURN_IF_ERROR(Check(world == 1 || TpGptImpl::is_split("prefix." + p.key()) !=
                                               p.value().sizes().equals(f->sizes()),
                             what + ": is_split(" + p.key() + ")"));
    FS_RETURN_IF_ERROR(Near(grads ? p.value().grad() : p.value(),
                            RankSlice(p.key(), *f, rank, world), tol, what + " " + p.key()));
  }
  return absl::OkStatus();
}

at::Tensor DenseLoss(Gpt& model, const at::Tensor& tokens, const at::Tensor& targets) {
  at::Tensor logits = model(tokens);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                              targets.reshape({-1}));
}

// Everything the ranks compare against, computed once in the main thread.
struct DenseReference {
  TensorDict initial, grads, final_params;
  at::Tensor tokens, targets, logits, loss;
  std::vector<double> adam_losses;
};

DenseReference MakeReference(const GptConfig& config) {
  DenseReference ref;
  Gpt model = SeededGpt(config, 0);
  ref.initial = Params(*model);
  ref.tokens = Tokens({2, 12}, config.vocab(), 11);
  ref.targets = Tokens({2, 12}, config.vocab(), 12);
  ref.logits = model(ref.tokens).detach();
  ref.loss = DenseLoss(model, ref.tokens, ref.targets);
  ref.loss.backward();
  ref.grads = Grads(*model);
  torch::optim::Adam adam(model->parameters(), AdamOpts());
  for (int s = 0; s < kAdamSteps; ++s) {
    adam.zero_grad();
    at::Tensor loss = DenseLoss(model, ref.tokens, ref.targets);
    loss.backward();
    adam.step();
    ref.adam_losses.push_back(loss.item<double>());
  }
  ref.final_params = Params(*model);
  return ref;
}

TEST(TpGpt, EqualsDenseGpt) {
  const GptConfig config = SmallConfig();
  const DenseReference ref = MakeReference(config);
  EXPECT_LT(MaxKeyBiasGrad(ref.grads), 1e-6);  // see NearAfterAdam
  for (int t : {1, 2, 4}) {
    ExpectAllOk(
        RunInprocRanks(
            t,
            [&](int rank, int world, std::shared_ptr<Communicator> comm) {
              return CatchErrors([&]() -> absl::Status {
                const std::string at = absl::StrCat("T=", world, " rank ", rank, ": ");
                TpGpt model(config, comm, /*init_seed=*/3);
                model->load_dense_state_dict(ref.initial);
                // Names are the dense model's; each shard is its slice.
                FS_RETURN_IF_ERROR(Check(model->named_parameters().size() == ref.initial.size(),
                                         at + "parameter count"));
                FS_RETURN_IF_ERROR(NearSlices(*model, ref.initial, /*grads=*/false, rank, world, 0,
                                              at + "loaded"));
                FS_RETURN_IF_ERROR(Near(model(ref.tokens), ref.logits, kTol, at + "logits"));
                at::Tensor loss = model->loss(ref.tokens, ref.targets);
                FS_RETURN_IF_ERROR(Near(loss, ref.loss, kTol, at + "loss"));
                loss.backward();
                FS_RETURN_IF_ERROR(
                    NearSlices(*model, ref.grads, /*grads=*/true, rank, world, kTol, at + "grad"));
                torch::optim::Adam adam(model->parameters(), AdamOpts());
                for (int s = 0; s < kAdamSteps; ++s) {
                  adam.zero_grad();
                  at::Tensor l = model->loss(ref.tokens, ref.targets);
                  l.backward();
                  adam.step();
                  FS_RETURN_IF_ERROR(Near(l, torch::tensor(ref.adam_losses[s]), kTol,
                                          at + absl::StrCat("adam loss ", s)));
                }
                return NearAfterAdam(model->full_state_dict(), ref.final_params, at + "after Adam");
              });
            }),
        absl::StrCat("T=", t));
  }
}

TEST(TpGpt, FullStateDictRoundTrip) {
  const GptConfig config = SmallConfig();
  const at::Tensor tokens = Tokens({2, 10}, config.vocab(), 21);
  std::mutex mu;
  std::map<int, std::map<int, TensorDict>> exported;  // [T][rank]
  std::map<int, at::Tensor> logits;                   // [T], rank 0's
  for (int t : {1, 2}) {
    ExpectAllOk(RunInprocRanks(t,
                               [&](int rank, int, std::shared_ptr<Communicator> comm) {
                                 return CatchErrors([&]() -> absl::Status {
                                   TpGpt model(config, comm, /*init_seed=*/5);
                                   TensorDict full = model->full_state_dict();
                                   at::Tensor l = model(tokens).detach();
                                   std::lock_guard<std::mutex> lock(mu);
                                   exported[t][rank] = full;
                                   if (rank == 0) logits[t] = l;
                                   return absl::OkStatus();
                                 });
                               }),
                absl::StrCat("export T=", t));
  }
  ASSERT_EQ(exported[2].size(), 2u);
  // Every rank exports the same dense dict, and the seeded initialization does not depend on T.
  ExpectAllOk({NearDicts(exported[2][1], exported[2][0], 0, "rank 1 vs rank 0"),
               NearDicts(exported[2][0], exported[1][0], 0, "T=2 vs T=1")});
  // The T=2 export loads into the dense Gpt (its own keys and shapes): the same logits.
  Gpt dense = SeededGpt(config, 1);
  {
    torch::NoGradGuard no_grad;
    ExpectAllOk({NearDicts(exported[2][0], Params(*dense), 1e9, "keys and shapes")});
    for (auto& p : dense->named_parameters()) p.value().copy_(exported[2][0][p.key()]);
  }
  ExpectAllOk({Near(dense(tokens), logits[2], kTol, "dense logits vs TP logits")});
}

TEST(TpGpt, QkvLayoutMapping) {
  // C = 4, T = 2: dense rows Q0 Q1 Q2 Q3 K0 .. V3 (0..11); rank 0 owns Q0 Q1 K0 K1 V0 V1.
  const at::Tensor dense = at::arange(12, at::kFloat).view({12, 1}).repeat({1, 3});
  const at::Tensor major = qkv_to_rank_major(dense, 2);
  const at::Tensor want = torch::tensor({0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11}, at::kFloat)
                              .view({12, 1})
                              .repeat({1, 3});
  EXPECT_TRUE(major.equal(want)) << major;
  EXPECT_TRUE(qkv_to_dense(major, 2).equal(dense));
  const at::Tensor bias = at::arange(24, at::kFloat);
  for (int64_t t : {1, 2, 4, 8})
    EXPECT_TRUE(qkv_to_dense(qkv_to_rank_major(bias, t), t).equal(bias));
  EXPECT_TRUE(qkv_to_rank_major(bias, 1).equal(bias));
}

TEST(TpGpt, BadSizesAreClearErrors) {
  ExpectAllOk(
      RunInprocRanks(
          2,
          [&](int, int, std::shared_ptr<Communicator> comm) -> absl::Status {
            FS_RETURN_IF_ERROR(ExpectError([&] { TpGpt(SmallConfig().width(24).heads(3), comm); },
                                           {"TpGpt", "heads = 3", "tensor-parallel size 2"}));
            FS_RETURN_IF_ERROR(ExpectError([&] { TpGpt(SmallConfig().vocab(65), comm); },
                                           {"TpGpt", "vocab = 65", "tensor-parallel size 2"}));
            FS_RETURN_IF_ERROR(
                ExpectError([&] { TpGpt(SmallConfig().checkpoint_every_k(1), comm); },
                            {"checkpoint_every_k = 1"}));
            // A dense dict with a key missing, or from another config.
            TpGpt model(SmallConfig(), comm);
            TensorDict dense = model->full_state_dict();
            TensorDict missing;
            for (const auto& item : dense) {
              if (item.key() != "lm_head.ln_f.weight") missing.insert(item.key(), item.value());
            }
            FS_RETURN_IF_ERROR(ExpectError([&] { model->load_dense_state_dict(missing); },
                                           {"lm_head.ln_f.weight"}));
            TensorDict wider = TpGpt(SmallConfig().width(64), comm)->full_state_dict();
            FS_RETURN_IF_ERROR(
                ExpectError([&] { model->load_dense_state_dict(wider); }, {"shape"}));
            return ExpectError([&] { TpGpt(SmallConfig(), nullptr); }, {"communicator is null"});
          }),
      "bad sizes");
}

}  // namespace
}  // namespace fairscale::examples::gpt
