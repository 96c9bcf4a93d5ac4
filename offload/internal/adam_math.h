// The Adam / AdamW update of one chunk (//offload:adam_math), written exactly as
// torch::optim::Adam / AdamW (LibTorch 1.13) write it, so the offloaded optimizer matches the
// in-memory one bit for bit on the same chunk of f32 data.
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>

namespace fairscale::offload::internal {

struct AdamHyper {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  bool amsgrad = false;
  bool decoupled = false;  // AdamW
};

// w: f32 parameter (or master) chunk, updated in place; g: f32 gradient chunk; m, v: exp_avg and
// exp_avg_sq chunks, updated in place; step: the step count after this step's increment.
inline void AdamUpdate(at::Tensor w, at::Tensor g, at::Tensor m, at::Tensor v, int64_t step,
                       const AdamHyper& h) {
  if (h.weight_decay != 0) {
    if (h.decoupled) {
      w.mul_(1 - h.lr * h.weight_decay);
    } else {
      g = g.add(w, h.weight_decay);
    }
  }
  const double bias_correction1 = 1 - std::pow(h.beta1, static_cast<double>(step));
  const double bias_correction2 = 1 - std::pow(h.beta2, static_cast<double>(step));
  m.mul_(h.beta1).add_(g, 1 - h.beta1);
  v.mul_(h.beta2).addcmul_(g, g, 1 - h.beta2);
  at::Tensor denom = (v.sqrt() / std::sqrt(bias_correction2)).add_(h.eps);
  w.addcdiv_(m, denom, -h.lr / bias_correction1);
}

}  // namespace fairscale::offload::internal
