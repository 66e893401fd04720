#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, for tests/slurm/.
#
#   scripts/slurm-localhost.sh check            exit 0 when munged, slurmctld, slurmd and
#                                                the client commands are installed
#   scripts/slurm-localhost.sh install          install Debian's slurm-wlm and munge
#                                                (scripts/debian-packages.sh: needs root
#                                                and apt-get; a no-op when present)
#   scripts/slurm-localhost.sh can-install      exit 0 when `install` could run here
#   scripts/slurm-localhost.sh start DIR        write DIR/slurm.conf, start munged,
#                                                slurmctld and slurmd with their state,
#                                                logs and pid files under DIR; prints
#                                                `export SLURM_CONF=DIR/slurm.conf`
#   scripts/slurm-localhost.sh stop DIR         stop the daemons started in DIR, by pid
#
# Facts of this kind of machine that the configuration answers (see tests/slurm/):
# root, no systemd, no cgroups: proctrack/linuxproc and task/none. A requeued job is
# held for cred_expire+1 s (default 121 s): AuthInfo cred_expire=5 makes a requeue ~6 s.
# batch_sched_delay=0 removes a 3 s gap between jobs. MailProg=/bin/true silences an
# error at every job end. Nothing is written outside DIR, and munged gets a key of
# its own in DIR, so an existing munge or Slurm on the machine is left alone.
set -euo pipefail

PKGS=(munge slurmctld slurmd slurm-client)
BINS=(munged slurmctld slurmd sbatch scontrol squeue scancel srun)

die() { echo "slurm-localhost: $*" >&2; exit 1; }

check() {
    local b
    for b in "${BINS[@]}"; do
        PATH="$PATH:/usr/sbin:/sbin" command -v "$b" >/dev/null 2>&1 || return 1
    done
}

PACKAGES="$(dirname "${BASH_SOURCE[0]}")/debian-packages.sh"

can_install() {
    bash "$PACKAGES" can-install
}

install() {  # a no-op when the packages are there; `make test` runs it every time
    bash "$PACKAGES" ensure "${PKGS[@]}" || die "cannot install ${PKGS[*]}"
    check || die "${PKGS[*]} are installed but ${BINS[*]} are not all on PATH"
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local limit=$1 what=$2
    shift 2
    local end=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        [ $SECONDS -lt $end ] || { echo "slurm-localhost: gave up waiting for $what" >&2; return 1; }
        sleep 0.1
    done
}

start() {
    local dir=${1:?usage: start DIR}
    check || die "Slurm is not installed (run: $0 install)"
    export PATH="$PATH:/usr/sbin:/sbin"
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    mkdir -p "$dir/state" "$dir/spool" "$dir/munge" "$dir/log"
    chmod 700 "$dir/munge"
    local host cpus mem
    host=$(hostname -s)
    cpus=$(nproc)
    mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    # ports of their own, away from a system Slurm's 6817/6818
    local ctld_port=${SF_SLURMCTLD_PORT:-16817} d_port=${SF_SLURMD_PORT:-16818}

    [ -f "$dir/munge/munge.key" ] || {
        dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
        chmod 400 "$dir/munge/munge.key"
    }
    cat >"$dir/slurm.conf" <<EOF
# written by scripts/slurm-localhost.sh: a single-node test cluster
ClusterName=steadfast-test
SlurmctldHost=$host
SlurmctldPort=$ctld_port
SlurmdPort=$d_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobRequeue=1
ReturnToService=2
KillWait=10
MinJobAge=300
MailProg=/bin/true
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" \
        --seed-file="$dir/munge/munge.seed"
    wait_for 10 munged test -S "$dir/munge/munge.socket" || die "munged did not start: $dir/log/munged.log"
    export SLURM_CONF="$dir/slurm.conf"
    slurmctld -f "$SLURM_CONF" || die "slurmctld did not start: $dir/log/slurmctld.log"
    slurmd -f "$SLURM_CONF" || die "slurmd did not start: $dir/log/slurmd.log"
    wait_for 30 "the node" sh -c "sinfo -h -N -o %T | grep -qx idle" || {
        sinfo -N >&2 || true
        tail -n 5 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" >&2 || true
        die "the node did not come up idle"
    }
    echo "export SLURM_CONF=$SLURM_CONF"
}

live_pid() {  # live_pid PIDFILE NAME: the pid in PIDFILE if it is still that daemon
    local file=$1 name=$2 pid
    [ -f "$file" ] || return 1
    pid=$(cat "$file")
    # the pid file may be stale and the number reused: check the process's name
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && grep -q "$name" "/proc/$pid/comm" 2>/dev/null \
        && echo "$pid"
}

stop() {  # SIGTERM to every daemon at once, SIGKILL to any still there after 10 s
    local dir=${1:?usage: stop DIR} pids="" pid pair
    for pair in slurmd.pid:slurmd slurmctld.pid:slurmctld munge/munged.pid:munged; do
        pid=$(live_pid "$dir/${pair%%:*}" "${pair##*:}") && pids="$pids $pid"
        rm -f "$dir/${pair%%:*}"
    done
    [ -n "$pids" ] || return 0
    # shellcheck disable=SC2086
    kill $pids 2>/dev/null || true
    # shellcheck disable=SC2086
    wait_for 10 "the daemons to stop" all_gone $pids || {
        kill -9 $pids 2>/dev/null || true
        wait_for 5 "the daemons to die" all_gone $pids || true
    }
}

all_gone() {  # a zombie (PID 1 here may not reap) counts as gone
    local pid
    for pid in "$@"; do
        kill -0 "$pid" 2>/dev/null || continue
        [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" = Z ] || return 1
    done
    return 0
}

case "${1:-}" in
    check) check ;;
    can-install) can_install ;;
    install) install ;;
    start) start "${2:-}" ;;
    stop) stop "${2:-}" ;;
    *) die "usage: $0 check|can-install|install|start DIR|stop DIR" ;;
esac
