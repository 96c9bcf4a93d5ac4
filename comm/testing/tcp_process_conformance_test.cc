// The conformance suite over the "tcp" backend, ranks as processes (adds the SIGKILLed-peer
// case).
#include "comm/testing/conformance.h"

FS_INSTANTIATE_COMM_CONFORMANCE(TcpProcess, "tcp", kProcesses);
