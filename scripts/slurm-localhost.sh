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
#   scripts/slurm-localhost.sh start-bed DIR BED
#                                                a cluster across the nodes of a test bed
#                                                (scripts/nodes-localhost.sh up BED N, N>=3):
#                                                slurmctld on node1 (the controller's own
#                                                machine, never a compute node), one slurmd
#                                                on each of node2..nodeN in that node's
#                                                namespaces (its host name, address, PIDs)
#   scripts/slurm-localhost.sh node-up DIR NODE (bed mode) start NODE's slurmd again, after
#                                                `nodes-localhost.sh boot` powered it on
#   scripts/slurm-localhost.sh client DIR CMD... run a client command (sbatch, scontrol,
#                                                squeue...) where it reaches slurmctld: on
#                                                this machine, or on the bed's node1
#   scripts/slurm-localhost.sh stop DIR         stop the daemons started in DIR, by pid
#
# Facts of this kind of machine that the configuration answers (see tests/slurm/):
# root, no systemd, no cgroups: proctrack/linuxproc and task/none. A requeued job is
# held for cred_expire+1 s (default 121 s): AuthInfo cred_expire=5 makes a requeue ~6 s.
# batch_sched_delay=0 removes a 3 s gap between jobs. MailProg=/bin/true silences an
# error at every job end. Nothing is written outside DIR, and munged gets a key of
# its own in DIR, so an existing munge or Slurm on the machine is left alone.
#
# On a bed: one munged for the cluster, on this machine; its socket is a path under DIR,
# which every node reaches (a Unix socket is not bound to a network namespace). A node's
# /sys is its network namespace's, without the cgroup mounts slurmd reads at start: the
# machine's cgroup mounts are repeated in the node's own mount namespace, where they go
# with it. --no-kill jobs (what `steadfast slurm --spare-nodes` writes) outlive a node's
# loss; SlurmdTimeout=10 lets slurmctld declare a killed node DOWN in ~30 s, so a job
# requeued away from it is released (its epilog there can never run) and placed.
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

prepare() {  # prepare DIR: the folders, the munge key, the port numbers
    local dir=$1
    mkdir -p "$dir/state" "$dir/spool" "$dir/munge" "$dir/log" "$dir/run"
    chmod 700 "$dir/munge"
    [ -f "$dir/munge/munge.key" ] || {
        dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
        chmod 400 "$dir/munge/munge.key"
    }
    # ports of their own, away from a system Slurm's 6817/6818
    CTLD_PORT=${SF_SLURMCTLD_PORT:-16817} D_PORT=${SF_SLURMD_PORT:-16818}
}

common_conf() {  # common_conf DIR CONTROLLER: the settings both modes share
    local dir=$1 controller=$2
    cat <<EOF
ClusterName=steadfast-test
SlurmctldHost=$controller
SlurmctldPort=$CTLD_PORT
SlurmdPort=$D_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=5
StateSaveLocation=$dir/state
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmctldLogFile=$dir/log/slurmctld.log
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
EOF
}

start_munged() {
    local dir=$1
    munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" \
        --seed-file="$dir/munge/munge.seed"
    wait_for 10 munged test -S "$dir/munge/munge.socket" || die "munged did not start: $dir/log/munged.log"
}

start() {
    local dir=${1:?usage: start DIR}
    check || die "Slurm is not installed (run: $0 install)"
    export PATH="$PATH:/usr/sbin:/sbin"
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    prepare "$dir"
    local host cpus mem
    host=$(hostname -s)
    cpus=$(nproc)
    mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    {
        echo "# written by scripts/slurm-localhost.sh: a single-node test cluster"
        common_conf "$dir" "$host"
        cat <<EOF
SlurmdSpoolDir=$dir/spool
SlurmdPidFile=$dir/run/slurmd.pid
SlurmdLogFile=$dir/log/slurmd.log
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    } >"$dir/slurm.conf"
    echo "MODE=single" >"$dir/cluster.env"
    start_munged "$dir"
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

# ------------------------------------------------------------------ on a test bed
NODES="$(dirname "${BASH_SOURCE[0]}")/nodes-localhost.sh"

on_node() {  # on_node BED NODE CMD...: CMD in the node's namespaces
    bash "$NODES" run "$@"
}

# The node's side of repeating the machine's cgroup mounts ($1: "type dir options"
# lines of this machine's /proc/self/mounts, parents first)
# shellcheck disable=SC2016  # expanded by the node's shell
CGROUP_MOUNTS='
printf "%s\n" "$1" | while read -r type dir opts; do
    [ -n "$type" ] || continue
    mkdir -p "$dir"
    case "$type" in
        tmpfs) mount -t tmpfs -o mode=755 cgroup_root "$dir" ;;
        cgroup2) mount -t cgroup2 cgroup2 "$dir" ;;
        *) case ",$opts," in *,name=*) opts="none,$opts" ;; esac
           mount -t cgroup -o "$opts" cgroup "$dir" ;;
    esac || exit 1
done
'

cgroup_mounts() {  # this machine's cgroup mounts
    awk '($3 == "tmpfs" && $2 == "/sys/fs/cgroup") || $3 == "cgroup" || $3 == "cgroup2" {
        print $3, $2, $4 }' /proc/self/mounts
}

load_cluster() {
    local dir=$1
    [ -f "$dir/cluster.env" ] || die "no cluster in $dir"
    # shellcheck source=/dev/null
    . "$dir/cluster.env"
}

node_up() {  # node_up DIR NODE: the cgroup mounts, then slurmd, on a node that is on
    local dir=${1:?usage: node-up DIR NODE} node=${2:?usage: node-up DIR NODE}
    load_cluster "$dir"
    [ "$MODE" = bed ] || die "node-up: $dir is not a cluster on a bed"
    if [ -n "$(cgroup_mounts)" ] && ! on_node "$BED" "$node" sh -c 'grep -q " cgroup" /proc/self/mounts'; then
        on_node "$BED" "$node" sh -c "$CGROUP_MOUNTS" cgroups "$(cgroup_mounts)" ||
            die "cannot mount the cgroup file systems on $node"
    fi
    on_node "$BED" "$node" slurmd -f "$dir/slurm.conf" -N "$node" ||
        die "slurmd did not start on $node: $dir/log/slurmd-$node.log"
}

start_bed() {
    local dir=${1:?usage: start-bed DIR BED} bed=${2:?usage: start-bed DIR BED}
    check || die "Slurm is not installed (run: $0 install)"
    export PATH="$PATH:/usr/sbin:/sbin"
    [ -f "$bed/bed.env" ] || die "no bed in $bed (run: $NODES up $bed N)"
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    bed=$(cd "$bed" && pwd)
    local n subnet
    n=$(sed -n 's/^N=//p' "$bed/bed.env")
    subnet=$(sed -n 's/^SUBNET=//p' "$bed/bed.env")
    [ "$n" -ge 3 ] || die "a cluster needs a bed of 3 nodes or more (the controller and two)"
    prepare "$dir"
    local cpus mem i names=""
    cpus=$(nproc)
    mem=$(awk -v n=$((n - 1)) '/MemTotal/ {print int($2 / 1024 * 0.9 / n)}' /proc/meminfo)
    {
        echo "# written by scripts/slurm-localhost.sh: a cluster on the test bed $bed"
        common_conf "$dir" "node1($subnet.1)"
        cat <<EOF
SlurmdSpoolDir=$dir/spool/%n
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmdTimeout=10
EOF
        for i in $(seq 2 "$n"); do
            echo "NodeName=node$i NodeAddr=$subnet.$i CPUs=$cpus RealMemory=$mem State=UNKNOWN"
            names+="${names:+,}node$i"
        done
        echo "PartitionName=debug Nodes=$names Default=YES MaxTime=INFINITE State=UP"
    } >"$dir/slurm.conf"
    printf 'MODE=bed\nBED=%s\nCOMPUTE=%s\n' "$bed" "$names" >"$dir/cluster.env"
    start_munged "$dir"
    on_node "$bed" node1 slurmctld -f "$dir/slurm.conf" ||
        die "slurmctld did not start on node1: $dir/log/slurmctld.log"
    for i in $(seq 2 "$n"); do
        node_up "$dir" "node$i"
    done
    wait_for 60 "the nodes" all_idle "$dir" || {
        (client "$dir" sinfo -N) >&2 || true
        tail -n 5 "$dir"/log/*.log >&2 || true
        die "the nodes did not all come up idle"
    }
    echo "export SLURM_CONF=$dir/slurm.conf"
}

all_idle() {
    local states
    states=$( (client "$1" sinfo -h -N -o %T) | sort -u)
    [ "$states" = idle ]
}

client() {  # client DIR CMD...: on this machine, or on the controller's node
    local dir=${1:?usage: client DIR CMD...}
    shift
    [ $# -gt 0 ] || die "usage: client DIR CMD..."
    load_cluster "$dir"
    export SLURM_CONF="$dir/slurm.conf"
    if [ "$MODE" = bed ]; then
        # not node1's own TMPDIR: sbatch passes the environment on to the jobs
        exec bash "$NODES" run "$BED" node1 env -u TMPDIR "$@"
    fi
    exec "$@"
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
    local dir=${1:?usage: stop DIR} pids="" pid
    [ -d "$dir" ] || return 0
    dir=$(cd "$dir" && pwd)
    # slurmctld and the slurmds by their command line (on a bed, their pid files hold
    # the numbers of their nodes' PID namespaces), munged by its pid file
    pids=$(pgrep -f "^slurm(ctld|d) -f $dir/slurm.conf( |\$)" || true)
    pid=$(live_pid "$dir/munge/munged.pid" munged) && pids="$pids $pid"
    rm -f "$dir/munge/munged.pid" "$dir"/run/*.pid
    [ -n "${pids// /}" ] || return 0
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
    start-bed) start_bed "${2:-}" "${3:-}" ;;
    node-up) node_up "${2:-}" "${3:-}" ;;
    client) shift; client "$@" ;;
    stop) stop "${2:-}" ;;
    *) die "usage: $0 check|can-install|install|start DIR|start-bed DIR BED|node-up DIR NODE|client DIR CMD...|stop DIR" ;;
esac
