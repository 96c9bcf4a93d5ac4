// MOELayer with Top1Gate / Top2Gate at expert-parallel world sizes 1, 2, 4 (ranks as threads over
// the inproc backend) against a single-process reference written here with plain loops over the
// tokens (no einsum, no all-to-all): each rank's tokens are routed to the same experts and slots,
// the same tokens are dropped, and the output, l_aux and the gradients of the input, the gate
// weight and the expert weights agree within 1e-5 (module f32, reference f64); over-capacity
// tokens give exactly zero rows and gradients; 5 Adam steps equal the reference's; Gumbel noise
// from the caller's generator; bad configurations and inputs raise clear errors.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "comm/communicator.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "comm/torch/tensor_buffer.h"
#include "moe/gate.h"
#include "moe/moe_layer.h"
#include "testing/c10_error.h"
#include "testing/near.h"

namespace fairscale::moe {
namespace {

using comm::Communicator;
using comm::testing::Check;
using comm::testing::ExpectAllOk;
using comm::testing::RunInprocRanks;
using fairscale::testing::Near;

constexpr int64_t kModelDim = 6;
constexpr int64_t kLocalExperts = 2;
constexpr int64_t kTokens = 12;  // per rank, as x [2, 6, kModelDim]
constexpr double kTol = 1e-5;

enum class Kind { kTop1, kTop2 };

at::Tensor Randn(at::IntArrayRef shape, uint64_t seed, double scale = 1.0) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kDouble)) * scale;
}

// Every weight of the model, f64, from fixed seeds: W [E, M], expert e = tanh(A[e] x + b[e]).
struct Weights {
  at::Tensor w, a, b;
};

Weights MakeWeights(int64_t e, uint64_t seed) {
  return {Randn({e, kModelDim}, seed), Randn({e, kModelDim, kModelDim}, seed + 1, 0.5),
          Randn({e, kModelDim}, seed + 2, 0.5)};
}

at::Tensor Input(int rank, uint64_t seed) {
  return Randn({2, kTokens / 2, kModelDim}, seed + 100 + rank);
}
at::Tensor LossWeights(int rank, uint64_t seed) {
  return Randn({2, kTokens / 2, kModelDim}, seed + 200 + rank);
}



// ---- The reference: one process, every rank's tokens, plain loops ----

struct Reference {
  std::vector<at::Tensor> out;       // per rank, x's shape
  std::vector<at::Tensor> l_aux;     // per rank
  std::vector<at::Tensor> combine;   // per rank [S, E, C], the gate's combine_weights
  std::vector<std::vector<bool>> dropped;  // per rank, per token: every choice dropped
  std::vector<at::Tensor> dx, dw;    // per rank (each rank's own gate copy)
  at::Tensor da, db;                 // [E, M, M], [E, M]: every rank's tokens
};

int64_t Argmax(const at::Tensor& row) {  // row: f64 [E], no autograd
  int64_t best = 0;
  for (int64_t e = 1; e < row.size(0); ++e) {
    if (row[e].item<double>() > row[best].item<double>()) best = e;
  }
  return best;
}

// noise: per rank [S, E] Gumbel noise added to the logits for the second choice (or undefined).
Reference RunReference(Kind kind, int world, double capacity_factor, const Weights& weights,
                       uint64_t seed, double l_aux_coef,
                       const std::vector<at::Tensor>& noise = {}) {
  const int64_t num_experts = weights.w.size(0);
  const int64_t s_count = kTokens;
  const double slots = (kind == Kind::kTop2 ? 2.0 : 1.0) * static_cast<double>(s_count) /
                       static_cast<double>(num_experts);
  const int64_t capacity =
      std::max<int64_t>(1, static_cast<int64_t>(std::ceil(slots * capacity_factor)));
  Reference ref;
  at::Tensor a = weights.a.clone().requires_grad_(true);
  at::Tensor b = weights.b.clone().requires_grad_(true);
  std::vector<at::Tensor> xs, ws;
  at::Tensor loss = at::zeros({}, at::kDouble);
  for (int r = 0; r < world; ++r) {
    at::Tensor x = Input(r, seed).requires_grad_(true);
    at::Tensor w = weights.w.clone().requires_grad_(true);
    xs.push_back(x);
    ws.push_back(w);
    const at::Tensor tokens = x.reshape({s_count, kModelDim});
    std::vector<at::Tensor> gates(s_count);
    std::vector<int64_t> first(s_count), second(s_count, -1);
    for (int64_t s = 0; s < s_count; ++s) {
      const at::Tensor logits = at::mv(w, tokens[s]);
      const at::Tensor shifted = (logits - logits.max().detach()).exp();
      gates[s] = shifted / shifted.sum();
      first[s] = Argmax(gates[s].detach());
      if (kind == Kind::kTop2) {
        at::Tensor l2 = logits.detach().clone();
        if (!noise.empty()) l2 += noise[r][s];
        l2[first[s]] = -std::numeric_limits<double>::infinity();
        second[s] = Argmax(l2);
      }
    }
    std::vector<int64_t> total_first(num_experts, 0), count1(num_experts, 0),
        count2(num_experts, 0);
    for (int64_t s = 0; s < s_count; ++s) ++total_first[first[s]];
    at::Tensor combine = at::zeros({s_count, num_experts, capacity}, at::kDouble);
    std::vector<at::Tensor> out_rows(s_count);
    std::vector<bool> dropped(s_count);
    for (int64_t s = 0; s < s_count; ++s) {
      const int64_t loc1 = count1[first[s]]++;
      const bool keep1 = loc1 < capacity;
      int64_t loc2 = 0;
      bool keep2 = false;
      if (kind == Kind::kTop2) {
        loc2 = total_first[second[s]] + count2[second[s]]++;
        keep2 = loc2 < capacity;
      }
      at::Tensor g1 = keep1 ? gates[s][first[s]] : at::zeros({}, at::kDouble);
      at::Tensor g2 = keep2 ? gates[s][second[s]] : at::zeros({}, at::kDouble);
      if (kind == Kind::kTop2) {
        // FairScale: denominator clamped at the gates' eps (f32 in the module).
        const at::Tensor denom = (g1 + g2).clamp_min(std::numeric_limits<float>::epsilon());
        g1 = g1 / denom;
        g2 = g2 / denom;
      }
      dropped[s] = !keep1 && !keep2;
      at::Tensor row = at::zeros({kModelDim}, at::kDouble);
      if (keep1) {
        combine[s][first[s]][loc1] = g1.item<double>();
        row = row + g1 * at::tanh(at::mv(a[first[s]], tokens[s]) + b[first[s]]);
      }
      if (keep2) {
        combine[s][second[s]][loc2] = g2.item<double>();
        row = row + g2 * at::tanh(at::mv(a[second[s]], tokens[s]) + b[second[s]]);
      }
      out_rows[s] = row;
    }
    // l_aux = mean_e(me_e * ce_e) * E^2.
    at::Tensor l_aux = at::zeros({}, at::kDouble);
    for (int64_t e = 0; e < num_experts; ++e) {
      at::Tensor me = at::zeros({}, at::kDouble);
      for (int64_t s = 0; s < s_count; ++s) me = me + gates[s][e];
      me = me / static_cast<double>(s_count);
      const double ce = static_cast<double>(total_first[e]) / static_cast<double>(s_count);
      l_aux = l_aux + me * ce;
    }
    l_aux = l_aux * static_cast<double>(num_experts);
    const at::Tensor out = at::stack(out_rows).reshape(x.sizes());
    loss = loss + (LossWeights(r, seed) * out).sum() + l_aux_coef * l_aux;
    ref.out.push_back(out.detach());
    ref.l_aux.push_back(l_aux.detach());
    ref.combine.push_back(combine);
    ref.dropped.push_back(dropped);
  }
  loss.backward();
  for (int r = 0; r < world; ++r) {
    ref.dx.push_back(xs[r].grad());
    ref.dw.push_back(ws[r].grad());
  }
  ref.da = a.grad();
  ref.db = b.grad();
  return ref;
}

// ---- The module under test on one rank ----

// Expert e: tanh(linear(x)) (nn::Sequential cannot be stored in an AnyModule).
class TanhExpertImpl : public torch::nn::Module {
 public:
  explicit TanhExpertImpl(torch::nn::Linear linear_) : linear(register_module("linear", linear_)) {}
  at::Tensor forward(const at::Tensor& x) { return at::tanh(linear->forward(x)); }
  torch::nn::Linear linear;
};
TORCH_MODULE(TanhExpert);

struct RankModel {
  std::shared_ptr<GateImpl> gate;
  std::vector<torch::nn::Linear> linears;  // this rank's experts' Linear
  MOELayer layer{nullptr};
};

RankModel MakeModel(Kind kind, double capacity_factor, const Weights& weights, int rank,
                    std::shared_ptr<Communicator> comm, bool noise = false,
                    std::optional<at::Generator> gen = std::nullopt) {
  const int64_t num_experts = weights.w.size(0);
  RankModel model;
  if (kind == Kind::kTop2) {
    model.gate = Top2Gate(Top2GateOptions(kModelDim, num_experts)
                              .capacity_factor(capacity_factor)
                              .second_expert_noise(noise)
                              .generator(gen))
                     .ptr();
  } else {
    model.gate =
        Top1Gate(Top1GateOptions(kModelDim, num_experts).capacity_factor(capacity_factor)).ptr();
  }
  torch::NoGradGuard no_grad;
  model.gate->named_parameters()["wg.weight"].copy_(weights.w);
  std::vector<torch::nn::AnyModule> experts;
  for (int64_t l = 0; l < kLocalExperts; ++l) {
    const int64_t e = rank * kLocalExperts + l;
    torch::nn::Linear linear(kModelDim, kModelDim);
    linear->weight.copy_(weights.a[e]);
    linear->bias.copy_(weights.b[e]);
    model.linears.push_back(linear);
    experts.emplace_back(TanhExpert(linear));
  }
  model.layer = MOELayer(model.gate, std::move(experts), std::move(comm));
  return model;
}

// One forward/backward on every rank against the reference: routing, output, l_aux, gradients.
enum class Noise { kOff, kOn, kOnButEval };

uint64_t NoiseSeed(int rank) { return 5000 + rank; }

// The Gumbel noise the gate draws, per the header: u = rand({S, E}) in f32 from the generator,
// clamped to [eps, 1 - eps], noise = -log(-log(u)).
at::Tensor GumbelNoise(int rank, int64_t num_experts) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(NoiseSeed(rank));
  const double eps = std::numeric_limits<float>::epsilon();
  const at::Tensor u = at::rand({kTokens, num_experts}, gen, at::TensorOptions().dtype(at::kFloat))
                           .clamp(eps, 1.0 - eps);
  return (-(-u.log()).log()).to(at::kDouble);
}

void CheckParity(Kind kind, int world, double capacity_factor, double l_aux_coef,
                 std::optional<bool> expect_drops, Noise noise = Noise::kOff) {
  SCOPED_TRACE(absl::StrCat(kind == Kind::kTop2 ? "Top2" : "Top1", " world ", world,
                            " capacity_factor ", capacity_factor));
  const uint64_t seed = 1000 + world;
  const Weights weights = MakeWeights(world * kLocalExperts, seed);
  std::vector<at::Tensor> noises;
  if (noise == Noise::kOn) {
    for (int r = 0; r < world; ++r) noises.push_back(GumbelNoise(r, world * kLocalExperts));
  }
  const Reference ref =
      RunReference(kind, world, capacity_factor, weights, seed, l_aux_coef, noises);
  if (noise == Noise::kOn) {
    // The noise must change some second choice, or this would test nothing.
    const Reference quiet = RunReference(kind, world, capacity_factor, weights, seed, l_aux_coef);
    bool differs = false;
    for (int r = 0; r < world; ++r) differs |= !quiet.combine[r].equal(ref.combine[r]);
    EXPECT_TRUE(differs) << "the noise changed no second choice";
  }
  int64_t dropped_total = 0;
  for (const auto& d : ref.dropped) {
    for (bool b : d) dropped_total += b;
  }
  if (expect_drops == true) {
    EXPECT_GT(dropped_total, 0) << "the configuration must overflow";
  }
  if (expect_drops == false) {
    EXPECT_EQ(dropped_total, 0);
  }
  ExpectAllOk(
      RunInprocRanks(world,
                     [&](int rank, int n, std::shared_ptr<Communicator> comm) -> absl::Status {
                       RankModel model = MakeModel(
                           kind, capacity_factor, weights, rank, comm, noise != Noise::kOff,
                           at::make_generator<at::CPUGeneratorImpl>(NoiseSeed(rank)));
                       if (noise == Noise::kOnButEval) model.layer->eval();
                       const at::Tensor x = Input(rank, seed).to(at::kFloat).requires_grad_(true);
                       // The gate alone: which expert, which slot, which token dropped.
                       {
                         torch::NoGradGuard no_grad;
                         // The gate alone draws the noise the layer's gate would draw: reseed.
                         if (noise == Noise::kOn) {
                           static_cast<Top2GateImpl&>(*model.gate).options.generator(
                               at::make_generator<at::CPUGeneratorImpl>(NoiseSeed(rank)));
                         }
                         GateOutput g = model.gate->forward(x.reshape({-1, kModelDim}));
                         if (noise == Noise::kOn) {
                           static_cast<Top2GateImpl&>(*model.gate).options.generator(
                               at::make_generator<at::CPUGeneratorImpl>(NoiseSeed(rank)));
                         }
                         FS_RETURN_IF_ERROR(
                             Near(g.combine_weights, ref.combine[rank], kTol, "combine_weights"));
                         FS_RETURN_IF_ERROR(Check(
                             g.dispatch_mask.equal(ref.combine[rank].ne(0)), "dispatch_mask"));
                         FS_RETURN_IF_ERROR(Near(g.l_aux, ref.l_aux[rank], kTol, "gate l_aux"));
                       }
                       const at::Tensor out = model.layer->forward(x);
                       FS_RETURN_IF_ERROR(Near(out, ref.out[rank], kTol, "output"));
                       FS_RETURN_IF_ERROR(
                           Near(model.layer->l_aux(), ref.l_aux[rank], kTol, "l_aux"));
                       const at::Tensor loss =
                           (LossWeights(rank, seed).to(at::kFloat) * out).sum() +
                           l_aux_coef * model.layer->l_aux();
                       loss.backward();
                       FS_RETURN_IF_ERROR(Near(x.grad(), ref.dx[rank], kTol, "dx"));
                       FS_RETURN_IF_ERROR(Near(model.gate->named_parameters()["wg.weight"].grad(),
                                               ref.dw[rank], kTol, "d gate weight"));
                       for (int64_t l = 0; l < kLocalExperts; ++l) {
                         const int64_t e = rank * kLocalExperts + l;
                         FS_RETURN_IF_ERROR(Near(model.linears[l]->weight.grad(), ref.da[e], kTol,
                                                 absl::StrCat("d expert ", e, " weight")));
                         FS_RETURN_IF_ERROR(Near(model.linears[l]->bias.grad(), ref.db[e], kTol,
                                                 absl::StrCat("d expert ", e, " bias")));
                       }
                       // Dropped tokens: exactly zero output rows; without l_aux in the loss,
                       // exactly zero input gradient rows.
                       const at::Tensor out_rows = out.reshape({-1, kModelDim});
                       const at::Tensor dx_rows = x.grad().reshape({-1, kModelDim});
                       for (int64_t s = 0; s < kTokens; ++s) {
                         if (!ref.dropped[rank][s]) continue;
                         FS_RETURN_IF_ERROR(Check(out_rows[s].eq(0).all().item<bool>(),
                                                  absl::StrCat("dropped token ", s, " output")));
                         if (l_aux_coef == 0) {
                           FS_RETURN_IF_ERROR(Check(dx_rows[s].eq(0).all().item<bool>(),
                                                    absl::StrCat("dropped token ", s, " dx")));
                         }
                       }
                       return absl::OkStatus();
                     }),
      "parity");
}

// Capacity factor 1 (FairScale's capacity; these data drop a few tokens) and one large enough
// that nothing can be dropped (Top2: C >= S at factor E / 2; Top1: at factor E).
TEST(MoeTest, Top2MatchesReference) {
  for (int world : {1, 2, 4}) {
    CheckParity(Kind::kTop2, world, 1.0, 0.1, std::nullopt);
    CheckParity(Kind::kTop2, world, world * kLocalExperts / 2.0, 0.1, false);
  }
}

TEST(MoeTest, Top1MatchesReference) {
  for (int world : {1, 2, 4}) {
    CheckParity(Kind::kTop1, world, 1.0, 0.1, std::nullopt);
    CheckParity(Kind::kTop1, world, world * kLocalExperts, 0.1, false);
  }
}

TEST(MoeTest, Top2CapacityOverflowDropsTokens) {
  for (int world : {1, 2, 4}) {
    CheckParity(Kind::kTop2, world, 0.3, 0.0, true);
    CheckParity(Kind::kTop2, world, 0.3, 0.1, true);
  }
}

TEST(MoeTest, Top1CapacityOverflowDropsTokens) {
  for (int world : {1, 2, 4}) {
    CheckParity(Kind::kTop1, world, 0.5, 0.0, true);
    CheckParity(Kind::kTop1, world, 0.5, 0.1, true);
  }
}

TEST(MoeTest, Top2SecondChoiceNoiseFromTheCallersGenerator) {
  // At world 1 (E = 2) the second choice is forced; E = 4 and 8 leave the noise a choice.
  for (int world : {2, 4}) CheckParity(Kind::kTop2, world, 1.0, 0.1, std::nullopt, Noise::kOn);
}

TEST(MoeTest, Top2NoNoiseInEvalMode) {
  CheckParity(Kind::kTop2, 2, 1.0, 0.1, std::nullopt, Noise::kOnButEval);
}

// 5 Adam steps (new tokens each step) at worlds 1, 2, 4: the gate's gradient all-reduced (sum)
// over the group, as data parallelism over non_expert_parameters() would; the experts' not.
TEST(MoeTest, FiveAdamStepsMatchReference) {
  constexpr int kSteps = 5;
  constexpr double kLr = 1e-2;
  for (int world : {1, 2, 4}) {
    SCOPED_TRACE(absl::StrCat("world ", world));
    const int64_t num_experts = world * kLocalExperts;
    const Weights initial = MakeWeights(num_experts, 77 + world);
    // Reference: f64 leaves, gradients from RunReference on the current values.
    at::Tensor w = initial.w.clone().requires_grad_(true);
    at::Tensor a = initial.a.clone().requires_grad_(true);
    at::Tensor b = initial.b.clone().requires_grad_(true);
    torch::optim::Adam ref_opt({w, a, b}, torch::optim::AdamOptions(kLr));
    for (int step = 0; step < kSteps; ++step) {
      const Reference ref = RunReference(Kind::kTop2, world, 1.0, {w.detach(), a.detach(), b.detach()},
                                         300 + 10 * step, 0.1);
      at::Tensor dw = ref.dw[0].clone();
      for (int r = 1; r < world; ++r) dw += ref.dw[r];
      w.mutable_grad() = dw;
      a.mutable_grad() = ref.da;
      b.mutable_grad() = ref.db;
      ref_opt.step();
    }
    ExpectAllOk(
        RunInprocRanks(world,
                       [&](int rank, int n, std::shared_ptr<Communicator> comm) -> absl::Status {
                         RankModel model = MakeModel(Kind::kTop2, 1.0, initial, rank, comm);
                         const std::vector<at::Tensor> experts = model.layer->expert_parameters();
                         const std::vector<at::Tensor> others =
                             model.layer->non_expert_parameters();
                         FS_RETURN_IF_ERROR(Check(experts.size() == 2 * kLocalExperts &&
                                                      others.size() == 1,
                                                  "expert / non-expert parameter split"));
                         torch::optim::Adam opt(model.layer->parameters(),
                                                torch::optim::AdamOptions(kLr));
                         for (int step = 0; step < kSteps; ++step) {
                           opt.zero_grad();
                           const uint64_t seed = 300 + 10 * step;
                           const at::Tensor x = Input(rank, seed).to(at::kFloat);
                           const at::Tensor out = model.layer->forward(x);
                           const at::Tensor loss =
                               (LossWeights(rank, seed).to(at::kFloat) * out).sum() +
                               0.1 * model.layer->l_aux();
                           loss.backward();
                           for (const at::Tensor& p : others) {
                             FS_ASSIGN_OR_RETURN(comm::Buffer buf, comm::ToBuffer(p.grad()));
                             FS_RETURN_IF_ERROR(
                                 comm->AllReduce(buf, buf, comm::ReduceOp::kSum).Wait());
                           }
                           opt.step();
                         }
                         FS_RETURN_IF_ERROR(
                             Near(others[0], w.detach(), kTol, "gate weight after 5 steps"));
                         for (int64_t l = 0; l < kLocalExperts; ++l) {
                           const int64_t e = rank * kLocalExperts + l;
                           FS_RETURN_IF_ERROR(Near(model.linears[l]->weight, a.detach()[e], kTol,
                                                   absl::StrCat("expert ", e, " weight")));
                           FS_RETURN_IF_ERROR(Near(model.linears[l]->bias, b.detach()[e], kTol,
                                                   absl::StrCat("expert ", e, " bias")));
                         }
                         return absl::OkStatus();
                       }),
        "adam");
  }
}

TEST(MoeTest, ParameterNames) {
  ExpectAllOk(RunInprocRanks(1, [&](int rank, int n, std::shared_ptr<Communicator> comm)
                                    -> absl::Status {
    RankModel model = MakeModel(Kind::kTop2, 1.0, MakeWeights(kLocalExperts, 5), 0, comm);
    std::vector<std::string> names;
    for (const auto& item : model.layer->named_parameters()) names.push_back(item.key());
    return Check(absl::StrJoin(names, " ") ==
                     "gate.wg.weight experts.0.linear.weight experts.0.linear.bias "
                     "experts.1.linear.weight experts.1.linear.bias",
                 absl::StrJoin(names, " "));
  }), "names");
}

TEST(MoeTest, BadConfigurationsAndInputsAreClearErrors) {
  ExpectAllOk(
      RunInprocRanks(2,
                     [&](int rank, int n, std::shared_ptr<Communicator> comm) -> absl::Status {
                       // 3 experts over 2 ranks x 1 local expert.
                       FS_RETURN_IF_ERROR(testing::ExpectError(
                           [&] {
                             std::vector<torch::nn::AnyModule> experts;
                             experts.emplace_back(torch::nn::Linear(kModelDim, kModelDim));
                             MOELayer(Top2Gate(Top2GateOptions(kModelDim, 3)), std::move(experts),
                                      comm);
                           },
                           {"moe::MOELayer", absl::StrCat("rank ", rank, "/2"), "3 experts",
                            "2 ranks x 1 local experts", "INVALID_ARGUMENT"}));
                       FS_RETURN_IF_ERROR(testing::ExpectError(
                           [&] {
                             MOELayer(Top2Gate(Top2GateOptions(kModelDim, 2)),
                                      std::vector<torch::nn::AnyModule>{}, comm);
                           },
                           {"moe::MOELayer", "no local experts"}));
                       // model_dim mismatch, in the layer and in the gate.
                       RankModel model =
                           MakeModel(Kind::kTop2, 1.0, MakeWeights(2 * kLocalExperts, 9), rank,
                                     comm);
                       FS_RETURN_IF_ERROR(testing::ExpectError(
                           [&] { model.layer->forward(at::zeros({4, kModelDim + 1})); },
                           {"moe::MOELayer::forward", "x [4, 7]", "model_dim 6"}));
                       FS_RETURN_IF_ERROR(testing::ExpectError(
                           [&] { model.gate->forward(at::zeros({4, kModelDim + 1})); },
                           {"moe::Top2Gate::forward", "x [4, 7]", "model_dim 6"}));
                       FS_RETURN_IF_ERROR(testing::ExpectError(
                           [&] { Top2Gate(Top2GateOptions(kModelDim, 1)); },
                           {"moe::Top2Gate", "num_experts 1", "at least 2"}));
                       FS_RETURN_IF_ERROR(testing::ExpectError(
                           [&] { Top1Gate(Top1GateOptions(kModelDim, 4).capacity_factor(0)); },
                           {"moe::Top1Gate", "capacity_factor 0"}));
                       // The layer still works afterwards (the errors sent nothing).
                       const at::Tensor out = model.layer->forward(
                           at::ones({kTokens, kModelDim}));
                       return Check(out.sizes() == at::IntArrayRef({kTokens, kModelDim}),
                                    "forward after errors");
                     }),
      "errors");
}

// Capacity: Top2 ceil(2 S / E * f), Top1 ceil(S / E * f), at least 1 (S = 12 tokens, E = 4).
TEST(MoeTest, CapacityFormula) {
  const at::Tensor x = Randn({kTokens, kModelDim}, 3).to(at::kFloat);
  Top2Gate top2(Top2GateOptions(kModelDim, 4).second_expert_noise(false));
  EXPECT_EQ(top2->forward(x).combine_weights.size(2), 6);
  Top2Gate top2_small(Top2GateOptions(kModelDim, 4).capacity_factor(0.3));
  EXPECT_EQ(top2_small->forward(x).combine_weights.size(2), 2);  // ceil(1.8)
  Top1Gate top1(Top1GateOptions(kModelDim, 4).capacity_factor(1.25));
  EXPECT_EQ(top1->forward(x).combine_weights.size(2), 4);  // ceil(3.75)
  Top1Gate top1_tiny(Top1GateOptions(kModelDim, 4).capacity_factor(0.01));
  EXPECT_EQ(top1_tiny->forward(x).combine_weights.size(2), 1);
}

}  // namespace
}  // namespace fairscale::moe
