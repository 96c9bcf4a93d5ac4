#include "sync_batchnorm/sync_batchnorm.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/functional/batchnorm.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <ios>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/torch_error.h"
#include "comm/torch/tensor_buffer.h"

namespace fairscale::sync_batchnorm {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// "sync_batchnorm::SyncBatchNorm::forward rank 1/4 x [3, 4, 5]"
std::string What(const char* function, const comm::Communicator& comm, const at::Tensor& x) {
  return absl::StrCat("sync_batchnorm::SyncBatchNorm::", function, " rank ", comm.rank(), "/",
                      comm.size(), " x ",
                      x.defined() ? absl::StrCat("[", absl::StrJoin(x.sizes(), ", "), "]")
                                  : std::string("(undefined)"));
}

[[noreturn]] void Fail(absl::Status status, const std::string& what) {
  base::ThrowIfError(status, what);
  TORCH_INTERNAL_ASSERT(false, "unreachable");
}

// The sum over the ranks of a contiguous f64 vector, in place.
void AllReduceSum(at::Tensor& v, comm::Communicator& comm, const std::string& what) {
  comm::Buffer buffer = base::ValueOrThrow(comm::ToBuffer(v), what);
  comm::ConstBuffer send{buffer.data, buffer.count, buffer.dtype, buffer.device};
  base::ThrowIfError(comm.AllReduce(send, buffer, comm::ReduceOp::kSum).Wait(), what);
}

// Every dimension but the channel dimension (1).
std::vector<int64_t> ReduceDims(const at::Tensor& x) {
  std::vector<int64_t> dims = {0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

// [C] -> [1, C, 1, ...] for broadcasting against x.
at::Tensor Channel(const at::Tensor& v, const at::Tensor& x) {
  std::vector<int64_t> shape(x.dim(), 1);
  shape[1] = v.size(0);
  return v.reshape(shape);
}

// The communicator, held by reference in the autograd graph until backward (the module keeps
// the shared_ptr; the header asks comm to outlive the backward pass).
struct CommRef : torch::CustomClassHolder {
  explicit CommRef(comm::Communicator* c) : comm(c) {}
  comm::Communicator* comm;
};

// Without affine, weight and bias are passed as empty tensors (undefined tensors are not
// accepted as inputs of a custom Function in LibTorch 1.13: "tensor does not have a device").
bool Affine(const at::Tensor& t) { return t.numel() > 0; }

// y = (x - mean) * invstd * weight + bias with the batch's mean and invstd ([C], x's dtype);
// backward as in the header. Inputs: x, weight, bias (empty when !affine), mean, invstd.
class SyncBatchNormFunction : public torch::autograd::Function<SyncBatchNormFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, const at::Tensor& mean,
                            const at::Tensor& invstd, double count, comm::Communicator* comm) {
    ctx->saved_data["comm"] = c10::IValue::make_capsule(c10::make_intrusive<CommRef>(comm));
    ctx->saved_data["count"] = count;
    ctx->save_for_backward({x, weight, mean, invstd});
    at::Tensor scale = Channel(invstd, x);
    if (Affine(weight)) scale = scale * Channel(weight.to(x.scalar_type()), x);
    at::Tensor y = (x - Channel(mean, x)) * scale;
    if (Affine(bias)) y = y + Channel(bias.to(x.scalar_type()), x);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& mean = saved[2];
    const at::Tensor& invstd = saved[3];
    const at::Tensor& dy = grads[0];
    variable_list result(7);
    if (!dy.defined()) return result;
    comm::Communicator& comm =
        *c10::static_intrusive_pointer_cast<CommRef>(ctx->saved_data["comm"].toCapsule())->comm;
    const double count = ctx->saved_data["count"].toDouble();
    const std::vector<int64_t> dims = ReduceDims(x);
    const at::Tensor xhat = (x - Channel(mean, x)) * Channel(invstd, x);
    // This rank's sums, accumulated in f64 (zeros on an empty rank).
    const at::Tensor sum_dy = at::sum(dy, dims, /*keepdim=*/false, at::kDouble);
    const at::Tensor sum_dy_xhat = at::sum(dy * xhat, dims, /*keepdim=*/false, at::kDouble);
    if (ctx->needs_input_grad(0)) {
      at::Tensor v = at::cat({sum_dy, sum_dy_xhat});
      AllReduceSum(v, comm, What("backward", comm, x));
      const int64_t c = sum_dy.size(0);
      const at::Tensor mean_dy = (v.narrow(0, 0, c) / count).to(x.scalar_type());
      const at::Tensor mean_dy_xhat = (v.narrow(0, c, c) / count).to(x.scalar_type());
      at::Tensor scale = Channel(invstd, x);
      if (Affine(weight)) scale = scale * Channel(weight.to(x.scalar_type()), x);
      result[0] = scale * (dy - Channel(mean_dy, x) - xhat * Channel(mean_dy_xhat, x));
    }
    if (Affine(weight) && ctx->needs_input_grad(1)) {
      result[1] = sum_dy_xhat.to(weight.scalar_type());
    }
    if (Affine(weight) && ctx->needs_input_grad(2)) result[2] = sum_dy.to(dy.scalar_type());
    return result;
  }
};

}  // namespace

SyncBatchNormOptions::SyncBatchNormOptions(const torch::nn::BatchNormOptions& bn)
    : num_features_(bn.num_features()),
      eps_(bn.eps()),
      momentum_(bn.momentum()),
      affine_(bn.affine()),
      track_running_stats_(bn.track_running_stats()) {}

SyncBatchNormImpl::SyncBatchNormImpl(const SyncBatchNormOptions& options_,
                                     std::shared_ptr<comm::Communicator> comm)
    : SyncBatchNormImpl(options_, std::move(comm), NoReset()) {
  reset();
}

SyncBatchNormImpl::SyncBatchNormImpl(const SyncBatchNormOptions& options_,
                                     std::shared_ptr<comm::Communicator> comm, NoReset)
    : options(options_), comm_(std::move(comm)) {
  if (comm_ == nullptr) {
    Fail(absl::InvalidArgumentError("the communicator is null"),
         "sync_batchnorm::SyncBatchNorm");
  }
  if (options.num_features() <= 0) {
    Fail(absl::InvalidArgumentError(
             absl::StrCat("num_features must be positive, got ", options.num_features())),
         "sync_batchnorm::SyncBatchNorm");
  }
}

void SyncBatchNormImpl::reset() {
  const int64_t c = options.num_features();
  if (options.affine()) {
    weight = register_parameter("weight", torch::empty({c}));
    bias = register_parameter("bias", torch::empty({c}));
  } else {
    weight = register_parameter("weight", at::Tensor(), /*requires_grad=*/false);
    bias = register_parameter("bias", at::Tensor(), /*requires_grad=*/false);
  }
  if (options.track_running_stats()) {
    running_mean = register_buffer("running_mean", torch::zeros({c}));
    running_var = register_buffer("running_var", torch::ones({c}));
    num_batches_tracked =
        register_buffer("num_batches_tracked", torch::tensor(0, torch::dtype(torch::kLong)));
  } else {
    running_mean = register_buffer("running_mean", at::Tensor());
    running_var = register_buffer("running_var", at::Tensor());
    num_batches_tracked = register_buffer("num_batches_tracked", at::Tensor());
  }
  reset_parameters();
}

void SyncBatchNormImpl::reset_running_stats() {
  if (!options.track_running_stats()) return;
  torch::NoGradGuard no_grad;
  running_mean.zero_();
  running_var.fill_(1);
  num_batches_tracked.zero_();
}

void SyncBatchNormImpl::reset_parameters() {
  reset_running_stats();
  if (!options.affine()) return;
  torch::NoGradGuard no_grad;
  weight.fill_(1);
  bias.zero_();
}

void SyncBatchNormImpl::adopt(const at::Tensor& w, const at::Tensor& b, const at::Tensor& rm,
                              const at::Tensor& rv, const at::Tensor& nbt) {
  // The tensors themselves (not copies), registered as BatchNorm's reset() does.
  weight = register_parameter("weight", w, /*requires_grad=*/w.defined() && w.requires_grad());
  bias = register_parameter("bias", b, /*requires_grad=*/b.defined() && b.requires_grad());
  running_mean = register_buffer("running_mean", rm);
  running_var = register_buffer("running_var", rv);
  num_batches_tracked = register_buffer("num_batches_tracked", nbt);
}

at::Tensor SyncBatchNormImpl::forward(const at::Tensor& x) {
  comm::Communicator& comm = *comm_;
  if (!x.defined()) {
    Fail(absl::InvalidArgumentError("the input is undefined"), What("forward", comm, x));
  }
  if (x.dim() < 2) {
    Fail(absl::InvalidArgumentError(absl::StrCat(
             "expected an input of 2 or more dimensions [N, C, *], got ", x.dim())),
         What("forward", comm, x));
  }
  const int64_t c = options.num_features();
  if (x.size(1) != c) {
    Fail(absl::InvalidArgumentError(absl::StrCat("expected ", c, " channels (dim 1), got ",
                                                 x.size(1))),
         What("forward", comm, x));
  }

  if (!is_training() && options.track_running_stats()) {
    // The running statistics: no communication.
    return torch::nn::functional::detail::batch_norm(x, running_mean, running_var, weight, bias,
                                                     /*training=*/false, /*momentum=*/0.0,
                                                     options.eps());
  }

  // The batch's statistics: one all-reduce of [sum, sumsq, count] in f64.
  at::Tensor mean, invstd;
  double count = 0;
  {
    torch::NoGradGuard no_grad;
    // In f64 (a temporary copy of x for narrower types): var = E[x^2] - mean^2 cancels, and
    // squares rounded to f32 cost up to ~1e-7 * E[x^2] / var relative error in var.
    const at::Tensor xd = x.detach().to(at::kDouble);
    const std::vector<int64_t> dims = ReduceDims(xd);
    const at::Tensor sum = at::sum(xd, dims);
    const at::Tensor sumsq = at::sum(xd * xd, dims);
    const double local_count = static_cast<double>(x.numel() / c);
    at::Tensor v = at::cat({sum, sumsq, at::full({1}, local_count, sum.options())});
    AllReduceSum(v, comm, What("forward", comm, x));
    count = v[2 * c].item<double>();
    if (count <= 1) {
      Fail(absl::InvalidArgumentError(absl::StrCat(
               "expected more than 1 value per channel when training, got ", count,
               " over the ", comm.size(), " ranks")),
           What("forward", comm, x));
    }
    const at::Tensor mean_d = v.narrow(0, 0, c) / count;
    const at::Tensor var_d = (v.narrow(0, c, c) / count - mean_d * mean_d).clamp_min(0);
    mean = mean_d.to(x.scalar_type());
    invstd = (var_d + options.eps()).rsqrt().to(x.scalar_type());

    if (is_training() && options.track_running_stats()) {
      num_batches_tracked += 1;
      const double f = options.momentum().has_value()
                           ? *options.momentum()
                           : 1.0 / num_batches_tracked.item<double>();
      running_mean.mul_(1 - f).add_(mean_d.to(running_mean.scalar_type()), f);
      running_var.mul_(1 - f).add_((var_d * (count / (count - 1))).to(running_var.scalar_type()),
                                   f);
    }
  }
  const at::Tensor none = at::empty({0}, x.options());
  return SyncBatchNormFunction::apply(x, options.affine() ? weight : none,
                                      options.affine() ? bias : none, mean, invstd, count, &comm);
}

void SyncBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "fairscale::sync_batchnorm::SyncBatchNorm(" << options.num_features()
         << ", eps=" << options.eps() << ", momentum=";
  if (options.momentum().has_value()) {
    stream << *options.momentum();
  } else {
    stream << "None";
  }
  stream << std::boolalpha << ", affine=" << options.affine()
         << ", track_running_stats=" << options.track_running_stats() << ", world=" << comm_->size()
         << ")";
}

namespace {

// A SyncBatchNorm for `m` when it is a torch::nn::BatchNorm1d/2d/3d, else null.
SyncBatchNorm Convert(const std::shared_ptr<torch::nn::Module>& m,
                      const std::shared_ptr<comm::Communicator>& comm) {
  if (auto* bn = dynamic_cast<torch::nn::BatchNorm1dImpl*>(m.get())) {
    return SyncBatchNorm(*bn, comm);
  }
  if (auto* bn = dynamic_cast<torch::nn::BatchNorm2dImpl*>(m.get())) {
    return SyncBatchNorm(*bn, comm);
  }
  if (auto* bn = dynamic_cast<torch::nn::BatchNorm3dImpl*>(m.get())) {
    return SyncBatchNorm(*bn, comm);
  }
  return SyncBatchNorm(nullptr);
}

void ConvertChildren(torch::nn::Module& parent, const std::string& path,
                     const std::shared_ptr<comm::Communicator>& comm) {
  const auto children = parent.named_children();
  for (size_t i = 0; i < children.size(); ++i) {
    const std::string& name = children[i].key();
    const std::string child_path = path.empty() ? name : absl::StrCat(path, ".", name);
    std::shared_ptr<torch::nn::Module> old = children[i].value();
    SyncBatchNorm replacement = Convert(old, comm);
    if (replacement.is_empty()) {
      ConvertChildren(*old, child_path, comm);
      continue;
    }
    parent.replace_module(name, replacement.ptr());
    // The containers call their children through their own lists: child i of named_children()
    // is entry i of the list.
    if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&parent)) {
      *(seq->begin() + i) = torch::nn::AnyModule(replacement);
    } else if (auto* list = dynamic_cast<torch::nn::ModuleListImpl*>(&parent)) {
      *(list->begin() + i) = replacement.ptr();
    } else if (auto* dict = dynamic_cast<torch::nn::ModuleDictImpl*>(&parent)) {
      (dict->begin() + i)->value() = replacement.ptr();
    }
    // Held by `children` and `old` only, unless something outside the tree still has it.
    if (old.use_count() > 2) {
      TORCH_WARN("sync_batchnorm::convert_sync_batchnorm: '", child_path,
                 "' was replaced by a SyncBatchNorm, but the old BatchNorm is still referenced ",
                 old.use_count() - 2,
                 " more time(s), e.g. by a typed member of its parent; a forward that calls it "
                 "through that member keeps running the unsynchronized BatchNorm "
                 "(sync_batchnorm/sync_batchnorm.h)");
    }
  }
}

}  // namespace

std::shared_ptr<torch::nn::Module> convert_sync_batchnorm(
    std::shared_ptr<torch::nn::Module> root, std::shared_ptr<comm::Communicator> comm) {
  if (root == nullptr || comm == nullptr) {
    Fail(absl::InvalidArgumentError(root == nullptr ? "the module is null"
                                                    : "the communicator is null"),
         "sync_batchnorm::convert_sync_batchnorm");
  }
  SyncBatchNorm converted = Convert(root, comm);
  if (!converted.is_empty()) return converted.ptr();
  ConvertChildren(*root, "", comm);
  return root;
}

}  // namespace fairscale::sync_batchnorm
