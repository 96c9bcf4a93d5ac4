// The conformance suite over the "fake" backend (fake_backend.cc): checks the suite itself.
#include "comm/testing/conformance.h"

FS_INSTANTIATE_COMM_CONFORMANCE(Fake, "fake", kThreads);
