// The comm conformance suite (//comm/testing:conformance): the behaviour that communicator.h
// promises, checked once for every backend. Each backend instantiates it in a test of its own,
// per rank runner:
//
//   // comm/testing/tcp_conformance_test.cc, deps: //comm/testing:conformance, //comm/tcp,
//   // @gtest//:gmock_main
//   #include "comm/testing/conformance.h"
//   FS_INSTANTIATE_COMM_CONFORMANCE(Tcp, "tcp", kThreads);
//
// which creates the tests "Tcp/CommConformance.<Case>/ws<N>" for world sizes 1-4 (results of
// every collective, every dtype and reduce op, counts 0, 1, 7, 4097, 1<<20 and one 64 MiB
// message, in-place and out-of-place, send/recv and BatchP2P, barrier, Split, argument errors)
// and
// "Tcp/CommFailureConformance.<Case>/ws<N>" for world sizes 2-3 (count and op mismatch between
// ranks, a rank that skips an op, Abort with a collective or receives pending, a peer SIGKILLed
// mid-operation with the process runner; every rank fails in time and the communicator stays
// broken). Failure tests synchronize through the store, never through the backend under test. Expected values come from a reference computed in
// the test (comm/testing/reference.h), never from a backend; all but kAvg are compared
// bit-exactly, and results that every rank must share are compared across ranks.
//
// The backend must be linked into the test (its target has alwayslink = 1) and is created with
// CreateCommunicator(backend, RankConfig(timeout)).
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "comm/testing/rank_runner.h"
#include "gtest/gtest.h"

namespace fairscale::comm::testing {

struct ConformanceParam {
  std::string backend;
  RunnerKind runner = RunnerKind::kThreads;
  int world_size = 1;
};
void PrintTo(const ConformanceParam& param, std::ostream* os);

// Parameters of CommConformance (world sizes 1-4) and CommFailureConformance (2-3).
std::vector<ConformanceParam> ConformanceParams(const std::string& backend, RunnerKind runner);
std::vector<ConformanceParam> FailureConformanceParams(const std::string& backend,
                                                       RunnerKind runner);
// "ws<N>".
std::string ConformanceParamName(const ::testing::TestParamInfo<ConformanceParam>& info);

// Fixtures; their TEST_Ps live in conformance.cc.
class CommConformance : public ::testing::TestWithParam<ConformanceParam> {};
class CommFailureConformance : public ::testing::TestWithParam<ConformanceParam> {};

}  // namespace fairscale::comm::testing

// Instantiates the whole suite for `backend` (a registered backend name) run by `runner`
// (kThreads or kProcesses). `prefix` names the instantiation and must be unique in the binary.
#define FS_INSTANTIATE_COMM_CONFORMANCE(prefix, backend, runner)                            \
  using ::fairscale::comm::testing::CommConformance;                                        \
  using ::fairscale::comm::testing::CommFailureConformance;                                 \
  INSTANTIATE_TEST_SUITE_P(                                                                 \
      prefix, CommConformance,                                                              \
      ::testing::ValuesIn(::fairscale::comm::testing::ConformanceParams(                    \
          backend, ::fairscale::comm::testing::RunnerKind::runner)),                        \
      ::fairscale::comm::testing::ConformanceParamName);                                    \
  INSTANTIATE_TEST_SUITE_P(                                                                 \
      prefix, CommFailureConformance,                                                       \
      ::testing::ValuesIn(::fairscale::comm::testing::FailureConformanceParams(             \
          backend, ::fairscale::comm::testing::RunnerKind::runner)),                        \
      ::fairscale::comm::testing::ConformanceParamName)
