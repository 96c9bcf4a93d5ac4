#!/bin/bash
# Runs the bundle made by make_bundle.sh on a GPU machine: NCCL from the machine itself (a
# libnccl.so.2 under /opt, /usr or /lib, e.g. PyTorch's nvidia-nccl wheel), the CUDA runtime from
# /usr/local/cuda/lib64 else the bundle's. With fewer than 4 GPUs the world sizes above the
# device count run as processes sharing the GPUs (FS_NCCL_TEST_SHARED_GPU=1, see nccl_test.cc).
# The full suite takes ~6 minutes on one H200 that way; pass gtest flags to run a part.
set -u
B=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$B}
exec > >(tee "$OUT/log.txt") 2>&1
date; nvidia-smi -L; head -1 /etc/os-release; ldd --version | head -1
NCCL_LIB=$(dirname "$(find /opt /usr /lib -name 'libnccl.so.2*' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH="$NCCL_LIB:/usr/local/cuda/lib64:$B/lib"
if ! "$B/registration_test" --gtest_brief=1 >/dev/null 2>&1; then
  echo "falling back to the bundle's libstdc++"; export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$B/fallback"
fi
ldd "$B/nccl_test" | grep -E "nccl|cudart|stdc|not found"
echo "=== registration_test"; timeout 60 "$B/registration_test" --gtest_color=no; echo "rc=$?"
echo "=== nccl_test"
FS_NCCL_TEST_SHARED_GPU=1 NCCL_DEBUG=WARN timeout 600 "$B/nccl_test" --gtest_color=no "$@"
echo "rc=$?"; date
