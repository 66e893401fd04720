"""Progress seen without a line of the script (issue 37): a worker's hooks count its
optimizer steps and time its top module's forward into its row of the heartbeat table
(probe.py, layout.py; boot.py for a worker started as a plain process); the launcher's
watcher takes a learned silence for a suspicion, confirms it from ``/proc`` and the
ranks' stacks (proc.py, judge.py), names the culprit and acts (watch.py); the reporter
logs the steps and scores the forwards for stragglers (reporter.py).

No module here imports torch at import time, nor the monitor package at module level
(the heartbeat table imports :mod:`.layout`).
"""
