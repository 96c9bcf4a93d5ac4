#include "comm/testing/counting_communicator.h"

#include <utility>

namespace fairscale::comm::testing {

CountingCommunicator::CountingCommunicator(std::shared_ptr<Communicator> inner)
    : ForwardingCommunicator(std::move(inner), "counting") {}

CountingCommunicator::Count CountingCommunicator::count(OpType type) const {
  absl::MutexLock lock(&mu_);
  auto it = counts_.find(type);
  return it == counts_.end() ? Count{} : it->second;
}

void CountingCommunicator::Reset() {
  absl::MutexLock lock(&mu_);
  counts_.clear();
}

Work CountingCommunicator::Forward(const OpContext& ctx, const OpInfo& info,
                                   const std::function<Work()>& issue) {
  {
    absl::MutexLock lock(&mu_);
    Count& c = counts_[ctx.type];
    ++c.ops;
    c.bytes += static_cast<int64_t>(info.bytes);
  }
  return issue();
}

}  // namespace fairscale::comm::testing
