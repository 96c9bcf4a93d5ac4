#include "moe/moe_layer.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/einsum.h>

#include <cstdlib>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "autograd_comm/collectives.h"
#include "base/torch_error.h"

namespace fairscale::moe {
namespace {

[[noreturn]] void Fail(const std::string& context, const std::string& message) {
  base::ThrowIfError(absl::InvalidArgumentError(message), context);
  std::abort();  // unreachable: ThrowIfError raised
}

}  // namespace

MOELayerImpl::MOELayerImpl(std::shared_ptr<GateImpl> gate,
                           std::vector<torch::nn::AnyModule> experts,
                           std::shared_ptr<comm::Communicator> comm)
    : gate_(std::move(gate)), expert_modules_(std::move(experts)), comm_(std::move(comm)) {
  const std::string context =
      comm_ ? absl::StrCat("moe::MOELayer rank ", comm_->rank(), "/", comm_->size())
            : std::string("moe::MOELayer");
  if (!gate_) Fail(context, "the gate is null");
  if (!comm_) Fail(context, "the communicator is null");
  if (expert_modules_.empty()) Fail(context, "no local experts");
  const int64_t n = comm_->size();
  const int64_t local = static_cast<int64_t>(expert_modules_.size());
  if (gate_->num_experts() != n * local) {
    Fail(context, absl::StrCat("the gate routes to ", gate_->num_experts(), " experts, but ", n,
                               " ranks x ", local, " local experts = ", n * local,
                               " (num_experts must equal the expert group's size times the "
                               "local experts)"));
  }
  register_module("gate", gate_);
  experts_ = register_module("experts", torch::nn::ModuleList());
  for (const torch::nn::AnyModule& expert : expert_modules_) {
    if (expert.is_empty()) Fail(context, "an expert is empty");
    experts_->push_back(expert.ptr());
  }
}

at::Tensor MOELayerImpl::forward(const at::Tensor& x) {
  const int64_t n = comm_->size();
  const int64_t local = num_local_experts();
  const int64_t m = gate_->model_dim();
  if (!x.defined() || x.dim() < 1 || x.size(-1) != m) {
    Fail(absl::StrCat("moe::MOELayer::forward rank ", comm_->rank(), "/", n),
         absl::StrCat("x ",
                      x.defined() ? absl::StrCat("[", absl::StrJoin(x.sizes(), ", "), "]")
                                  : std::string("undefined"),
                      ": the last dimension must be model_dim ", m));
  }
  const at::Tensor tokens = x.reshape({-1, m});
  GateOutput routed = gate_->forward(tokens);
  l_aux_ = routed.l_aux;
  const int64_t capacity = routed.combine_weights.size(2);

  // [E, C, M]: slot c of expert e holds its token (zero if empty).
  at::Tensor dispatched =
      at::einsum("sec,sm->ecm", {routed.dispatch_mask.to(tokens.scalar_type()), tokens});
  dispatched = autograd_comm::all_to_all(dispatched, *comm_);
  // Block i came from rank i: [n, L, C, M].
  dispatched = dispatched.reshape({n, local, capacity, m});
  std::vector<at::Tensor> outputs;
  outputs.reserve(local);
  for (int64_t l = 0; l < local; ++l) {
    at::Tensor rows = dispatched.select(1, l).reshape({n * capacity, m});
    at::Tensor y = expert_modules_[l].forward<at::Tensor>(rows);
    if (y.dim() != 2 || y.size(0) != n * capacity || y.size(1) != m) {
      Fail(absl::StrCat("moe::MOELayer::forward rank ", comm_->rank(), "/", n),
           absl::StrCat("local expert ", l, " returned [", absl::StrJoin(y.sizes(), ", "),
                        "] for input [", n * capacity, ", ", m, "]"));
    }
    outputs.push_back(y.reshape({n, 1, capacity, m}));
  }
  at::Tensor expert_output = at::cat(outputs, 1).reshape({n * local, capacity, m});
  expert_output = autograd_comm::all_to_all(expert_output, *comm_);
  const at::Tensor combined =
      at::einsum("sec,ecm->sm", {routed.combine_weights, expert_output});
  return combined.reshape(x.sizes());
}

std::vector<at::Tensor> MOELayerImpl::expert_parameters() const {
  return experts_->parameters();
}

std::vector<at::Tensor> MOELayerImpl::non_expert_parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& item : named_parameters()) {
    if (item.key().rfind("experts.", 0) != 0) out.push_back(item.value());
  }
  return out;
}

}  // namespace fairscale::moe
