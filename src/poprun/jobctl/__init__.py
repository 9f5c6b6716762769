"""Job control: the per-user job records, the running job's record, control socket, stall
watch and output ring, and what poprunctl asks of them.

Imports view, plan and the leaves; never run or cli (a stop is a callback it is given)."""
