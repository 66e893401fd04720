"""A script whose bug fires before its first step, every time: it attaches to the
launcher's monitor (so its steps would be seen), sends one heartbeat, and raises. No
restart and no requeue can help it: the progress guard must stop the job (exit 76)."""

from __future__ import annotations

from steadfast.monitor import RankMonitorClient


def main() -> None:
    ft = RankMonitorClient()
    ft.init_workload_monitoring()
    ft.send_heartbeat()
    raise RuntimeError("a bug before the first step (the config names a missing file)")


if __name__ == "__main__":
    main()
