"""The monitor thread's interruption lands in the main thread, never in a thread the main
thread is starting (CPython 3.11 gives a new thread's state its creator's id until the
thread runs: ``PyThreadState_SetAsyncExc`` found that state first)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# Each round: the main thread is inside the iteration's function and starts threads (as a
# memory snapshot starts its writer) while the monitor thread interrupts it. Before the
# fix the interruption went to a new thread now and then: that thread died before it had
# started, and the main thread waited in Thread.start() for good.
ROUNDS = textwrap.dedent(
    """
    import sys, threading
    from steadfast.inprocess.monitor_thread import MonitorThread
    from steadfast.inprocess.state import InterruptedIteration

    stray = []
    sys.unraisablehook = lambda u: stray.append(repr(u.exc_value))
    threading.excepthook = lambda a: stray.append(repr(a.exc_value))
    monitor = MonitorThread(lambda first: None)
    landed = 0
    for it in range(int(sys.argv[1])):
        go = threading.Event()
        def fire(it=it):
            go.wait()
            monitor._interrupt(it, first=True)
        firing = threading.Thread(target=fire)
        firing.start()
        try:
            monitor.enter(it)
            go.set()
            while True:
                threading.Thread(target=lambda: None).start()
        except InterruptedIteration:
            landed += 1
        finally:
            monitor.leave()
        firing.join()
    print(landed, len(stray), stray[:3])
    """
)


def test_an_interruption_lands_in_the_main_thread_not_in_a_thread_it_starts() -> None:
    rounds = 300
    done = subprocess.run(
        [sys.executable, "-c", ROUNDS, str(rounds)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split(maxsplit=2)[:2] == [str(rounds), "0"], done.stdout
