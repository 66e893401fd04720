#!/usr/bin/env bash
# NVRx's newest launcher and barrier rendezvous from its repository's source, in a
# virtual environment of its own (a bench extra, outside steadfast's dependencies), so
# that bench/bench_control_plane.py --nvrx can run NVRx's rendezvous side by side with
# torch's and steadfast's (issue 28). The PyPI wheels for x86_64 stop at 0.4.1.
#
#   scripts/nvrx-env.sh [DIR]        default DIR: .nvrx at the repository root
#   NVRX_WHEEL=0.4.1 scripts/nvrx-env.sh .nvrx-0.4.1
#                                    NVRx's released wheel instead (x86_64's newest:
#                                    0.4.1), with its own dependencies, for the
#                                    fault-cost bench's NVRx rows
#
# What it does (each step a no-op when done):
#   - clones NVRx (NVRX_REPO, default its GitHub repository) at NVRX_COMMIT into DIR/src;
#   - makes DIR/venv: torch (TORCH, default 2.13.0: the CPU wheel this machine serves)
#     first, then NVRx's Python dependencies;
#   - generates its gRPC modules from its three .proto files with grpc_tools.protoc, as
#     its build.py does (its CUPTI extension and the attribution service's own
#     dependencies are left out: the rendezvous does not need them);
#   - puts NVRx's source and steadfast's on the path (a .pth file).
# Prints the environment's python.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${1:-$root/.nvrx}
repo=${NVRX_REPO:-https://github.com/NVIDIA/nvidia-resiliency-ext}
commit=${NVRX_COMMIT:-d8686d9c7015c39ce91dd01788c0ab111a24818b}
torch_version=${TORCH:-2.13.0}
python=${PYTHON:-python3}

mkdir -p "$dir"
if [ -n "${NVRX_WHEEL:-}" ]; then
    if [ ! -x "$dir/venv/bin/python" ]; then
        "$python" -m venv "$dir/venv"
    fi
    py=$dir/venv/bin/python
    "$py" -m pip install --quiet "torch==$torch_version" "nvidia-resiliency-ext==$NVRX_WHEEL"
    "$py" -c 'import nvidia_resiliency_ext.fault_tolerance.launcher' >/dev/null
    echo "$py"
    exit 0
fi
if [ ! -d "$dir/src/.git" ]; then
    git clone --quiet "$repo" "$dir/src"
fi
if [ "$(git -C "$dir/src" rev-parse HEAD)" != "$commit" ]; then
    git -C "$dir/src" fetch --quiet origin "$commit" 2>/dev/null || true
    git -C "$dir/src" checkout --quiet "$commit"
fi

if [ ! -x "$dir/venv/bin/python" ]; then
    "$python" -m venv "$dir/venv"
fi
py=$dir/venv/bin/python
"$py" -m pip install --quiet "torch==$torch_version"
"$py" -m pip install --quiet packaging psutil pyyaml numpy nvidia-ml-py defusedxml httpx \
    grpcio grpcio-tools protobuf

srcdir=$dir/src/src
protos=(nvhcd.proto log_aggregation.proto nvrx_interface.proto)
rel=()
for proto in "${protos[@]}"; do
    rel+=("nvidia_resiliency_ext/shared_utils/proto/$proto")
done
if [ ! -f "$srcdir/nvidia_resiliency_ext/shared_utils/proto/nvhcd_pb2.py" ]; then
    "$py" -m grpc_tools.protoc "-I$srcdir" "--python_out=$srcdir" "--grpc_python_out=$srcdir" \
        "${rel[@]}"
fi

site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf '%s\n%s\n' "$srcdir" "$root/src" >"$site/steadfast-nvrx.pth"
"$py" -c 'import nvidia_resiliency_ext.fault_tolerance.ft_rendezvous_barrier' >/dev/null
echo "$py"
