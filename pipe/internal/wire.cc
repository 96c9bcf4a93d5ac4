#include "pipe/internal/wire.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/torch/tensor_buffer.h"

namespace fairscale::pipe::internal {
namespace {

constexpr int64_t kMagic = 0x50495045;  // "PIPE"
constexpr int64_t kLayoutVersion = 2;  // 2: the skip count after the tensor count
constexpr int64_t kHeaderLen = 3;

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
  for (const TensorLayout& layout : layouts) {
    at::Tensor t = at::empty(layout.sizes, at::TensorOptions().dtype(WireType(layout.dtype)));
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

std::vector<int64_t> EncodeLayout(const BoundaryLayout& layout) {
  std::vector<int64_t> out = {kLayoutVersion, layout.is_list ? 1 : 0,
                              static_cast<int64_t>(layout.tensors.size()), layout.skips};
  for (const TensorLayout& t : layout.tensors) {
    out.push_back(static_cast<int64_t>(t.dtype));
    out.push_back(t.requires_grad ? 1 : 0);
    out.push_back(static_cast<int64_t>(t.sizes.size()));
    out.insert(out.end(), t.sizes.begin(), t.sizes.end());
  }
  return out;
}

absl::StatusOr<BoundaryLayout> DecodeLayout(const std::vector<int64_t>& in) {
  auto bad = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat("malformed activation layout (", in.size(),
                                            " words): ", what));
  };
  size_t pos = 0;
  auto next = [&](int64_t* v) {
    if (pos >= in.size()) return false;
    *v = in[pos++];
    return true;
  };
  int64_t version = 0, is_list = 0, n = 0, skips = 0;
  if (!next(&version)) return bad("truncated prefix");
  if (version != kLayoutVersion) return bad(absl::StrCat("version ", version));
  if (!next(&is_list) || !next(&n) || !next(&skips)) return bad("truncated prefix");
  if (skips < 0 || n < skips || (is_list == 0 && n != 1 + skips)) {
    return bad(absl::StrCat(n, " tensors with ", skips, " skips"));
  }
  BoundaryLayout layout;
  layout.is_list = is_list != 0;
  layout.skips = skips;
  for (int64_t i = 0; i < n; ++i) {
    int64_t dtype = 0, requires_grad = 0, ndim = 0;
    if (!next(&dtype) || !next(&requires_grad) || !next(&ndim)) return bad("truncated tensor");
    if (dtype < 0 || dtype >= static_cast<int64_t>(c10::ScalarType::NumOptions) || ndim < 0) {
      return bad(absl::StrCat("tensor ", i, " dtype ", dtype, " ndim ", ndim));
    }
    TensorLayout t;
    t.dtype = static_cast<c10::ScalarType>(dtype);
    t.requires_grad = requires_grad != 0;
    for (int64_t d = 0; d < ndim; ++d) {
      int64_t size = 0;
      if (!next(&size) || size < 0) return bad(absl::StrCat("tensor ", i, " sizes"));
      t.sizes.push_back(size);
    }
    layout.tensors.push_back(std::move(t));
  }
  if (pos != in.size()) return bad("trailing words");
  return layout;
}

std::string DescribeLayout(const BoundaryLayout& layout) {
  std::vector<std::string> parts;
  for (const TensorLayout& t : layout.tensors) {
    parts.push_back(absl::StrCat(c10::toString(t.dtype), "[", absl::StrJoin(t.sizes, ", "), "]",
                                 t.requires_grad ? " requires_grad" : ""));
  }
  const auto boundary = parts.begin() + static_cast<int64_t>(parts.size()) - layout.skips;
  std::string out = absl::StrCat(layout.is_list ? "list(" : "",
                                 absl::StrJoin(parts.begin(), boundary, ", "),
                                 layout.is_list ? ")" : "");
  if (layout.skips > 0) {
    absl::StrAppend(&out, " + ", layout.skips, " skips (", absl::StrJoin(boundary, parts.end(), ", "),
                    ")");
  }
  return out;
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
    encoded = EncodeLayout(layout);
    last_layout_ = std::move(layout);
  }
  at::Tensor header = at::empty({kHeaderLen}, at::TensorOptions().dtype(at::kLong));
  int64_t* h = header.data_ptr<int64_t>();
  h[0] = kMagic;
  h[1] = id;
  h[2] = static_cast<int64_t>(encoded.size());
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
      RecvTensor(comm_, peer_, TensorLayout{at::kLong, false, {kHeaderLen}}, timeout_, orphans_);
  if (!header.ok()) return WithContext(header.status(), "header");
  const int64_t* h = header->data_ptr<int64_t>();
  if (h[0] != kMagic || h[1] != id || h[2] < 0) {
    return absl::InternalError(absl::StrCat("expected the header of message ", id,
                                            ", got {", h[0], ", ", h[1], ", ", h[2], "}"));
  }
  if (h[2] > 0) {
    absl::StatusOr<at::Tensor> meta =
        RecvTensor(comm_, peer_, TensorLayout{at::kLong, false, {h[2]}}, timeout_, orphans_);
    if (!meta.ok()) return WithContext(meta.status(), "layout");
    const int64_t* m = meta->data_ptr<int64_t>();
    absl::StatusOr<BoundaryLayout> layout = DecodeLayout(std::vector<int64_t>(m, m + h[2]));
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
