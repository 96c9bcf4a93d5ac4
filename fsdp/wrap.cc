#include "fsdp/wrap.h"

#include <set>

namespace fairscale::fsdp {
namespace {

// The innermost scope of this thread; each rank thread builds its own model.
thread_local EnableWrap* current_scope = nullptr;

// `ignored`: modules whose parameters do not count (FsdpOptions::ignored_modules).
void CountUnwrapped(const torch::nn::Module& m, const std::set<const torch::nn::Module*>& ignored,
                    std::set<const c10::TensorImpl*>& seen, int64_t& numel) {
  if (ignored.count(&m)) return;
  for (const auto& item : m.named_parameters(/*recurse=*/false)) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) numel += item.value().numel();
  }
  for (const auto& child : m.children()) {
    // A nested unit's parameters() are its shards: what it owns is no longer this module's.
    if (dynamic_cast<const FullyShardedDataParallelImpl*>(child.get()) != nullptr) continue;
    CountUnwrapped(*child, ignored, seen, numel);
  }
}

// Every module below `m` (not `m`), nested units' wrapped modules included.
void Descendants(const torch::nn::Module& m, std::set<const torch::nn::Module*>& out) {
  for (const auto& child : m.children()) {
    out.insert(child.get());
    if (const auto* unit = dynamic_cast<const FullyShardedDataParallelImpl*>(child.get())) {
      out.insert(unit->module().get());
      Descendants(*unit->module(), out);
    } else {
      Descendants(*child, out);
    }
  }
}

}  // namespace

class WrapAccess {
 public:
  static EnableWrap* Current() { return current_scope; }
  static const std::shared_ptr<comm::Communicator>& Comm(const EnableWrap& s) { return s.comm_; }
  static const FsdpOptions& Options(const EnableWrap& s) { return s.options_; }
  static const AutoWrapPolicy& Policy(const EnableWrap& s) { return s.policy_; }
};

AutoWrapPolicy size_based_auto_wrap_policy(int64_t min_num_params) {
  return
      [min_num_params](const torch::nn::Module&, int64_t numel) { return numel >= min_num_params; };
}

EnableWrap::EnableWrap(std::shared_ptr<comm::Communicator> comm, FsdpOptions options,
                       AutoWrapPolicy policy)
    : comm_(std::move(comm)),
      options_(std::move(options)),
      policy_(std::move(policy)),
      previous_(current_scope) {
  TORCH_CHECK(comm_ != nullptr, "fsdp::EnableWrap: the communicator is null");
  current_scope = this;
}

EnableWrap::~EnableWrap() {
  // Scopes are RAII objects on one thread's stack, so they end in reverse order.
  current_scope = previous_;
}

int64_t unwrapped_numel(const torch::nn::Module& module) {
  std::set<const c10::TensorImpl*> seen;
  int64_t numel = 0;
  CountUnwrapped(module, {}, seen, numel);
  return numel;
}

Wrapped wrap_any(torch::nn::AnyModule module) {
  TORCH_CHECK(!module.is_empty(), "fsdp::wrap: the module is empty");
  Wrapped out;
  out.ptr_ = module.ptr();
  const EnableWrap* scope = WrapAccess::Current();
  bool wrap = false;
  FsdpOptions options;
  if (scope != nullptr) {
    // FsdpOptions::ignored_modules: an ignored module is never wrapped, its parameters do not
    // count for the policy, and the unit gets the ignored modules that lie inside it.
    options = WrapAccess::Options(*scope);
    std::set<const torch::nn::Module*> ignored;
    for (const auto& m : options.ignored_modules()) ignored.insert(m.get());
    std::set<const c10::TensorImpl*> seen;
    int64_t numel = 0;
    CountUnwrapped(*out.ptr_, ignored, seen, numel);
    wrap = !ignored.count(out.ptr_.get()) &&
           (!WrapAccess::Policy(*scope) || WrapAccess::Policy(*scope)(*out.ptr_, numel));
    if (wrap && !ignored.empty()) {
      std::set<const torch::nn::Module*> inside;
      Descendants(*out.ptr_, inside);
      std::vector<std::shared_ptr<torch::nn::Module>> mine;
      for (const auto& m : options.ignored_modules()) {
        if (inside.count(m.get())) mine.push_back(m);
      }
      options.ignored_modules(std::move(mine));
    }
  }
  if (wrap) {
    out.unit_ = FullyShardedDataParallel(std::move(module), WrapAccess::Comm(*scope),
                                         std::move(options));
    out.ptr_ = out.unit_.ptr();
  } else {
    out.plain_ = std::move(module);
  }
  return out;
}

}  // namespace fairscale::fsdp
