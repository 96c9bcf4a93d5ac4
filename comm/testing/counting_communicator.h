// CountingCommunicator (testonly): a Communicator that forwards every operation to another one and
// counts operations and bytes per op type (Split included). The fsdp, oss and pipe tests wrap the
// inproc communicator in it to check that a training step moves exactly the bytes the theory
// says (e.g. FSDP FULL_SHARD 3x the parameter bytes, SHARD_GRAD_OP 2x, NO_SHARD one all-reduce
// of the gradients).
//
// Bytes counted per operation: all_gather and all_to_all the receive buffer (the full tensor);
// reduce_scatter, all_reduce, reduce and broadcast the send buffer; send/recv their buffer.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "comm/communicator.h"
#include "comm/forwarding_communicator.h"

namespace fairscale::comm::testing {

class CountingCommunicator : public ForwardingCommunicator {
 public:
  struct Count {
    int64_t ops = 0;
    int64_t bytes = 0;
  };

  explicit CountingCommunicator(std::shared_ptr<Communicator> inner);

  Count count(OpType type) const;
  void Reset();

 protected:
  Work Forward(const OpContext& ctx, const OpInfo& info,
               const std::function<Work()>& issue) override;

 private:
  mutable absl::Mutex mu_;
  std::map<OpType, Count> counts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fairscale::comm::testing
