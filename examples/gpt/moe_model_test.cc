// The Gpt with mixture-of-experts blocks (GptConfig::moe_experts) at expert-parallel world sizes
// 1, 2, 4 (ranks as threads over inproc) against a single-process reference: the same model at
// world size 1 (all E experts local) run on each rank's tokens separately. Rank r's logits and
// aux loss equal the reference's on its tokens, its gate and dense gradients equal the reference's
// for its own loss, and each local expert's gradient is the sum over the ranks' reference
// gradients of that expert (the all-to-all brings every rank's tokens to it), all within 1e-5
// (f32). The routing is the same because each rank's gate sees its own tokens (capacity from its
// own token count) and draws its second-expert noise from the model's generator, seeded per rank
// here. Also: the experts do not depend on the world size, parameter names, bad sizes.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/randint.h>
#include <torch/nn/functional/loss.h>
#include <torch/utils.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "comm/communicator.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "examples/gpt/model.h"
#include "gtest/gtest.h"

namespace fairscale::examples::gpt {
namespace {

using comm::Communicator;
using comm::testing::Check;
using comm::testing::ExpectAllOk;
using comm::testing::RunInprocRanks;

constexpr int64_t kExperts = 4;
constexpr double kAuxCoef = 0.01;
constexpr double kTol = 1e-5;

GptConfig MoeConfig() {
  return GptConfig().vocab(32).seq(8).width(16).heads(2).blocks(2).moe_experts(kExperts);
}

at::Tensor Tokens(int rank) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1000 + rank);
  return at::randint(0, 32, {3, 8}, gen, at::TensorOptions().dtype(at::kLong));
}

// Rank threads share torch's global generator: build each model under one lock, seeded alike.
Gpt BuildModel(const std::shared_ptr<Communicator>& comm) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  torch::manual_seed(0);
  return Gpt(MoeConfig(), comm);
}

struct Result {
  at::Tensor logits, aux;
  std::map<std::string, at::Tensor> grads;  // by the world-1 name
};

// One forward and backward of CE(logits, tokens) + kAuxCoef * aux (the targets do not matter).
Result RunStep(Gpt& model, const at::Tensor& tokens, uint64_t noise_seed) {
  model->seed_moe_noise(noise_seed);
  Result r;
  r.logits = model(tokens);
  r.aux = model->aux_loss();
  at::Tensor loss = torch::nn::functional::cross_entropy(r.logits.reshape({-1, 32}),
                                                         tokens.reshape({-1})) +
                    kAuxCoef * r.aux;
  loss.backward();
  for (const auto& p : model->named_parameters()) r.grads[p.key()] = p.value().grad().clone();
  return r;
}

// "block1.moe.experts.<l>." on rank r of n -> the world-1 name of expert r * L + l.
std::string GlobalName(const std::string& name, int rank, int world) {
  const std::string marker = ".moe.experts.";
  const size_t at = name.find(marker);
  if (at == std::string::npos) return name;
  const size_t start = at + marker.size(), dot = name.find('.', start);
  const int64_t local = std::stoll(name.substr(start, dot - start));
  return absl::StrCat(name.substr(0, start), rank * (kExperts / world) + local, name.substr(dot));
}

absl::Status Near(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  if (!got.defined() || !want.defined() || got.sizes() != want.sizes()) {
    return absl::InternalError(absl::StrCat(what, ": missing or mis-shaped"));
  }
  const double diff = (got - want).abs().max().item<double>();
  return Check(diff <= kTol, absl::StrCat(what, ": max |got - want| = ", diff));
}

TEST(MoeGpt, ExpertParallelEqualsSingleProcess) {
  // The reference: world size 1, every rank's tokens in turn.
  std::vector<Result> ref(4);
  ExpectAllOk(RunInprocRanks(1, [&](int, int, std::shared_ptr<Communicator> comm) {
    Gpt model = BuildModel(comm);
    for (int r = 0; r < 4; ++r) {
      model->zero_grad();
      ref[r] = RunStep(model, Tokens(r), 100 + r);
    }
    return absl::OkStatus();
  }), "reference");
  ASSERT_TRUE(ref[0].aux.defined());
  // The ranks' batches differ, so the experts' summed gradients are not a multiple of one.
  ASSERT_GT((ref[0].logits - ref[1].logits).abs().max().item<double>(), 1e-3);
  for (int world : {1, 2, 4}) {
    ExpectAllOk(
        RunInprocRanks(world,
                       [&](int rank, int n, std::shared_ptr<Communicator> comm) -> absl::Status {
                         Gpt model = BuildModel(comm);
                         const std::string at = absl::StrCat("world ", n, " rank ", rank, ": ");
                         EXPECT_EQ(model->moe_layers().size(), 1u);
                         const Result got = RunStep(model, Tokens(rank), 100 + rank);
                         absl::Status st = Near(got.logits, ref[rank].logits, at + "logits");
                         if (st.ok()) st = Near(got.aux, ref[rank].aux, at + "aux loss");
                         for (const auto& [name, g] : got.grads) {
                           if (!st.ok()) break;
                           const std::string global = GlobalName(name, rank, n);
                           at::Tensor want;
                           if (name.find(".moe.experts.") == std::string::npos) {
                             want = ref[rank].grads.at(name);
                           } else {
                             for (int q = 0; q < n; ++q) {
                               const at::Tensor& gq = ref[q].grads.at(global);
                               want = want.defined() ? want + gq : gq;
                             }
                           }
                           st = Near(g, want, at + "grad " + name + " (" + global + ")");
                         }
                         return st;
                       }),
        absl::StrCat("world ", world));
  }
}

TEST(MoeGpt, NamesAndPlacement) {
  ExpectAllOk(RunInprocRanks(2, [&](int rank, int, std::shared_ptr<Communicator> comm) {
    Gpt model = BuildModel(comm);
    std::vector<std::string> experts;
    for (const auto& p : model->named_parameters()) {
      if (p.key().find(".experts.") != std::string::npos) experts.push_back(p.key());
    }
    // Block 1 is MoE (2 local experts x fc1/fc2 weight/bias); block 0 keeps its dense MLP.
    EXPECT_EQ(experts.size(), 8u) << rank;
    EXPECT_NE(model->named_parameters().find("block1.moe.gate.wg.weight"), nullptr);
    EXPECT_NE(model->named_parameters().find("block0.fc1.weight"), nullptr);
    EXPECT_EQ(model->named_parameters().find("block1.fc1.weight"), nullptr);
    EXPECT_EQ(MakeGptExperts(MoeConfig(), *comm).modules().size(), 2u);
    return absl::OkStatus();
  }), "names");
}

TEST(MoeGpt, BadSizesAreClearErrors) {
  ExpectAllOk(RunInprocRanks(3, [&](int, int, std::shared_ptr<Communicator> comm) {
    try {
      BuildModel(comm);
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      return Check(msg.find("moe_experts = 4 is not divisible by the expert-parallel size 3") !=
                       std::string::npos,
                   msg);
    }
    return absl::InternalError("no error for 4 experts over 3 ranks");
  }), "indivisible");
  EXPECT_THROW(Gpt{MoeConfig()}, c10::Error);  // no expert communicator
}

}  // namespace
}  // namespace fairscale::examples::gpt
