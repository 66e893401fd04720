#!/usr/bin/env bash
# Nodes on one machine, for tests/multinode/: each "node" is its own network namespace
# (its own IP on a private bridge), UTS namespace (its own host name), PID namespace (so
# a power loss kills every process in it at once), mount namespace (its own /etc/hosts
# naming every node, a private /dev/shm that goes with it) and node-local directory, as
# a local NVMe would be; one shared directory stands for the shared file system.
#
#   scripts/nodes-localhost.sh check                 exit 0 when this machine can make
#                                                     nodes (root, ip, unshare, nsenter,
#                                                     tc, network namespaces), else say why
#   scripts/nodes-localhost.sh install               install iproute2, util-linux and
#                                                     etcd (a no-op when present)
#   scripts/nodes-localhost.sh up DIR N [SUBNET]     make nodes node1..nodeN (SUBNET:
#                                                     a /24 prefix, default 10.213.0);
#                                                     state under DIR, DIR/shared shared
#   scripts/nodes-localhost.sh run DIR NODE CMD...   run CMD on NODE (foreground; the
#                                                     node's host name, network, PIDs and
#                                                     mounts; TMPDIR in its local dir)
#   scripts/nodes-localhost.sh kill DIR NODE [--silent]
#                                                     power loss: SIGKILL every process
#                                                     of NODE at once (--silent: its link
#                                                     goes down first, so no peer sees a
#                                                     connection reset, as when a NIC or
#                                                     the power goes without a word)
#   scripts/nodes-localhost.sh boot DIR NODE         power a killed node back on (empty)
#   scripts/nodes-localhost.sh partition DIR NODE    take NODE's link down ...
#   scripts/nodes-localhost.sh heal DIR NODE         ... and back up
#   scripts/nodes-localhost.sh slow DIR NODE SPEC    slow NODE's link both ways: SPEC is
#                                                     a delay (`100ms`, tc netem) or a
#                                                     rate (`1mbit`, tc tbf, for kernels
#                                                     without netem)
#   scripts/nodes-localhost.sh fast DIR NODE         remove the slow link
#   scripts/nodes-localhost.sh etcd DIR [--tls]      start one etcd member per node (v2
#                                                     API on, client port 2379), wait for
#                                                     the cluster to be healthy. --tls: as
#                                                     sites run it: https with client
#                                                     certificates required and etcd's
#                                                     auth on (user root); the CA, a
#                                                     client certificate (no CN) and the
#                                                     password file in DIR/etcd-tls
#   scripts/nodes-localhost.sh ip DIR NODE           print NODE's address
#   scripts/nodes-localhost.sh down DIR              remove everything `up` made
#
# Nothing is routed off the machine: the bridge has no address and no uplink, so the
# nodes reach only each other. Names are unique per DIR (a prefix drawn at `up`), so
# several beds can exist side by side. `down` is idempotent and works on a half-made bed.
set -euo pipefail

die() { echo "nodes-localhost: $*" >&2; exit 1; }

PACKAGES="$(dirname "${BASH_SOURCE[0]}")/debian-packages.sh"
export PATH="$PATH:/usr/sbin:/sbin"

check() {
    [ "$(id -u)" = 0 ] || { echo "nodes-localhost: needs root (network namespaces)" >&2; return 1; }
    local b
    for b in ip unshare nsenter tc python3; do
        command -v "$b" >/dev/null 2>&1 || { echo "nodes-localhost: $b is not installed" >&2; return 1; }
    done
    local probe="sfprobe$$"
    if ! ip netns add "$probe" 2>/dev/null; then
        echo "nodes-localhost: cannot create a network namespace here" >&2
        return 1
    fi
    ip netns del "$probe"
    if ! unshare --pid --fork --uts --mount true 2>/dev/null; then
        echo "nodes-localhost: cannot create PID/UTS/mount namespaces here" >&2
        return 1
    fi
}

install() {  # openssl: the secured etcd's certificates, made at test time
    bash "$PACKAGES" ensure iproute2 util-linux etcd-server etcd-client openssl ||
        die "cannot install iproute2 util-linux etcd-server etcd-client openssl"
}

# ------------------------------------------------------------------------ bed state
load() {  # load DIR: the bed's settings
    local dir=${1:?DIR}
    [ -f "$dir/bed.env" ] || die "no bed in $dir (run: $0 up $dir N)"
    # shellcheck source=/dev/null
    . "$dir/bed.env"
    : "${PREFIX:?}" "${N:?}" "${SUBNET:?}"
}

node_index() {  # node_index NODE -> i of nodeI
    local node=$1
    [[ "$node" =~ ^node([0-9]+)$ ]] || die "unknown node '$node' (nodes are node1..node$N)"
    local i=$((10#${BASH_REMATCH[1]}))
    [ "$i" -ge 1 ] && [ "$i" -le "$N" ] && echo "$i" && return 0
    die "unknown node '$node' (nodes are node1..node$N)"
}

init_pid() {  # the host PID of the node's PID 1 (empty when the node is off)
    local dir=$1 node=$2 pid
    pid=$(cat "$dir/nodes/$node/init.pid" 2>/dev/null || true)
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        echo "$pid"
    fi
}

# PID 1 of a node: reaps every orphan, as init does, and ends with the node
REAPER='
import os, time
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.2)
'

boot() {  # boot DIR NODE: start the node's namespaces and its PID 1
    local dir=$1 node=$2
    load "$dir"
    node_index "$node" >/dev/null
    [ -z "$(init_pid "$dir" "$node")" ] || die "$node is already on"
    local ns="${PREFIX}-$node" local_dir="$dir/nodes/$node/local"
    mkdir -p "$local_dir/tmp"
    ip link set "${PREFIX}v$(node_index "$node")" up  # after a silent kill, the link too
    # shellcheck disable=SC2016  # $1 and $2 are the inner shell's
    # ip netns exec: the node's network and its /etc/hosts (from /etc/netns/NS); then
    # new PID, UTS and mount namespaces, a private /proc and /dev/shm, and the reaper
    ip netns exec "$ns" unshare --pid --fork --kill-child --uts --mount --propagation private \
        sh -c 'hostname "$1" && mount -t proc proc /proc && mount -t tmpfs -o size=1g tmpfs /dev/shm && exec python3 -c "$2"' \
        init "$node" "$REAPER" </dev/null >/dev/null 2>"$dir/nodes/$node/init.log" &
    local unshare_pid=$! child="" end=$((SECONDS + 10))
    while [ -z "$child" ]; do
        child=$(awk '{print $1}' "/proc/$unshare_pid/task/$unshare_pid/children" 2>/dev/null || true)
        if [ -z "$child" ]; then
            kill -0 "$unshare_pid" 2>/dev/null || die "$node did not start: $(cat "$dir/nodes/$node/init.log")"
            [ $SECONDS -lt $end ] || die "$node did not start in 10 s"
            sleep 0.05
        fi
    done
    # ready once PID 1 runs the reaper (the mounts are done)
    until tr '\0' ' ' <"/proc/$child/cmdline" 2>/dev/null | grep -q 'os.wait'; do
        kill -0 "$child" 2>/dev/null || die "$node did not start: $(cat "$dir/nodes/$node/init.log")"
        [ $SECONDS -lt $end ] || die "$node did not start in 10 s"
        sleep 0.05
    done
    echo "$unshare_pid" >"$dir/nodes/$node/unshare.pid"
    echo "$child" >"$dir/nodes/$node/init.pid"
}

up() {
    local dir=${1:?usage: up DIR N [SUBNET]} n=${2:?usage: up DIR N [SUBNET]} subnet=${3:-10.213.0}
    if ! [[ "$n" =~ ^[0-9]+$ ]] || [ "$n" -lt 1 ] || [ "$n" -gt 200 ]; then
        die "N must be 1..200, not '$n'"
    fi
    [[ "$subnet" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "SUBNET must look like 10.213.0, not '$subnet'"
    check || die "this machine cannot make nodes"
    [ ! -f "$dir/bed.env" ] || die "$dir already holds a bed (run: $0 down $dir)"
    mkdir -p "$dir/shared" "$dir/nodes"
    dir=$(cd "$dir" && pwd)
    local prefix
    prefix="sf$(printf '%05x' $((RANDOM * 32 + $$ % 32)) | tail -c 5)"
    printf 'PREFIX=%s\nN=%s\nSUBNET=%s\nDIR=%s\n' "$prefix" "$n" "$subnet" "$dir" >"$dir/bed.env"
    load "$dir"
    trap 'down "$dir" >/dev/null 2>&1' EXIT  # a bed made in part is removed
    ip link add "${PREFIX}br" type bridge
    ip link set "${PREFIX}br" up
    local hosts="127.0.0.1 localhost"$'\n' i
    for i in $(seq 1 "$n"); do
        hosts+="$subnet.$i node$i"$'\n'
    done
    for i in $(seq 1 "$n"); do
        local ns="${PREFIX}-node$i"
        ip netns add "$ns"
        ip link add "${PREFIX}v$i" type veth peer name eth0 netns "$ns"
        ip link set "${PREFIX}v$i" master "${PREFIX}br" up
        ip -n "$ns" addr add "$subnet.$i/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        mkdir -p "/etc/netns/$ns" "$dir/nodes/node$i/local"
        printf '%s' "$hosts" >"/etc/netns/$ns/hosts"
        echo "node$i" >"/etc/netns/$ns/hostname"
        echo "$subnet.$i" >"$dir/nodes/node$i/ip"
        boot "$dir" "node$i"
    done
    trap - EXIT
    echo "nodes-localhost: node1..node$n up in $dir (prefix $PREFIX, $subnet.0/24)"
}

run() {
    local dir=${1:?usage: run DIR NODE CMD...} node=${2:?usage: run DIR NODE CMD...}
    shift 2
    [ $# -gt 0 ] || die "usage: run DIR NODE CMD..."
    load "$dir"
    node_index "$node" >/dev/null
    local pid
    pid=$(init_pid "$dir" "$node")
    [ -n "$pid" ] || die "$node is off"
    exec nsenter --target "$pid" --net --uts --pid --mount --wd="$PWD" -- \
        env TMPDIR="$dir/nodes/$node/local/tmp" STEADFAST_NODE="$node" "$@"
}

kill_node() {
    local dir=${1:?usage: kill DIR NODE [--silent]} node=${2:?usage: kill DIR NODE [--silent]}
    load "$dir"
    local i
    i=$(node_index "$node")
    if [ "${3:-}" = "--silent" ]; then
        ip link set "${PREFIX}v$i" down
    elif [ -n "${3:-}" ]; then
        die "kill: unknown option '$3'"
    fi
    local pid
    pid=$(init_pid "$dir" "$node")
    [ -n "$pid" ] || die "$node is already off"
    kill -KILL "$pid"  # PID 1 of the node's PID namespace: the kernel kills all of it
    local end=$((SECONDS + 10))
    while kill -0 "$pid" 2>/dev/null; do
        [ $SECONDS -lt $end ] || die "$node did not die in 10 s"
        sleep 0.02
    done
    rm -f "$dir/nodes/$node/init.pid"
}

link() {  # link DIR NODE up|down
    local dir=$1 node=$2 state=$3
    load "$dir"
    local i
    i=$(node_index "$node")
    ip link set "${PREFIX}v$i" "$state"
}

slow() {
    local dir=${1:?usage: slow DIR NODE SPEC} node=${2:?usage: slow DIR NODE SPEC} spec=${3:?usage: slow DIR NODE SPEC}
    load "$dir"
    local i qdisc
    i=$(node_index "$node")
    if [[ "$spec" =~ ^[0-9.]+(us|ms|s)$ ]]; then
        qdisc=(netem delay "$spec")
    elif [[ "$spec" =~ ^[0-9.]+([kmg]?bit)$ ]]; then
        qdisc=(tbf rate "$spec" burst 32kbit latency 1s)
    else
        die "slow: SPEC is a delay (100ms) or a rate (1mbit), not '$spec'"
    fi
    if ! tc qdisc replace dev "${PREFIX}v$i" root "${qdisc[@]}" 2>/dev/null; then
        die "slow: tc cannot add '${qdisc[*]}' here (a delay needs the kernel's netem; a rate such as 1mbit uses tbf)"
    fi
    ip netns exec "${PREFIX}-$node" tc qdisc replace dev eth0 root "${qdisc[@]}"
}

fast() {
    local dir=${1:?usage: fast DIR NODE} node=${2:?usage: fast DIR NODE}
    load "$dir"
    local i
    i=$(node_index "$node")
    tc qdisc del dev "${PREFIX}v$i" root 2>/dev/null || true
    ip netns exec "${PREFIX}-$node" tc qdisc del dev eth0 root 2>/dev/null || true
}

etcd_certs() {  # etcd_certs TLS: a CA, the members' certificate, a client's, a password
    local tls=$1 sans="IP:127.0.0.1" i
    for i in $(seq 1 "$N"); do sans+=",IP:$SUBNET.$i"; done
    mkdir -p "$tls"
    (
        cd "$tls"
        openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 \
            -subj "/CN=$PREFIX-etcd-ca"
        openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr \
            -subj "/CN=$PREFIX-etcd"
        printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$sans" >server.ext
        openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial \
            -out server.pem -days 2 -extfile server.ext
        # no CN: etcd's JSON gateway refuses a client certificate with one while auth is on
        openssl req -newkey rsa:2048 -nodes -keyout client.key -out client.csr \
            -subj "/O=$PREFIX-job"
        printf 'extendedKeyUsage=clientAuth\n' >client.ext
        openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial \
            -out client.pem -days 2 -extfile client.ext
        openssl rand -hex 16 >password
        chmod 600 ./*.key password
    ) >"$tls/openssl.log" 2>&1 || die "etcd certificates: $(tail -n 3 "$tls/openssl.log")"
}

etcd_up() {
    local dir=${1:?usage: etcd DIR [--tls]} secure=${2:-}
    load "$dir"
    command -v etcd >/dev/null 2>&1 || die "etcd is not installed (Debian: etcd-server)"
    local cluster="" i scheme=http tls="$dir/etcd-tls" extra=()
    for i in $(seq 1 "$N"); do
        cluster+="${cluster:+,}node$i=http://$SUBNET.$i:2380"
    done
    if [ "$secure" = --tls ]; then
        command -v openssl >/dev/null 2>&1 || die "openssl is not installed"
        etcd_certs "$tls"
        scheme=https
        extra=(--cert-file "$tls/server.pem" --key-file "$tls/server.key"
               --trusted-ca-file "$tls/ca.pem" --client-cert-auth)
    elif [ -n "$secure" ]; then
        die "etcd: unknown option $secure (--tls)"
    fi
    for i in $(seq 1 "$N"); do
        local node="node$i" ip="$SUBNET.$i"
        local data="$dir/nodes/$node/local/etcd"
        [ -z "$(init_pid "$dir" "$node")" ] && continue  # an off node has no member
        ( run "$dir" "$node" etcd --name "$node" --data-dir "$data" --enable-v2 \
            --listen-client-urls "$scheme://$ip:2379,$scheme://127.0.0.1:2379" \
            --advertise-client-urls "$scheme://$ip:2379" "${extra[@]}" \
            --listen-peer-urls "http://$ip:2380" --initial-advertise-peer-urls "http://$ip:2380" \
            --initial-cluster "$cluster" --initial-cluster-state new \
            --initial-cluster-token "$PREFIX" \
            --heartbeat-interval 100 --election-timeout 1000 \
            >"$dir/nodes/$node/etcd.log" 2>&1 & )
    done
    local end=$((SECONDS + 60))
    for i in $(seq 1 "$N"); do
        [ -z "$(init_pid "$dir" "node$i")" ] && continue
        until ( run "$dir" "node$i" python3 -c '
import ssl, sys, urllib.request
scheme, tls = sys.argv[1:]
ctx = None
if scheme == "https":
    ctx = ssl.create_default_context(cafile=tls + "/ca.pem")
    ctx.load_cert_chain(tls + "/client.pem", tls + "/client.key")
url = scheme + "://127.0.0.1:2379/health"
with urllib.request.urlopen(url, timeout=2, context=ctx) as r:
    sys.exit(0 if b"\"true\"" in r.read() else 1)
' "$scheme" "$tls" ) >/dev/null 2>&1; do
            [ $SECONDS -lt $end ] || die "etcd on node$i not healthy in 60 s: $(tail -n 5 "$dir/nodes/node$i/etcd.log")"
            sleep 0.2
        done
    done
    if [ "$scheme" = https ]; then  # etcd's auth on, with a root user (one member says)
        local first="" ctl
        for i in $(seq 1 "$N"); do
            [ -n "$(init_pid "$dir" "node$i")" ] && { first="node$i"; break; }
        done
        ctl=(etcdctl --endpoints https://127.0.0.1:2379 --cacert "$tls/ca.pem"
             --cert "$tls/client.pem" --key "$tls/client.key")
        # the password on stdin, not on a command line
        # (a subshell each: run execs)
        if ! { ( run "$dir" "$first" "${ctl[@]}" user add root --interactive=false \
                     <"$tls/password" >/dev/null ) &&
               ( run "$dir" "$first" "${ctl[@]}" user grant-role root root >/dev/null ) &&
               ( run "$dir" "$first" "${ctl[@]}" auth enable >/dev/null ); }; then
            die "etcd: could not turn auth on"
        fi
    fi
    echo "nodes-localhost: etcd cluster up ($cluster, $scheme)"
}

down() {
    local dir=${1:?usage: down DIR}
    [ -f "$dir/bed.env" ] || return 0
    load "$dir"
    local node pid
    for node in "$dir"/nodes/*/; do
        node=$(basename "$node")
        pid=$(init_pid "$dir" "$node")
        [ -z "$pid" ] || kill -KILL "$pid" 2>/dev/null || true
        pid=$(cat "$dir/nodes/$node/unshare.pid" 2>/dev/null || true)
        [ -z "$pid" ] || kill -KILL "$pid" 2>/dev/null || true
    done
    local i
    for i in $(seq 1 "$N"); do
        ip link del "${PREFIX}v$i" 2>/dev/null || true
        ip netns del "${PREFIX}-node$i" 2>/dev/null || true
        rm -rf "/etc/netns/${PREFIX}-node$i"
    done
    ip link del "${PREFIX}br" 2>/dev/null || true
    local end=$((SECONDS + 10))
    while ip -o link show 2>/dev/null | grep -q ": ${PREFIX}"; do
        [ $SECONDS -lt $end ] || die "interfaces of $PREFIX still there after 10 s"
        sleep 0.05
    done
    rm -f "$dir/bed.env"
}

cmd=${1:-}
shift || true
case "$cmd" in
    check) check ;;
    install) install ;;
    up) up "$@" ;;
    run) run "$@" ;;
    kill) kill_node "$@" ;;
    boot) boot "${1:?usage: boot DIR NODE}" "${2:?usage: boot DIR NODE}" ;;
    partition) link "${1:?usage: partition DIR NODE}" "${2:?usage: partition DIR NODE}" down ;;
    heal) link "${1:?usage: heal DIR NODE}" "${2:?usage: heal DIR NODE}" up ;;
    slow) slow "$@" ;;
    fast) fast "$@" ;;
    etcd) etcd_up "$@" ;;
    ip) load "${1:?usage: ip DIR NODE}"; node_index "${2:?usage: ip DIR NODE}" >/dev/null; cat "$1/nodes/$2/ip" ;;
    down) down "$@" ;;
    *) die "usage: $0 check|install|up|run|kill|boot|partition|heal|slow|fast|etcd|ip|down ..." ;;
esac
