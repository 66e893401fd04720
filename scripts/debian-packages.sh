#!/usr/bin/env bash
# Debian packages that the tests and the lint need, installed by `make test` every time.
#
#   scripts/debian-packages.sh missing PKG...      print the packages not installed; exit 0
#   scripts/debian-packages.sh can-install         exit 0 when `ensure` could install here
#                                                   (root and apt-get), 1 when not
#   scripts/debian-packages.sh ensure PKG...       install the missing ones (a no-op when
#                                                   all are there); exit 1 with the reason
#                                                   when some are missing and cannot be
#                                                   installed
#
# `make test` runs `ensure` on every run, present or not, so that a break in this path
# fails everywhere, not only on a new machine. The packages' maintainer scripts must not
# start daemons of their own (munged, slurmctld: the tests run theirs with their own
# configuration), so a policy-rc.d that says no (101) is in place while apt-get runs.
set -euo pipefail

die() { echo "debian-packages: $*" >&2; exit 1; }

POLICY=/usr/sbin/policy-rc.d

missing() {  # the packages of "$@" that dpkg does not have installed
    local pkg status
    for pkg in "$@"; do
        status=$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null || true)
        [ "$status" = installed ] || echo "$pkg"
    done
}

can_install() {
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && command -v dpkg-query >/dev/null 2>&1
}

ensure() {
    [ $# -gt 0 ] || die "usage: $0 ensure PKG..."
    command -v dpkg-query >/dev/null 2>&1 || die "not a Debian system (no dpkg-query): install $* by hand"
    local want
    want=$(missing "$@")
    [ -n "$want" ] || return 0
    can_install || die "missing $(echo "$want" | tr '\n' ' ')- installing needs root and apt-get"
    # shellcheck disable=SC2086 # one word per package
    set -- $want
    echo "debian-packages: installing $*" >&2
    export DEBIAN_FRONTEND=noninteractive
    local rc=0
    if [ ! -e "$POLICY" ]; then
        # removed again however this script ends (an interrupted install included): left
        # behind, it would keep every later package's service from starting
        trap 'rm -f "$POLICY"' EXIT INT TERM
        printf '#!/bin/sh\nexit 101\n' >"$POLICY" && chmod 755 "$POLICY"
    fi
    local apt=(apt-get -q -o DPkg::Lock::Timeout=120)
    # the package lists of a fresh machine may be missing or stale: update on failure
    "${apt[@]}" install -y --no-install-recommends "$@" >/dev/null 2>&1 || {
        "${apt[@]}" update >/dev/null && "${apt[@]}" install -y --no-install-recommends "$@" >/dev/null
    } || rc=$?
    [ "$rc" = 0 ] || die "apt-get install $* failed (exit $rc)"
    want=$(missing "$@")
    [ -z "$want" ] || die "apt-get ran but $(echo "$want" | tr '\n' ' ')are still not installed"
}

case "${1:-}" in
    missing) shift; missing "$@" ;;
    can-install) can_install ;;
    ensure) shift; ensure "$@" ;;
    *) die "usage: $0 missing PKG...|can-install|ensure PKG..." ;;
esac
