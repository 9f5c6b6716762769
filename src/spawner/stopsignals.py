"""The signals that stop a job, one definition for both sides: the launcher takes them over
while a launch runs (poprun.run.signals), and an agent takes them to end its host's instances
(spawner.agent). SIGINT, SIGTERM and SIGHUP: what a terminal, a scheduler and a lost session
send."""

import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
