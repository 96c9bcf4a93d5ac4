#!/bin/bash
# An ssh stand-in for the emulated hosts (hosts.sh): OpenMPI's rsh launcher starts its daemon on
# a "remote" host with it (mpirun --mca plm_rsh_agent <this file>), the way it would run
#   ssh [options] <host> <command words...>
# The command runs inside that host (mh_run: its network namespace, hostname host<i>), through
# /bin/sh -c with the words joined by spaces (as sshd does), in a fresh environment like a login
# over ssh (PATH, HOME, USER, LOGNAME, SHELL only): what a remote daemon gets, mpirun must pass
# (-x VAR), as on real hosts.
#
#   MH_PREFIX=<prefix of the test's namespaces> netns_rsh.sh host1 'orted ...'
#
# <host> is a hostfile's name for a host: "host<i>" or its address 10.77.0.<i+1>. MH_PREFIX must
# be the creating test's (hosts.sh's, exported by it): the namespace is ${MH_PREFIX}h<i>.
set -euo pipefail
here=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)

die() { echo "netns_rsh: $*" >&2; exit 255; }  # 255: ssh's own failure status

[[ -n ${MH_PREFIX:-} ]] ||
  die "MH_PREFIX is not set: export the prefix of the hosts' namespaces (hosts.sh's MH_PREFIX)"

# ssh options OpenMPI or a user may pass before the host: -x (no X11), -T, -o K=V, -p PORT.
while [[ $# -gt 0 && $1 == -* ]]; do
  case $1 in
    -o|-p|-l|-i|-F) shift 2 ;;
    *) shift ;;
  esac
done
[[ $# -ge 1 ]] || die "usage: netns_rsh.sh [ssh options] <host> <command...>"
host=$1; shift
host=${host#*@}  # user@host

source "$here/hosts.sh"
case $host in
  host[0-9]*) i=${host#host} ;;
  "$MH_SUBNET".[0-9]*) i=$(( ${host##*.} - 1 )) ;;
  *) die "unknown host '$host': the emulated hosts are host<i> or $MH_SUBNET.<i+1>" ;;
esac
[[ $i =~ ^[0-9]+$ ]] || die "unknown host '$host'"
ip netns list | grep -qw "$(mh_ns "$i")" ||
  die "host '$host' does not exist: no network namespace $(mh_ns "$i") (MH_PREFIX=$MH_PREFIX)"
[[ $# -ge 1 ]] || die "no command for $host (an interactive login is not emulated)"

mh_run "$i" env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  HOME="${HOME:-/root}" USER="$(id -un)" LOGNAME="$(id -un)" SHELL=/bin/sh \
  /bin/sh -c "$*"
