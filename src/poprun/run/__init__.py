"""A launch while it runs: the session's resources and attempts, the job's failure and signal
policy, the hosts (fleet), output routing, stop signals, V-IPU partitions, --check and reap.

Imports jobctl, view, plan and the leaves below it; never cli."""
