// Tests of //checkpoint against the same computation without checkpointing: gradients must be
// bit-identical in f32 (same RNG stream, same kernels), with dropout, several inputs and outputs,
// non-tensor arguments, inputs without grad, nesting, autocast and offload_to_cpu.
#include "checkpoint/checkpoint.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/dropout.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/relu.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

#include <string>
#include <vector>

namespace fairscale::checkpoint {
namespace {

// fc2(dropout(gelu(fc1(x)))) + x
class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(int64_t dim, double p = 0.3) {
    fc1 = register_module("fc1", torch::nn::Linear(dim, 2 * dim));
    fc2 = register_module("fc2", torch::nn::Linear(2 * dim, dim));
    drop = register_module("drop", torch::nn::Dropout(p));
  }
  torch::Tensor forward(torch::Tensor x) {
    return fc2(drop(torch::gelu(fc1(x)))) + x;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Block);

// A module whose forward takes non-tensor arguments and returns two tensors.
class TwoOutImpl : public torch::nn::Module {
 public:
  TwoOutImpl() { fc = register_module("fc", torch::nn::Linear(4, 4)); }
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x, double scale, int64_t power,
                                                   torch::Tensor bias) {
    torch::Tensor h = torch::dropout(fc(x), 0.5, is_training()) * scale;
    return {h.pow(power) + bias, h.sum(1)};
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(TwoOut);

std::vector<torch::Tensor> Grads(torch::nn::Module& m) {
  std::vector<torch::Tensor> g;
  for (auto& p : m.parameters()) g.push_back(p.grad().defined() ? p.grad().clone() : p.grad());
  return g;
}

void ZeroGrads(torch::nn::Module& m) {
  for (auto& p : m.parameters()) p.mutable_grad() = torch::Tensor();
}

void ExpectBitIdentical(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << i;
    if (a[i].defined()) {
      EXPECT_TRUE(torch::equal(a[i], b[i])) << "tensor " << i;
    }
  }
}

// A model of blocks, run plain or checkpointed (every block, or every k-th).
struct Model {
  explicit Model(int n, int64_t dim) {
    torch::manual_seed(1);
    for (int i = 0; i < n; ++i) {
      blocks.push_back(Block(dim));
      any.emplace_back(blocks.back());
      holder->register_module("b" + std::to_string(i), blocks.back());
    }
  }
  std::vector<Block> blocks;
  std::vector<torch::nn::AnyModule> any;
  std::shared_ptr<torch::nn::Module> holder = std::make_shared<torch::nn::Module>();
};

// Runs seed -> forward -> backward -> one more random draw; returns grads (params, input) and the
// draw, so the caller's RNG stream after backward is compared too.
struct Result {
  std::vector<torch::Tensor> grads;
  torch::Tensor out, next_draw;
};

Result RunModel(Model& m, int64_t every_k, CheckpointOptions options = {}) {
  ZeroGrads(*m.holder);
  torch::manual_seed(42);
  torch::Tensor x = torch::randn({8, 16}).requires_grad_();
  torch::Tensor y = checkpoint_every_kth(m.any, x, every_k, options);
  (y * y).sum().backward();
  Result r;
  r.grads = Grads(*m.holder);
  r.grads.push_back(x.grad().clone());
  r.out = y.detach();
  r.next_draw = torch::rand({4});
  return r;
}

TEST(CheckpointTest, GradientsBitIdenticalWithDropout) {
  Model m(4, 16);
  const Result plain = RunModel(m, /*every_k=*/0);
  for (int64_t k : {1, 2, 3}) {
    SCOPED_TRACE(k);
    const Result ck = RunModel(m, k);
    EXPECT_TRUE(torch::equal(plain.out, ck.out));
    ExpectBitIdentical(plain.grads, ck.grads);
    // The caller's RNG stream continues as without the recompute.
    EXPECT_TRUE(torch::equal(plain.next_draw, ck.next_draw));
  }
  // Dropout really is active: two seeds give different outputs.
  torch::manual_seed(7);
  torch::Tensor a = m.blocks[0]->forward(torch::ones({2, 16}));
  torch::Tensor b = m.blocks[0]->forward(torch::ones({2, 16}));
  EXPECT_FALSE(torch::equal(a, b));
}

TEST(CheckpointTest, WithoutPreservedRngTheMasksDiffer) {
  Model m(2, 16);
  const Result plain = RunModel(m, 0);
  const Result ck = RunModel(m, 1, CheckpointOptions().preserve_rng_state(false));
  EXPECT_TRUE(torch::equal(plain.out, ck.out));  // the forward is the same
  bool any_differs = false;
  for (size_t i = 0; i < plain.grads.size(); ++i) {
    any_differs |= !torch::equal(plain.grads[i], ck.grads[i]);
  }
  EXPECT_TRUE(any_differs);
}

TEST(CheckpointTest, OffloadToCpuGivesTheSameGradients) {
  Model m(3, 16);
  const Result plain = RunModel(m, 0);
  const Result ck = RunModel(m, 1, CheckpointOptions().offload_to_cpu(true));
  ExpectBitIdentical(plain.grads, ck.grads);
}

TEST(CheckpointTest, SeveralInputsAndOutputsNonTensorArgsInputsWithoutGrad) {
  TwoOut net;
  auto run = [&](bool ck) {
    ZeroGrads(*net);
    torch::manual_seed(3);
    torch::Tensor x = torch::randn({3, 4}).requires_grad_();
    torch::Tensor bias = torch::randn({3, 4});  // does not require grad
    torch::Tensor a, s;
    if (ck) {
      CheckpointWrapper w(net);
      std::tie(a, s) = w->forward_any<std::tuple<torch::Tensor, torch::Tensor>>(x, 0.7, int64_t{3},
                                                                                bias);
    } else {
      std::tie(a, s) = net->forward(x, 0.7, 3, bias);
    }
    EXPECT_TRUE(a.requires_grad());
    (a.sum() + (s * s).sum()).backward();
    EXPECT_FALSE(bias.grad().defined());
    std::vector<torch::Tensor> g = Grads(*net);
    g.push_back(x.grad().clone());
    return g;
  };
  ExpectBitIdentical(run(false), run(true));
}

TEST(CheckpointTest, FunctionalMultiInputOnlyOneOutputUsed) {
  torch::manual_seed(5);
  torch::Tensor a0 = torch::randn({5}), b0 = torch::randn({5});
  auto fn = [](const std::vector<torch::Tensor>& in) {
    return std::vector<torch::Tensor>{in[0] * in[1].sin(), in[0].exp(), in[1] + 1};
  };
  torch::Tensor a = a0.clone().requires_grad_(), b = b0.clone().requires_grad_();
  auto ref = fn({a, b});
  (ref[0].sum() + ref[1].sum()).backward();  // the third output is unused
  torch::Tensor ca = a0.clone().requires_grad_(), cb = b0.clone().requires_grad_();
  auto out = checkpoint(fn, {ca, cb});
  ASSERT_EQ(out.size(), 3u);
  (out[0].sum() + out[1].sum()).backward();
  EXPECT_TRUE(torch::equal(a.grad(), ca.grad()));
  EXPECT_TRUE(torch::equal(b.grad(), cb.grad()));
}

TEST(CheckpointTest, ParametersGetGradientsWhenNoInputRequiresGrad) {
  torch::manual_seed(9);
  torch::nn::Linear fc(6, 3);
  torch::Tensor x = torch::randn({4, 6});  // no grad: e.g. the first layer's input
  fc(x).pow(2).sum().backward();
  torch::Tensor ref_w = fc->weight.grad().clone(), ref_b = fc->bias.grad().clone();
  ZeroGrads(*fc);
  torch::Tensor y = checkpoint([&fc](const torch::Tensor& in) { return fc(in); }, x);
  ASSERT_TRUE(y.requires_grad());
  y.pow(2).sum().backward();
  EXPECT_TRUE(torch::equal(ref_w, fc->weight.grad()));
  EXPECT_TRUE(torch::equal(ref_b, fc->bias.grad()));
}

TEST(CheckpointTest, Nesting) {
  Model m(4, 16);
  const Result plain = RunModel(m, 0);
  ZeroGrads(*m.holder);
  torch::manual_seed(42);
  torch::Tensor x = torch::randn({8, 16}).requires_grad_();
  std::vector<bool> seen_recompute;
  // Outer region: blocks 0-3; inner regions: (0,1) and (2,3); block 1 checkpointed a third time.
  torch::Tensor y = checkpoint(
      [&](const torch::Tensor& in) {
        seen_recompute.push_back(is_recomputing());
        torch::Tensor h = checkpoint(
            [&](const torch::Tensor& i0) {
              return checkpoint([&](const torch::Tensor& i1) { return m.blocks[1](i1); },
                                m.blocks[0](i0));
            },
            in);
        return checkpoint([&](const torch::Tensor& i2) { return m.blocks[3](m.blocks[2](i2)); },
                          h);
      },
      x);
  (y * y).sum().backward();
  std::vector<torch::Tensor> g = Grads(*m.holder);
  g.push_back(x.grad().clone());
  EXPECT_TRUE(torch::equal(plain.out, y.detach()));
  ExpectBitIdentical(plain.grads, g);
  EXPECT_TRUE(torch::equal(plain.next_draw, torch::rand({4})));
  EXPECT_EQ(seen_recompute, (std::vector<bool>{false, true}));
}

TEST(CheckpointTest, AutocastStateIsPreserved) {
  torch::manual_seed(11);
  torch::nn::Linear fc1(8, 8), fc2(8, 8);
  torch::Tensor x0 = torch::randn({4, 8});
  auto body = [&](const torch::Tensor& in) {
    EXPECT_TRUE(at::autocast::is_cpu_enabled());
    return fc2(torch::relu(fc1(in)));
  };
  auto run = [&](bool ck) {
    ZeroGrads(*fc1);
    ZeroGrads(*fc2);
    torch::Tensor x = x0.clone().requires_grad_();
    at::autocast::set_cpu_enabled(true);
    at::autocast::set_autocast_cpu_dtype(at::kBFloat16);
    torch::Tensor y = ck ? checkpoint(body, x) : body(x);
    at::autocast::clear_cache();
    at::autocast::set_cpu_enabled(false);
    EXPECT_EQ(y.scalar_type(), at::kBFloat16);
    // Backward runs outside the autocast region: the recompute must switch it on again.
    y.to(at::kFloat).pow(2).sum().backward();
    EXPECT_FALSE(at::autocast::is_cpu_enabled());  // and switch it off after
    return std::vector<torch::Tensor>{fc1->weight.grad().clone(), fc2->weight.grad().clone(),
                                      x.grad().clone()};
  };
  ExpectBitIdentical(run(false), run(true));
}

TEST(CheckpointTest, NoGradModeJustCallsFn) {
  torch::NoGradGuard no_grad;
  int calls = 0;
  torch::Tensor y = checkpoint(
      [&](const torch::Tensor& in) {
        ++calls;
        EXPECT_FALSE(is_checkpointing());
        return in * 2;
      },
      torch::ones({2}));
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(torch::equal(y, torch::full({2}, 2.0)));
}

TEST(CheckpointTest, ForwardRunsWithoutGradAndRecomputesOnce) {
  torch::nn::Linear fc(3, 3);
  int calls = 0;
  std::vector<bool> grad_enabled;
  torch::Tensor y = checkpoint(
      [&](const torch::Tensor& in) {
        ++calls;
        grad_enabled.push_back(torch::GradMode::is_enabled());
        EXPECT_EQ(is_checkpointing(), !torch::GradMode::is_enabled());
        return fc(in);
      },
      torch::ones({1, 3}).requires_grad_());
  EXPECT_EQ(calls, 1);
  y.sum().backward();
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(grad_enabled, (std::vector<bool>{false, true}));
}

TEST(CheckpointTest, WrapperKeepsParameterNames) {
  Block b(4);
  std::vector<std::string> plain, wrapped;
  for (auto& p : b->named_parameters()) plain.push_back(p.key());
  CheckpointWrapper w(b);
  for (auto& p : w->named_parameters()) wrapped.push_back(p.key());
  EXPECT_EQ(plain, wrapped);
  EXPECT_EQ(w->parameters()[0].data_ptr(), b->parameters()[0].data_ptr());
  // The wrapper in an outer module: names are the wrapped module's, under the wrapper's name.
  torch::nn::Sequential seq;
  seq->push_back(CheckpointWrapper(Block(4)));
  EXPECT_EQ(seq->named_parameters().keys()[0], "0.fc1.weight");
}

TEST(CheckpointTest, UndefinedInputsAreAllowed) {
  torch::Tensor a = torch::ones({3}).requires_grad_();
  auto out = checkpoint(
      [](const std::vector<torch::Tensor>& in) {
        EXPECT_FALSE(in[1].defined());
        return std::vector<torch::Tensor>{in[0] * 3};
      },
      {a, torch::Tensor()});
  out[0].sum().backward();
  EXPECT_TRUE(torch::equal(a.grad(), torch::full({3}, 3.0)));
}

TEST(CheckpointTest, InputModifiedInPlaceBeforeBackwardIsReported) {
  for (bool offload : {false, true}) {
    torch::Tensor a = torch::ones({3}).requires_grad_();
    torch::Tensor h = a * 2;  // not a leaf: may be modified in place
    torch::Tensor y = checkpoint([](const torch::Tensor& in) { return in.sin(); }, h,
                                 CheckpointOptions().offload_to_cpu(offload));
    h.add_(1);
    EXPECT_THROW(y.sum().backward(), c10::Error) << offload;
  }
}

TEST(CheckpointTest, BadArguments) {
  std::vector<torch::nn::AnyModule> none;
  EXPECT_THROW(checkpoint_every_kth(none, torch::ones({1}), -1), c10::Error);
  EXPECT_THROW(checkpoint(CheckpointFn(), {torch::ones({1})}), c10::Error);
  EXPECT_THROW(
      checkpoint([](const std::vector<torch::Tensor>&) { return std::vector<torch::Tensor>{{}}; },
                 {torch::ones({1}, torch::requires_grad())}),
      c10::Error);
}

}  // namespace
}  // namespace fairscale::checkpoint
