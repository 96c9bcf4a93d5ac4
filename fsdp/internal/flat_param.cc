#include "fsdp/internal/flat_param.h"

#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>

#include <atomic>

namespace fairscale::fsdp::internal {
namespace {
std::atomic<bool> offload_on_cpu_for_testing{false};
}  // namespace

void SetOffloadOnCpuForTesting(bool on) { offload_on_cpu_for_testing = on; }
bool OffloadOnCpuForTesting() { return offload_on_cpu_for_testing; }

bool HasStorage(const at::Tensor& t) { return t.numel() == 0 || t.storage().data() != nullptr; }

void FreeStorage(const at::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  storage->set_nbytes(0);
}

void AllocateStorage(const at::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = (t.storage_offset() + t.numel()) * t.element_size();
  if (storage->nbytes() >= nbytes && (nbytes == 0 || storage->data() != nullptr)) return;
  TORCH_CHECK(storage->allocator() != nullptr, "fsdp: storage without an allocator");
  storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

}  // namespace fairscale::fsdp::internal
