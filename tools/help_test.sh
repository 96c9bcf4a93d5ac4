#!/usr/bin/env bash
# Every user-facing binary answers --help with its usage (a first line "<name>: what it does",
# the environment variables it reads) on stdout and exit status 0, without absl's
# "SetProgramUsageMessage() never called" warning and without running anything.
# Arguments: pairs of (binary path, the name its usage line starts with).
set -uo pipefail
failed=0
while [[ $# -ge 2 ]]; do
  bin=$1 name=$2
  shift 2
  out=$(timeout 30 "$bin" --help 2>/tmp/help_test_stderr.$$)
  rc=$?
  err=$(cat /tmp/help_test_stderr.$$)
  first=$(echo "$out" | head -1)
  why=""
  if [[ $rc -ne 0 ]]; then why="exit status $rc"
  elif [[ "$first" != "$name: "* ]]; then why="first line '$first' is not '$name: ...'"
  elif ! echo "$out" | grep -q "Environment read:"; then why="no 'Environment read:' in the usage"
  elif echo "$out$err" | grep -q "SetProgramUsageMessage"; then why="absl's usage warning"
  fi
  if [[ -n "$why" ]]; then
    echo "FAIL $bin --help: $why"; echo "--- stdout:"; echo "$out"; echo "--- stderr:"; echo "$err"
    failed=1
  else
    echo "ok   $name --help"
  fi
done
rm -f /tmp/help_test_stderr.$$
exit $failed
