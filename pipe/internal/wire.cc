#include "pipe/internal/wire.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <array>
#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/torch/tensor_buffer.h"

namespace fairscale::pipe::internal {
namespace {

// The dtype a tensor of `dtype` travels as (the comm layer has no bool).
c10::ScalarType WireType(c10::ScalarType dtype) {
  return dtype == c10::ScalarType::Bool ? c10::ScalarType::Byte : dtype;
}

absl::Status WithContext(const absl::Status& s, const std::string& context) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(context, ": ", s.message()));
}

// The tensor as it goes on the wire: detached, contiguous, bool as u8.
absl::StatusOr<at::Tensor> WireTensor(const at::Tensor& t) {
  at::Tensor w = t.detach();
  if (w.scalar_type() == c10::ScalarType::Bool) w = w.to(c10::ScalarType::Byte);
  w = w.contiguous();
  absl::StatusOr<comm::DataType> dtype = comm::ToDataType(w.scalar_type());
  if (!dtype.ok()) return dtype.status();
  return w;
}

absl::Status SendTensor(comm::Communicator* comm, int peer, const at::Tensor& t,
                        PendingSends* pending) {
  absl::StatusOr<comm::ConstBuffer> buffer = comm::ToConstBuffer(t);
  if (!buffer.ok()) return buffer.status();
  comm::Work work = comm->Send(*buffer, peer);
  pending->Add(std::move(work), t);
  return absl::OkStatus();
}

// Receives one tensor per layout (all issued at once, then waited for), into fresh tensors.
// On an error, names the index of the tensor that failed.
absl::StatusOr<std::vector<at::Tensor>> RecvTensors(comm::Communicator* comm, int peer,
                                                    const std::vector<TensorLayout>& layouts,
                                                    absl::Duration timeout,
                                                    const std::string& what, Orphans* orphans) {
  std::vector<at::Tensor> out;
  std::vector<comm::Work> works;
  for (size_t i = 0; i < layouts.size(); ++i) {
    const TensorLayout& layout = layouts[i];
    at::Tensor t;
    try {
      // The sizes come from a peer (bounded by DecodeLayout to fit int64 bytes, not memory).
      t = at::empty(layout.sizes, at::TensorOptions().dtype(WireType(layout.dtype)));
    } catch (const std::exception& e) {
      orphans->insert(orphans->end(), out.begin(), out.end());
      return absl::ResourceExhaustedError(
          absl::StrCat(what, " ", i, ": cannot allocate ", c10::toString(layout.dtype), "[",
                       absl::StrJoin(layout.sizes, ", "), "]: ", e.what()));
    }
    absl::StatusOr<comm::Buffer> buffer = comm::ToBuffer(t);
    if (!buffer.ok()) {
      orphans->insert(orphans->end(), out.begin(), out.end());
      return buffer.status();
    }
    works.push_back(comm->Recv(*buffer, peer));
    out.push_back(std::move(t));
  }
  absl::Status first;
  for (size_t i = 0; i < works.size(); ++i) {
    absl::Status s = works[i].Wait(timeout);
    if (first.ok() && !s.ok()) first = WithContext(s, absl::StrCat(what, " ", i));
  }
  if (!first.ok()) {
    // A receive that timed out may still write into its tensor.
    orphans->insert(orphans->end(), out.begin(), out.end());
    return first;
  }
  for (size_t i = 0; i < out.size(); ++i) {
    if (layouts[i].dtype == c10::ScalarType::Bool) out[i] = out[i].to(c10::ScalarType::Bool);
  }
  return out;
}

absl::StatusOr<at::Tensor> RecvTensor(comm::Communicator* comm, int peer,
                                      const TensorLayout& layout, absl::Duration timeout,
                                      Orphans* orphans) {
  absl::StatusOr<std::vector<at::Tensor>> t =
      RecvTensors(comm, peer, {layout}, timeout, "tensor", orphans);
  if (!t.ok()) return t.status();
  return std::move(t->at(0));
}

}  // namespace

BoundaryLayout LayoutOf(const Boundary& boundary) {
  BoundaryLayout layout;
  layout.is_list = boundary.is_list;
  layout.skips = boundary.skips;
  for (const at::Tensor& t : boundary.tensors) {
    layout.tensors.push_back(TensorLayout{t.scalar_type(), t.requires_grad(), t.sizes().vec()});
  }
  return layout;
}

PendingSends::~PendingSends() {
  orphans_->insert(orphans_->end(), keep_alive_.begin(), keep_alive_.end());
}

void PendingSends::Add(comm::Work work, at::Tensor keep_alive) {
  works_.push_back(std::move(work));
  keep_alive_.push_back(std::move(keep_alive));
}

absl::Status PendingSends::WaitAll(absl::Duration timeout) {
  absl::Status first;
  for (const comm::Work& w : works_) {
    absl::Status s = w.Wait(timeout);
    if (first.ok()) first = s;
  }
  // On a timeout the sends may still read their tensors: keep them (the caller aborts the
  // communicator, which ends them).
  if (!first.ok()) return first;
  works_.clear();
  keep_alive_.clear();
  return first;
}

absl::Status ActivationLink::Send(int64_t id, const Boundary& boundary,
                                  PendingSends* pending) {
  std::vector<at::Tensor> wire;
  for (size_t i = 0; i < boundary.tensors.size(); ++i) {
    absl::StatusOr<at::Tensor> w = WireTensor(boundary.tensors[i]);
    if (!w.ok()) return WithContext(w.status(), absl::StrCat("activation ", i));
    wire.push_back(*std::move(w));
  }
  BoundaryLayout layout = LayoutOf(boundary);
  std::vector<int64_t> encoded;
  if (!last_layout_.has_value() || !(*last_layout_ == layout)) {
    absl::Status valid = CheckLayout(layout);
    if (!valid.ok()) return valid;
    encoded = EncodeLayout(layout);
    last_layout_ = std::move(layout);
  }
  at::Tensor header = at::empty({kHeaderWords}, at::TensorOptions().dtype(at::kLong));
  const std::array<int64_t, kHeaderWords> h = EncodeHeader(id, static_cast<int64_t>(encoded.size()));
  std::copy(h.begin(), h.end(), header.data_ptr<int64_t>());
  absl::Status s = SendTensor(comm_, peer_, header, pending);
  if (s.ok() && !encoded.empty()) {
    at::Tensor meta = at::empty({static_cast<int64_t>(encoded.size())},
                                at::TensorOptions().dtype(at::kLong));
    std::copy(encoded.begin(), encoded.end(), meta.data_ptr<int64_t>());
    s = SendTensor(comm_, peer_, meta, pending);
  }
  for (const at::Tensor& t : wire) {
    if (!s.ok()) break;
    s = SendTensor(comm_, peer_, t, pending);
  }
  return s;
}

absl::StatusOr<Boundary> ActivationLink::Recv(int64_t id) {
  absl::StatusOr<at::Tensor> header =
      RecvTensor(comm_, peer_, TensorLayout{at::kLong, false, {kHeaderWords}}, timeout_, orphans_);
  if (!header.ok()) return WithContext(header.status(), "header");
  std::array<int64_t, kHeaderWords> h;
  std::copy_n(header->data_ptr<int64_t>(), kHeaderWords, h.begin());
  // meta_len is bounded (kMaxLayoutWords) before the layout's buffer is allocated.
  absl::StatusOr<int64_t> meta_len = CheckHeader(h, id);
  if (!meta_len.ok()) return meta_len.status();
  if (*meta_len > 0) {
    absl::StatusOr<at::Tensor> meta =
        RecvTensor(comm_, peer_, TensorLayout{at::kLong, false, {*meta_len}}, timeout_, orphans_);
    if (!meta.ok()) return WithContext(meta.status(), "layout");
    const int64_t* m = meta->data_ptr<int64_t>();
    absl::StatusOr<BoundaryLayout> layout = DecodeLayout(std::vector<int64_t>(m, m + *meta_len));
    if (!layout.ok()) return layout.status();
    last_layout_ = *std::move(layout);
  } else if (!last_layout_.has_value()) {
    return absl::InternalError("the first activation header carries no layout");
  }
  absl::StatusOr<std::vector<at::Tensor>> tensors =
      RecvTensors(comm_, peer_, last_layout_->tensors, timeout_, "activation", orphans_);
  if (!tensors.ok()) {
    return WithContext(tensors.status(), absl::StrCat("activations ", DescribeLayout(*last_layout_)));
  }
  Boundary out;
  out.is_list = last_layout_->is_list;
  out.skips = last_layout_->skips;
  out.tensors = *std::move(tensors);
  for (size_t i = 0; i < out.tensors.size(); ++i) {
    const TensorLayout& layout = last_layout_->tensors[i];
    if (layout.requires_grad && at::isFloatingType(layout.dtype)) {
      out.tensors[i].requires_grad_(true);
    }
  }
  return out;
}

absl::Status SendGradients(comm::Communicator* comm, int peer,
                           const std::vector<TensorLayout>& layouts,
                           const std::vector<at::Tensor>& grads, PendingSends* pending) {
  for (size_t i = 0; i < layouts.size(); ++i) {
    const TensorLayout& layout = layouts[i];
    at::Tensor g = i < grads.size() ? grads[i] : at::Tensor();
    if (!g.defined()) {
      g = at::zeros(layout.sizes, at::TensorOptions().dtype(layout.dtype));
    } else if (g.scalar_type() != layout.dtype) {
      g = g.to(layout.dtype);
    }
    absl::StatusOr<at::Tensor> w = WireTensor(g);
    if (!w.ok()) return WithContext(w.status(), absl::StrCat("gradient ", i));
    absl::Status s = SendTensor(comm, peer, *w, pending);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<at::Tensor>> RecvGradients(comm::Communicator* comm, int peer,
                                                      const std::vector<TensorLayout>& layouts,
                                                      absl::Duration timeout, Orphans* orphans) {
  return RecvTensors(comm, peer, layouts, timeout, "gradient", orphans);
}

}  // namespace fairscale::pipe::internal
