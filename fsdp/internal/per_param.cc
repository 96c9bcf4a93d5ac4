// The per-parameter layout
// (FsdpOptions::flatten_parameters(false), PyTorch FSDP2's shape): each
// parameter is sharded on dim 0 and the wrapped module's own parameter tensors
// are what the wrapper registers and the optimizer steps. The engine (gathers,
// prefetch, reductions, buckets, mixed precision) is the flat layout's, run on
// the same FlatParam: `shard` concatenates this rank's rows of every parameter,
// the all-gather is one collective per FlatParam into a rank-major staging
// buffer that is copied out into `full` (the parameters back to back), and the
// full gradients are copied into the rank-major layout the reduce-scatter
// splits. Each parameter tensor keeps its identity (TensorImpl) and is
// re-pointed with set_data between its rows of `shard` (between steps) and its
// slice of `full` (while its unit computes), so autograd's saved tensors and
// AccumulateGrad see the full parameter in forward and backward and the
// optimizer sees the shard.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <string>
#include <vector>

#include "fsdp/internal/flat_param.h"
#include "fsdp/internal/param_ranges.h"

namespace fairscale::fsdp::internal {
namespace {

// Elements of `slot` that rank `rank` holds (unpadded).
int64_t LocalNumel(const ParamSlot& slot, int rank) {
  return std::clamp<int64_t>(slot.numel - rank * slot.rank_numel, 0, slot.rank_numel);
}

int ShardRank(const FlatParam& fp) {
  return fp.shard_numel > 0 ? static_cast<int>(fp.shard_offset / fp.shard_numel) : 0;
}

// Where rank `rank`'s part of `slot` starts in the flattened parameter (clamped: a rank past
// the last row holds nothing).
int64_t Begin(const ParamSlot& slot, int rank) {
  return std::min(slot.numel, rank * slot.rank_numel);
}

at::Tensor ShardView(const FlatParam& fp, const ParamSlot& slot) {
  return fp.shard.narrow(0, slot.shard_offset, LocalNumel(slot, ShardRank(fp)))
      .view(slot.local_shape);
}

}  // namespace

void CopyOutGathered(FlatParam& fp, int world) {
  c10::NoGradGuard no_grad;
  for (const ParamSlot& slot : fp.slots) {
    ForEachDim0Piece(slot.numel, slot.rank_numel, world, [&](int q, int64_t begin, int64_t len) {
      fp.full.narrow(0, slot.offset + begin, len)
          .copy_(fp.gather_buf.narrow(0, q * fp.shard_numel + slot.shard_offset, len));
    });
  }
  fp.gather_buf = at::Tensor();
}

void AddDim0Grad(FlatParam& fp, const ParamSlot& slot, const at::Tensor& grad, int world) {
  const at::Tensor flat = grad.reshape({-1});
  ForEachDim0Piece(slot.numel, slot.rank_numel, world, [&](int q, int64_t begin, int64_t len) {
    fp.full_grad.narrow(0, q * fp.shard_numel + slot.shard_offset, len)
        .add_(flat.narrow(0, begin, len));
  });
}

void AccumulateDim0Grads(FlatParam& fp, const at::Tensor& recv) {
  c10::NoGradGuard no_grad;
  const int rank = ShardRank(fp);
  for (ParamSlot& slot : fp.slots) {
    const at::Tensor part =
        recv.narrow(0, slot.shard_offset, LocalNumel(slot, rank)).view(slot.local_shape);
    // While the parameter views `full` (a reduction completing inside
    // backward), its shard-shaped gradient is kept aside.
    at::Tensor& grad = fp.full_views ? slot.shard_grad : slot.param.mutable_grad();
    if (grad.defined()) {
      grad.add_(part);
    } else {
      // A copy: `recv` views the unit's full gradient or a bucket, which must
      // not stay alive.
      grad = part.to(fp.shard.scalar_type(), /*non_blocking=*/false,
                     /*copy=*/true);
    }
  }
}

void WritebackDim0(FlatParam& fp) {
  c10::NoGradGuard no_grad;
  const int rank = ShardRank(fp);
  for (const ParamSlot& slot : fp.slots) {
    const int64_t n = LocalNumel(slot, rank);
    fp.shard.narrow(0, slot.shard_offset, n)
        .copy_(fp.full.narrow(0, slot.offset + Begin(slot, rank), n));
  }
}

std::vector<at::Tensor> ShardGrads(const FlatParam& fp) {
  std::vector<at::Tensor> out;
  if (!fp.per_param) {
    if (fp.shard.grad().defined()) out.push_back(fp.shard.grad());
    return out;
  }
  for (const ParamSlot& slot : fp.slots) {
    const at::Tensor& g = fp.full_views ? slot.shard_grad : slot.param.grad();
    if (g.defined()) out.push_back(g);
  }
  return out;
}

void LayoutDim0(FlatParam& fp, std::vector<ParamSlot>& slots, int world, int rank,
                at::ScalarType compute, bool sharded) {
  c10::NoGradGuard no_grad;
  fp.per_param = true;
  fp.grad_views = false;
  int64_t shard_numel = 0;
  for (ParamSlot& slot : slots) {
    // A 0-dim parameter counts as one row of one element.
    const int64_t rows = slot.shape.empty() ? 1 : slot.shape[0];
    int64_t row_numel = 1;
    for (size_t d = 1; d < slot.shape.size(); ++d) row_numel *= slot.shape[d];
    slot.rank_numel = Dim0RankNumel(rows, row_numel, world);
    slot.shard_offset = shard_numel;
    shard_numel += slot.rank_numel;
    const int64_t rows_per_rank = ShardNumel(rows, world);
    const int64_t local_rows = std::clamp<int64_t>(rows - rank * rows_per_rank, 0, rows_per_rank);
    slot.local_shape = slot.shape;
    if (world > 1) {
      if (slot.local_shape.empty()) slot.local_shape.push_back(0);
      slot.local_shape[0] = local_rows;
    }
  }
  fp.shard_numel = shard_numel;
  fp.padded_numel = world * shard_numel;
  fp.shard_offset = rank * shard_numel;
  const at::Tensor& first = slots.front().param;
  fp.shard = at::zeros({shard_numel}, first.options().requires_grad(false));
  for (const ParamSlot& slot : slots) {
    const int64_t n = LocalNumel(slot, rank);
    fp.shard.narrow(0, slot.shard_offset, n)
        .copy_(slot.param.detach().reshape({-1}).narrow(0, Begin(slot, rank), n));
  }
  if (sharded) {
    fp.full = at::empty({fp.numel}, fp.shard.options().dtype(compute));
  } else {  // one rank's shard is the whole layout
    fp.full = fp.mixed ? fp.shard.to(compute) : fp.shard;
  }
  // The parameters view `full` while the AccumulateGrad nodes are made (their
  // metadata is the full shape, what backward produces); Unit::FinishSharding
  // switches them to their rows after.
  for (ParamSlot& slot : slots) {
    slot.param.set_data(fp.full.narrow(0, slot.offset, slot.numel).view(slot.shape));
    if (slot.param.grad().defined()) slot.param.mutable_grad() = at::Tensor();
  }
  fp.full_views = true;
}

void SetDim0Views(FlatParam& fp, bool full) {
  if (!fp.per_param || fp.full_views == full) return;
  fp.full_views = full;
  for (ParamSlot& slot : fp.slots) {
    at::Tensor& p = slot.param;
    if (full) {
      slot.shard_grad = p.grad();
      p.mutable_grad() = at::Tensor();
      p.set_data(fp.full.narrow(0, slot.offset, slot.numel).view(slot.shape));
      // set_data to another dtype (mixed precision) drops the parameter's
      // link to its AccumulateGrad node; the node (made for the full shape,
      // carrying the post-backward hook) is the one autograd must keep using.
      if (slot.grad_accumulator) {
        torch::autograd::impl::get_autograd_meta(p)->grad_accumulator_ = slot.grad_accumulator;
      }
    } else {
      p.set_data(ShardView(fp, slot));
      p.mutable_grad() = slot.shard_grad;
      slot.shard_grad = at::Tensor();
    }
  }
}

}  // namespace fairscale::fsdp::internal
