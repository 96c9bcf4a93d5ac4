#include "deterministic/collectives.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/torch_error.h"
#include "comm/torch/tensor_buffer.h"

namespace fairscale::deterministic {
namespace {

std::string Context(const comm::Communicator& comm, const std::string& what, const char* op) {
  return absl::StrCat(what, " rank ", comm.rank(), "/", comm.size(), " (deterministic ", op, ")");
}

size_t MaxNodes(const std::vector<std::vector<Node>>& nodes_of) {
  size_t n = 0;
  for (const auto& v : nodes_of) n = std::max(n, v.size());
  return n;
}

// Checks what every collective here needs of its arguments; returns the values' common numel.
int64_t CheckArgs(const comm::Communicator& comm, const std::vector<Partial>& mine,
                  const std::vector<std::vector<Node>>& nodes_of, const std::string& ctx) {
  TORCH_CHECK(static_cast<int>(nodes_of.size()) == comm.size(), ctx, ": node lists for ",
              nodes_of.size(), " ranks, the group has ", comm.size());
  const std::vector<Node>& own = nodes_of[comm.rank()];
  TORCH_CHECK(mine.size() == own.size(), ctx, ": this rank holds ", mine.size(),
              " partial sums, its node list says ", own.size());
  int64_t numel = -1;
  for (size_t i = 0; i < mine.size(); ++i) {
    TORCH_CHECK(mine[i].node == own[i], ctx, ": partial ", i, " is ", NodeName(mine[i].node),
                ", the node list says ", NodeName(own[i]));
    TORCH_CHECK(mine[i].value.defined() && mine[i].value.is_contiguous(), ctx,
                ": partial values must be defined and contiguous");
    TORCH_CHECK(numel < 0 || mine[i].value.numel() == numel, ctx,
                ": partial values differ in size (", numel, " and ", mine[i].value.numel(), ")");
    TORCH_CHECK(i == 0 || mine[i].value.scalar_type() == mine[0].value.scalar_type(), ctx,
                ": partial values differ in dtype");
    numel = mine[i].value.numel();
  }
  return numel;
}

// The values of `mine` as rows of a [slots, numel] tensor (no copy when there is one slot).
at::Tensor PackRows(const std::vector<Partial>& mine, size_t slots, int64_t numel,
                    const at::TensorOptions& options) {
  if (slots == 1 && mine.size() == 1) return mine[0].value.reshape({1, numel});
  at::Tensor send = at::zeros({static_cast<int64_t>(slots), numel}, options);
  for (size_t s = 0; s < mine.size(); ++s) send[s].copy_(mine[s].value.reshape({numel}));
  return send;
}

// The partials every rank sent, from a [world, slots, n] receive buffer (views into it).
std::vector<Partial> Unpack(const at::Tensor& recv, const std::vector<std::vector<Node>>& nodes_of) {
  std::vector<Partial> parts;
  for (size_t q = 0; q < nodes_of.size(); ++q) {
    for (size_t s = 0; s < nodes_of[q].size(); ++s) {
      parts.push_back({nodes_of[q][s], recv[static_cast<int64_t>(q)][static_cast<int64_t>(s)]});
    }
  }
  return parts;
}

}  // namespace

std::vector<Partial> ReduceScatter(comm::Communicator& comm, std::vector<Partial> mine,
                                   const std::vector<std::vector<Node>>& nodes_of,
                                   const std::string& what) {
  const std::string ctx = Context(comm, what, "reduce_scatter");
  const int64_t numel = CheckArgs(comm, mine, nodes_of, ctx);
  const int world = comm.size();
  if (world == 1) return Merge(std::move(mine));
  // Every rank must hold a partial: one with none would not know numel (nor the dtype) to size
  // its part of the all-to-all.
  TORCH_CHECK(!mine.empty(), ctx, ": this rank holds no partial sum (every rank must compute "
              "at least one micro-batch)");
  const size_t slots = MaxNodes(nodes_of);
  TORCH_CHECK(numel % world == 0, ctx, ": ", numel, " elements do not split into ", world,
              " blocks");
  const int64_t shard = numel / world;
  const at::TensorOptions options = mine[0].value.options();
  // send[dest][slot] = block `dest` of partial `slot`: rows of [slots, world, shard] transposed
  // to [world, slots, shard].
  at::Tensor send;
  if (slots == 1) {
    send = mine[0].value;
  } else {
    send = at::zeros({world, static_cast<int64_t>(slots), shard}, options);
    for (size_t s = 0; s < mine.size(); ++s) {
      send.select(1, static_cast<int64_t>(s)).copy_(mine[s].value.view({world, shard}));
    }
  }
  at::Tensor recv = at::empty({world, static_cast<int64_t>(slots), shard}, options);
  comm::Work work = comm.AllToAll(base::ValueOrThrow(comm::ToConstBuffer(send), ctx),
                                  base::ValueOrThrow(comm::ToBuffer(recv), ctx));
  base::ThrowIfError(work.Wait(), ctx);
  mine.clear();
  return Merge(Unpack(recv, nodes_of));
}

std::vector<Partial> AllGather(comm::Communicator& comm, std::vector<Partial> mine,
                               const std::vector<std::vector<Node>>& nodes_of,
                               const std::string& what) {
  const std::string ctx = Context(comm, what, "all_gather");
  const int64_t numel = CheckArgs(comm, mine, nodes_of, ctx);
  const int world = comm.size();
  if (world == 1) return Merge(std::move(mine));
  TORCH_CHECK(!mine.empty(), ctx, ": this rank holds no partial sum");
  const size_t slots = MaxNodes(nodes_of);
  const at::TensorOptions options = mine[0].value.options();
  at::Tensor send = PackRows(mine, slots, numel, options);
  at::Tensor recv = at::empty({world, static_cast<int64_t>(slots), numel}, options);
  comm::Work work = comm.AllGather(base::ValueOrThrow(comm::ToConstBuffer(send), ctx),
                                   base::ValueOrThrow(comm::ToBuffer(recv), ctx));
  base::ThrowIfError(work.Wait(), ctx);
  mine.clear();
  return Merge(Unpack(recv, nodes_of));
}

std::vector<Partial> Gather(comm::Communicator& comm, int root, std::vector<Partial> mine,
                            const std::vector<std::vector<Node>>& nodes_of,
                            const std::string& what) {
  const std::string ctx = Context(comm, what, "gather");
  const int64_t numel = CheckArgs(comm, mine, nodes_of, ctx);
  const int world = comm.size();
  TORCH_CHECK(root >= 0 && root < world, ctx, ": bad root ", root);
  if (world == 1) return Merge(std::move(mine));
  TORCH_CHECK(!mine.empty(), ctx, ": this rank holds no partial sum");
  std::vector<comm::P2POp> ops;
  std::vector<Partial> parts;
  if (comm.rank() != root) {
    for (const Partial& p : mine) {
      ops.push_back(comm::P2POp::Send(base::ValueOrThrow(comm::ToConstBuffer(p.value), ctx), root));
    }
  } else {
    const at::TensorOptions options = mine[0].value.options();
    for (int q = 0; q < world; ++q) {
      if (q == root) continue;
      for (const Node& n : nodes_of[q]) {
        parts.push_back({n, at::empty({numel}, options)});
        ops.push_back(
            comm::P2POp::Recv(base::ValueOrThrow(comm::ToBuffer(parts.back().value), ctx), q));
      }
    }
  }
  base::ThrowIfError(comm.BatchP2P(ops).Wait(), ctx);
  if (comm.rank() != root) return {};
  for (Partial& p : mine) {
    p.value = p.value.reshape({numel});
    parts.push_back(std::move(p));
  }
  return Merge(std::move(parts));
}

at::Tensor AllReduce(comm::Communicator& comm, std::vector<Partial> mine,
                     const std::vector<std::vector<Node>>& nodes_of, int64_t micro_batches,
                     const std::string& what) {
  const std::string ctx = Context(comm, what, "all_reduce");
  const int64_t numel = CheckArgs(comm, mine, nodes_of, ctx);
  const int world = comm.size();
  TORCH_CHECK(!mine.empty(), ctx, ": this rank holds no partial sum");
  const auto shape = mine[0].value.sizes().vec();
  if (world == 1) return Total(std::move(mine), micro_batches).view(shape);
  const int64_t shard = (numel + world - 1) / world;
  const at::TensorOptions options = mine[0].value.options();
  if (shard * world != numel) {
    for (Partial& p : mine) {
      at::Tensor padded = at::zeros({shard * world}, options);
      padded.narrow(0, 0, numel).copy_(p.value.reshape({numel}));
      p.value = padded;
    }
  } else {
    for (Partial& p : mine) p.value = p.value.reshape({numel});
  }
  at::Tensor block = Total(ReduceScatter(comm, std::move(mine), nodes_of, what), micro_batches);
  at::Tensor out = at::empty({shard * world}, options);
  comm::Work work = comm.AllGather(base::ValueOrThrow(comm::ToConstBuffer(block.contiguous()), ctx),
                                   base::ValueOrThrow(comm::ToBuffer(out), ctx));
  base::ThrowIfError(work.Wait(), ctx);
  return out.narrow(0, 0, numel).view(shape);
}

double Mean(comm::Communicator& comm, const MicroBatchLayout& layout,
            const std::vector<double>& mine, const std::string& what) {
  const std::string ctx = Context(comm, what, "mean");
  TORCH_CHECK(layout.world == comm.size() && layout.rank == comm.rank(), ctx,
              ": the layout is for rank ", layout.rank, "/", layout.world);
  TORCH_CHECK(static_cast<int64_t>(mine.size()) == layout.per_rank(), ctx, ": ", mine.size(),
              " values, this rank computes ", layout.per_rank(), " micro-batches");
  std::vector<double> all(static_cast<size_t>(layout.micro_batches));
  if (comm.size() == 1) {
    all = mine;
  } else {
    const comm::ConstBuffer send{mine.data(), mine.size(), comm::DataType::kF64,
                                 comm::Device::Cpu()};
    const comm::Buffer recv{all.data(), all.size(), comm::DataType::kF64, comm::Device::Cpu()};
    base::ThrowIfError(comm.AllGather(send, recv).Wait(), ctx);
  }
  return TotalOf(all) / static_cast<double>(layout.micro_batches);
}

// ---- ExactSquareSum ----------------------------------------------------------------------

void ExactSquareSum::AddDouble(double v) {
  const double s = v * v;
  if (std::isnan(s)) {
    ++nan_;
    return;
  }
  if (std::isinf(s)) {
    ++inf_;
    return;
  }
  if (s == 0) return;
  int e = 0;
  const double m = std::frexp(s, &e);  // s = m * 2^e, m in [0.5, 1)
  const auto mantissa = static_cast<uint64_t>(std::ldexp(m, 53));  // exact: 53 bits
  const int bit = e - 53 - kLowestExponent;                         // s = mantissa * 2^(bit+low)
  const unsigned __int128 shifted = static_cast<unsigned __int128>(mantissa) << (bit % 32);
  const int limb = bit / 32;
  limbs_[limb] += static_cast<int64_t>(shifted & 0xffffffffu);
  limbs_[limb + 1] += static_cast<int64_t>((shifted >> 32) & 0xffffffffu);
  limbs_[limb + 2] += static_cast<int64_t>(shifted >> 64);
  if (++pending_ >= (int64_t{1} << 30)) Normalize();
}

void ExactSquareSum::Normalize() {
  for (int i = 0; i + 1 < kLimbs; ++i) {
    limbs_[i + 1] += limbs_[i] >> 32;
    limbs_[i] &= 0xffffffff;
  }
  pending_ = 0;
}

void ExactSquareSum::Add(const at::Tensor& t) {
  TORCH_CHECK(t.defined() && t.is_floating_point(),
              "deterministic: the exact sum of squares takes floating-point tensors");
  at::Tensor flat = t.reshape({-1});
  constexpr int64_t kChunk = int64_t{1} << 20;
  for (int64_t begin = 0; begin < flat.numel(); begin += kChunk) {
    const int64_t n = std::min(kChunk, flat.numel() - begin);
    at::Tensor chunk = flat.narrow(0, begin, n).to(at::kCPU, at::kDouble).contiguous();
    const double* p = chunk.data_ptr<double>();
    for (int64_t i = 0; i < n; ++i) AddDouble(p[i]);
  }
}

void ExactSquareSum::AllReduce(comm::Communicator& comm, const std::string& what) {
  Normalize();
  if (comm.size() == 1) return;
  std::vector<int64_t> send(limbs_.begin(), limbs_.end());
  send.push_back(nan_);
  send.push_back(inf_);
  std::vector<int64_t> recv(send.size());
  const comm::ConstBuffer sb{send.data(), send.size(), comm::DataType::kI64, comm::Device::Cpu()};
  const comm::Buffer rb{recv.data(), recv.size(), comm::DataType::kI64, comm::Device::Cpu()};
  base::ThrowIfError(comm.AllReduce(sb, rb, comm::ReduceOp::kSum).Wait(),
                     Context(comm, what, "sum of squares"));
  std::copy(recv.begin(), recv.begin() + kLimbs, limbs_.begin());
  nan_ = recv[kLimbs];
  inf_ = recv[kLimbs + 1];
  Normalize();
}

double ExactSquareSum::value() const {
  if (nan_ > 0) return std::numeric_limits<double>::quiet_NaN();
  if (inf_ > 0) return std::numeric_limits<double>::infinity();
  ExactSquareSum copy = *this;
  copy.Normalize();
  double r = 0;
  for (int i = kLimbs - 1; i >= 0; --i) {
    if (copy.limbs_[i] != 0) {
      r += std::ldexp(static_cast<double>(copy.limbs_[i]), 32 * i + kLowestExponent);
    }
  }
  return r;
}

double ExactSquareSum::norm() const { return std::sqrt(value()); }

}  // namespace fairscale::deterministic
