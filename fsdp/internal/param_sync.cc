#include "fsdp/internal/param_sync.h"

#include "deterministic/mode.h"

#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/fnv1a.h"
#include "fsdp/internal/collectives.h"
#include "base/torch_error.h"

namespace fairscale::fsdp::internal {
namespace {

constexpr uint64_t kPrime = 0x100000001b3ULL;  // FNV's

// FNV-1a over 8-byte words (the tail bytewise): a few GB/s, where bytewise FNV-1a is well
// under one; a wrap-time check over every parameter must not cost seconds.
uint64_t HashWords(const void* data, size_t n, uint64_t h) {
  const auto* p = static_cast<const unsigned char*>(data);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * kPrime;
  }
  return base::Fnv1a64(p + i, n - i, h);
}

std::string ShapeOf(const at::Tensor& t) {
  return absl::StrCat("[", absl::StrJoin(t.sizes(), ", "), "] ", c10::toString(t.scalar_type()));
}

}  // namespace

TensorHash HashTensor(const at::Tensor& t) {
  TensorHash h;
  const std::string shape = ShapeOf(t);
  h.shape = base::Fnv1a64(shape.data(), shape.size());
  const at::Tensor cpu = t.detach().to(at::kCPU).contiguous();
  h.values = HashWords(cpu.data_ptr(), cpu.numel() * cpu.element_size(), base::kFnv1a64Basis);
  return h;
}

void CheckOrBroadcastParams(comm::Communicator& world, const std::vector<const ParamSlot*>& slots,
                            bool broadcast, const std::string& label, int64_t micro_batches) {
  const int size = world.size();
  if (size == 1) return;
  const std::string context = label + ": comparing the initial parameters across ranks";
  // Counts first (the hash all-gather needs the same count on every rank), with the mode.
  const int64_t n = static_cast<int64_t>(slots.size());
  const int64_t header[2] = {n, micro_batches};
  std::vector<int64_t> gathered(2 * size);
  base::ThrowIfError(
      world.AllGather(comm::MakeConstBuffer(header, 2), comm::MakeBuffer(gathered.data(), 2 * size))
          .Wait(),
      context);
  for (int r = 0; r < size; ++r) {
    TORCH_CHECK(gathered[2 * r + 1] == micro_batches, label,
                ": ranks disagree on deterministic mode: this rank runs ",
                deterministic::DescribeMode(micro_batches > 0, micro_batches), ", rank ", r,
                " runs ", deterministic::DescribeMode(gathered[2 * r + 1] > 0, gathered[2 * r + 1]),
                "; every rank must be built with the same options");
  }
  std::vector<int64_t> counts(size);
  for (int r = 0; r < size; ++r) counts[r] = gathered[2 * r];
  for (int r = 0; r < size; ++r) {
    TORCH_CHECK(counts[r] == n, label, ": rank ", r, " has ", counts[r],
                " parameters in this unit, rank ", world.rank(), " has ", n,
                "; every rank must build the same model");
  }
  // Per parameter: the hash of its name, shape and dtype, and the hash of its values.
  std::vector<int64_t> mine(2 * n);
  for (int64_t i = 0; i < n; ++i) {
    TensorHash h = HashTensor(slots[i]->param);
    h.shape = base::Fnv1a64(slots[i]->name.data(), slots[i]->name.size(), h.shape);
    std::memcpy(&mine[2 * i], &h.shape, 8);
    std::memcpy(&mine[2 * i + 1], &h.values, 8);
  }
  std::vector<int64_t> all(2 * n * size);
  base::ThrowIfError(world
                   .AllGather(comm::MakeConstBuffer(mine.data(), mine.size()),
                              comm::MakeBuffer(all.data(), all.size()))
                   .Wait(),
               context);
  auto at = [&](int r, int64_t i, int k) { return all[2 * n * r + 2 * i + k]; };
  for (int64_t i = 0; i < n; ++i) {
    for (int r = 1; r < size; ++r) {
      TORCH_CHECK(at(r, i, 0) == at(0, i, 0), label, ": parameter #", i, " is '", slots[i]->name,
                  "' ", ShapeOf(slots[i]->param), " on rank ", world.rank(),
                  ", but its name, shape or dtype differs between rank 0 and rank ", r,
                  "; every rank must build the same model");
    }
  }
  c10::NoGradGuard no_grad;
  for (int64_t i = 0; i < n; ++i) {
    int differs = -1;
    for (int r = 1; r < size && differs < 0; ++r) {
      if (at(r, i, 1) != at(0, i, 1)) differs = r;
    }
    if (differs < 0) continue;
    TORCH_CHECK(broadcast, label, ": parameter '", slots[i]->name,
                "' holds different values on rank 0 and rank ", differs,
                ": every rank must start from the same parameters (seed every rank's "
                "initialization alike, or set FsdpOptions::sync_module_states(true) to broadcast "
                "rank 0's)");
    at::Tensor p = slots[i]->param.detach();
    at::Tensor buf = p.is_contiguous() ? p : p.contiguous();
    base::ThrowIfError(world.Broadcast(Buf(buf, context), 0).Wait(),
                 label + ": broadcasting parameter '" + slots[i]->name + "' from rank 0");
    if (!buf.is_same(p)) p.copy_(buf);
  }
}

}  // namespace fairscale::fsdp::internal
