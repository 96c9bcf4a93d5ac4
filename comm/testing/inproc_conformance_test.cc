// The conformance suite over the "inproc" backend, ranks as threads.
#include "comm/testing/conformance.h"

FS_INSTANTIATE_COMM_CONFORMANCE(Inproc, "inproc", kThreads);
