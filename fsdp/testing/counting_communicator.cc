#include "fsdp/testing/counting_communicator.h"

#include <utility>

namespace fairscale::fsdp::testing {

CountingCommunicator::CountingCommunicator(std::shared_ptr<comm::Communicator> inner)
    : comm::ForwardingCommunicator(std::move(inner), "counting") {}

CountingCommunicator::Count CountingCommunicator::count(comm::OpType type) const {
  absl::MutexLock lock(&mu_);
  auto it = counts_.find(type);
  return it == counts_.end() ? Count{} : it->second;
}

void CountingCommunicator::Reset() {
  absl::MutexLock lock(&mu_);
  counts_.clear();
}

comm::Work CountingCommunicator::Forward(const comm::OpContext& ctx, const OpInfo& info,
                                         const std::function<comm::Work()>& issue) {
  {
    absl::MutexLock lock(&mu_);
    Count& c = counts_[ctx.type];
    ++c.ops;
    c.bytes += static_cast<int64_t>(info.bytes);
  }
  return issue();
}

}  // namespace fairscale::fsdp::testing
