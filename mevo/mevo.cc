#include "mevo/mevo.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/torch_error.h"

namespace fairscale::mevo {
namespace {

constexpr char kContext[] = "mevo::mevo_cross_entropy";

absl::Status CheckOptions(const MevoOptions& o) {
  if (o.vocab_chunk() <= 0 || o.token_chunk() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("chunk sizes must be positive: vocab_chunk ",
                                                   o.vocab_chunk(), ", token_chunk ",
                                                   o.token_chunk()));
  }
  if (o.reduction() != "mean" && o.reduction() != "sum") {
    return absl::InvalidArgumentError(
        absl::StrCat("reduction must be \"mean\" or \"sum\", got \"", o.reduction(), "\""));
  }
  return absl::OkStatus();
}

std::string Shape(const at::Tensor& t) {
  return absl::StrCat("[", absl::StrJoin(t.sizes(), ", "), "]");
}

absl::Status CheckArgs(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                       const at::Tensor& targets) {
  if (!input.defined() || !weight.defined() || !targets.defined()) {
    return absl::InvalidArgumentError("input, weight and targets must be defined");
  }
  if (weight.dim() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("weight must be [V, D], got ", Shape(weight)));
  }
  if (input.dim() < 1 || input.size(-1) != weight.size(1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "input ", Shape(input), " must be [..., D] with D = weight.size(1) = ", weight.size(1),
        " (weight ", Shape(weight), ")"));
  }
  if (targets.sizes() != input.sizes().slice(0, input.dim() - 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "targets ", Shape(targets), " must have input's leading shape (input ", Shape(input), ")"));
  }
  if (targets.scalar_type() != at::kLong) {
    return absl::InvalidArgumentError(
        absl::StrCat("targets must be int64, got ", c10::toString(targets.scalar_type())));
  }
  if (!at::isFloatingType(input.scalar_type()) || input.scalar_type() != weight.scalar_type()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "input and weight must have the same floating dtype, got ",
        c10::toString(input.scalar_type()), " and ", c10::toString(weight.scalar_type())));
  }
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != weight.size(0) ||
                         bias.scalar_type() != weight.scalar_type())) {
    return absl::InvalidArgumentError(absl::StrCat("bias must be [V] = [", weight.size(0),
                                                   "] of weight's dtype, got ", Shape(bias), " ",
                                                   c10::toString(bias.scalar_type())));
  }
  return absl::OkStatus();
}

// f32 for the reduced-precision dtypes (FairScale's fp_max / fp_sum / fp_target), else the dtype.
at::ScalarType ComputeType(at::ScalarType t) {
  return (t == at::kHalf || t == at::kBFloat16) ? at::kFloat : t;
}

// Rows [begin, begin + n) of `t` in the compute dtype (a view when no cast is needed).
at::Tensor Rows(const at::Tensor& t, int64_t begin, int64_t n, at::ScalarType compute) {
  return t.narrow(0, begin, n).to(compute);
}

// The target rows of a token chunk: weight[tgt] (and bias[tgt]) in the compute dtype, with
// ignored tokens pointing at row 0 (their coefficient is 0, so the row only has to exist).
struct TargetRows {
  at::Tensor index;   // int64 [tc]
  at::Tensor weight;  // [tc, D]
  at::Tensor bias;    // [tc] or undefined
};
TargetRows TargetRowsOf(const at::Tensor& tgt, const at::Tensor& valid_c, const at::Tensor& weight,
                        const at::Tensor& bias, at::ScalarType compute) {
  TargetRows r;
  r.index = tgt.masked_fill(valid_c.logical_not(), 0);
  r.weight = weight.index_select(0, r.index).to(compute);
  if (bias.numel() > 0) r.bias = bias.index_select(0, r.index).to(compute);
  return r;
}

class MevoFunction : public torch::autograd::Function<MevoFunction> {
 public:
  // x [T, D], weight [V, D], bias [V] or numel() == 0 for none (autograd::Function takes no
  // undefined tensor input), t int64 [T] (already validated) -> 0-dim loss.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& t,
                            const MevoOptions& o) {
    const at::ScalarType compute = ComputeType(x.scalar_type());
    const int64_t num_tokens = x.size(0);
    const int64_t vocab = weight.size(0);
    const bool has_bias = bias.numel() > 0;
    const at::TensorOptions copts = x.options().dtype(compute);
    const at::Tensor valid = t.ne(o.ignore_index());
    const at::Tensor bad = valid.logical_and(t.lt(0).logical_or_(t.ge(vocab)));
    if (bad.any().item<bool>()) {
      const int64_t i = bad.nonzero()[0][0].item<int64_t>();
      base::ThrowIfError(absl::InvalidArgumentError(absl::StrCat(
                             "target ", t[i].item<int64_t>(), " of token ", i, " is outside [0, ",
                             vocab, ") and is not ignore_index ", o.ignore_index())),
                         kContext);
    }
    const int64_t num_valid = valid.sum().item<int64_t>();

    // Per token chunk: the target logits (one row dot product per token), then the log-sum-exp
    // over the vocabulary chunks. A chunk of ignored tokens only is skipped (lse 0, unused).
    at::Tensor lse = at::zeros({num_tokens}, copts);
    at::Tensor target_logit = at::zeros({num_tokens}, copts);
    for (int64_t t0 = 0; t0 < num_tokens; t0 += o.token_chunk()) {
      const int64_t tc = std::min(o.token_chunk(), num_tokens - t0);
      const at::Tensor valid_c = valid.narrow(0, t0, tc);
      if (!valid_c.any().item<bool>()) continue;
      const at::Tensor xc = Rows(x, t0, tc, compute);
      const TargetRows rows = TargetRowsOf(t.narrow(0, t0, tc), valid_c, weight, bias, compute);
      at::Tensor tl = target_logit.narrow(0, t0, tc);
      at::sum_out(tl, xc * rows.weight, 1);
      if (has_bias) tl.add_(rows.bias);
      // Online log-sum-exp: m is the running max, s the sum of exp(logit - m) so far.
      at::Tensor m = at::full({tc}, -std::numeric_limits<double>::infinity(), copts);
      at::Tensor s = at::zeros({tc}, copts);
      for (int64_t v0 = 0; v0 < vocab; v0 += o.vocab_chunk()) {
        const int64_t vc = std::min(o.vocab_chunk(), vocab - v0);
        at::Tensor logits = at::mm(xc, Rows(weight, v0, vc, compute).t());  // [tc, vc]
        if (has_bias) logits.add_(Rows(bias, v0, vc, compute));
        const at::Tensor m_new = at::maximum(m, at::amax(logits, 1));
        s.mul_((m - m_new).exp_()).add_(logits.sub_(m_new.unsqueeze(1)).exp_().sum(1));
        m = m_new;
      }
      lse.narrow(0, t0, tc).copy_(m.add_(s.log_()));
    }
    const at::Tensor total = at::where(valid, lse - target_logit, at::zeros({}, copts)).sum();
    at::Tensor loss = o.reduction() == "sum" ? total : total / static_cast<double>(num_valid);

    ctx->save_for_backward({x, weight, bias, t, lse});
    ctx->saved_data["token_chunk"] = o.token_chunk();
    ctx->saved_data["vocab_chunk"] = o.vocab_chunk();
    ctx->saved_data["ignore_index"] = o.ignore_index();
    ctx->saved_data["sum"] = o.reduction() == "sum";
    ctx->saved_data["num_valid"] = num_valid;
    return loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& bias = saved[2];
    const at::Tensor& t = saved[3];
    const at::Tensor& lse = saved[4];
    const int64_t token_chunk = ctx->saved_data["token_chunk"].toInt();
    const int64_t vocab_chunk = ctx->saved_data["vocab_chunk"].toInt();
    const int64_t ignore_index = ctx->saved_data["ignore_index"].toInt();
    const bool sum = ctx->saved_data["sum"].toBool();
    const int64_t num_valid = ctx->saved_data["num_valid"].toInt();
    const bool need_x = ctx->needs_input_grad(0);
    const bool need_w = ctx->needs_input_grad(1);
    const bool has_bias = bias.numel() > 0;
    const bool need_b = has_bias && ctx->needs_input_grad(2);
    const at::ScalarType compute = lse.scalar_type();
    const at::TensorOptions copts = x.options().dtype(compute);
    const int64_t num_tokens = x.size(0);
    const int64_t vocab = weight.size(0);

    // d loss / d logit[i, v] = coef[i] * (softmax[i, v] - onehot[i, v]); coef is 0 for ignored
    // tokens, grad_out (sum) or grad_out / num_valid (mean) for the others.
    const at::Tensor valid = t.ne(ignore_index);
    at::Tensor g = grad_out[0].to(compute);
    if (!sum) g = num_valid > 0 ? g / static_cast<double>(num_valid) : at::zeros_like(g);
    const at::Tensor coef = valid.to(compute) * g;

    at::Tensor grad_x = need_x ? at::zeros({num_tokens, x.size(1)}, copts) : at::Tensor();
    at::Tensor grad_w = need_w ? at::zeros(weight.sizes(), copts) : at::Tensor();
    at::Tensor grad_b = need_b ? at::zeros(bias.sizes(), copts) : at::Tensor();
    if (need_x || need_w || need_b) {
      for (int64_t t0 = 0; t0 < num_tokens; t0 += token_chunk) {
        const int64_t tc = std::min(token_chunk, num_tokens - t0);
        const at::Tensor valid_c = valid.narrow(0, t0, tc);
        if (!valid_c.any().item<bool>()) continue;  // all ignored: no gradient
        const at::Tensor xc = Rows(x, t0, tc, compute);
        const at::Tensor lse_c = lse.narrow(0, t0, tc).unsqueeze(1);
        const at::Tensor coef_c = coef.narrow(0, t0, tc).unsqueeze(1);
        // The softmax part, tile by tile.
        for (int64_t v0 = 0; v0 < vocab; v0 += vocab_chunk) {
          const int64_t vc = std::min(vocab_chunk, vocab - v0);
          const at::Tensor wc = Rows(weight, v0, vc, compute);
          at::Tensor p = at::mm(xc, wc.t());
          if (has_bias) p.add_(Rows(bias, v0, vc, compute));
          p.sub_(lse_c).exp_().mul_(coef_c);  // coef * softmax, [tc, vc]
          if (need_x) grad_x.narrow(0, t0, tc).addmm_(p, wc);
          if (need_w) grad_w.narrow(0, v0, vc).addmm_(p.t(), xc);
          if (need_b) grad_b.narrow(0, v0, vc).add_(p.sum(0));
        }
        // The one-hot part, once per token chunk: -coef at each token's target column.
        const TargetRows rows = TargetRowsOf(t.narrow(0, t0, tc), valid_c, weight, bias, compute);
        if (need_x) grad_x.narrow(0, t0, tc).sub_(rows.weight * coef_c);
        if (need_w) grad_w.index_add_(0, rows.index, xc * coef_c.neg());
        if (need_b) grad_b.index_add_(0, rows.index, coef_c.squeeze(1).neg());
      }
    }
    if (need_x) grad_x = grad_x.to(x.scalar_type());
    if (need_w) grad_w = grad_w.to(weight.scalar_type());
    if (need_b) grad_b = grad_b.to(bias.scalar_type());
    return {grad_x, grad_w, grad_b, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor mevo_cross_entropy(const at::Tensor& input, const at::Tensor& weight,
                              const at::Tensor& bias, const at::Tensor& targets,
                              const MevoOptions& options) {
  base::ThrowIfError(CheckOptions(options), kContext);
  base::ThrowIfError(CheckArgs(input, weight, bias, targets), kContext);
  return MevoFunction::apply(input.reshape({-1, weight.size(1)}), weight,
                             bias.defined() ? bias : at::empty({0}, weight.options()),
                             targets.reshape({-1}), options);
}

at::Tensor mevo_cross_entropy(const at::Tensor& input, const at::Tensor& weight,
                              const at::Tensor& targets, const MevoOptions& options) {
  return mevo_cross_entropy(input, weight, at::Tensor(), targets, options);
}

MevoLossImpl::MevoLossImpl(MevoOptions options_) : options(std::move(options_)) {
  base::ThrowIfError(CheckOptions(options), "mevo::MevoLoss");
}

at::Tensor MevoLossImpl::forward(const at::Tensor& input, const at::Tensor& weight,
                                 const at::Tensor& targets, const at::Tensor& bias) {
  return mevo_cross_entropy(input, weight, bias, targets, options);
}

}  // namespace fairscale::mevo
