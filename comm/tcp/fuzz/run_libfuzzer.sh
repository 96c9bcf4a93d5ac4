#!/usr/bin/env bash
# Builds comm/tcp/fuzz/tcp_transport_fuzz.cc with clang's libFuzzer + ASan + UBSan and fuzzes the
# tcp backend's receive path (a real TcpTransport against fuzzer-written peer bytes) on one core.
#
#   comm/tcp/fuzz/run_libfuzzer.sh [SECONDS] [extra libFuzzer flags...]
#   comm/tcp/fuzz/run_libfuzzer.sh 0 -runs=10000000
#
# The seeds in comm/tcp/fuzz/corpus are read, never written; working corpus and crashes under
# $FS_FUZZ_OUT (default /tmp/fs_tcp_fuzz); see base/libfuzzer.sh.
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/../../../base/libfuzzer.sh"
fs_fuzz_init tcp_transport_fuzz /tmp/fs_tcp_fuzz "$@"
r="$FS_FUZZ_ROOT"
fs_fuzz_build "$here/tcp_transport_fuzz.cc" "$r/comm/tcp/tcp_transport.cc" \
  "$r/comm/tcp/tcp_transport_errors.cc" "$r/comm/tcp/internal/mesh.cc" \
  "$r/comm/tcp/internal/same_host.cc" "$r/comm/tcp/internal/socket.cc" \
  "$r/comm/tcp/internal/transport_for_testing.cc" "$r/comm/algorithms/transport.cc" \
  "$r/comm/communicator.cc" "$r/comm/types.cc" "$r/comm/work.cc" "$r/base/logging.cc" \
  -lglog -lgflags
# -max_len: a few frames exercise every branch; the header fields are what the transport must
# distrust. -rss_limit_mb (2048, base/libfuzzer.sh) catches a hostile length turned into memory.
fs_fuzz_run -max_len=4096 -- "$here/corpus"
