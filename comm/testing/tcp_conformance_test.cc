// The conformance suite over the "tcp" backend, ranks as threads of one process.
#include "comm/testing/conformance.h"

FS_INSTANTIATE_COMM_CONFORMANCE(Tcp, "tcp", kThreads);
