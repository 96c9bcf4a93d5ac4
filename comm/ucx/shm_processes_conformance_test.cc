// The conformance suite over the "ucx" backend with UCX_TLS=posix,sysv,self, ranks as processes.
#include <cstdlib>

#include "comm/testing/conformance.h"

namespace {
// Before any ucp context exists; process ranks re-run this in their own static init.
[[maybe_unused]] const bool kTransportsChosen = setenv("UCX_TLS", "posix,sysv,self", /*overwrite=*/1) == 0;
}  // namespace

FS_INSTANTIATE_COMM_CONFORMANCE(UcxShmProcess, "ucx", kProcesses);
