"""Pod mode's leader end: the other pods' agents call it, as Slurm nodes' agents do.

Every pod of a Kubernetes job runs the same poprun command; pod 0 leads and the others each
start an agent that dials the leader's known port (poprun/plan/pods.py) and proves the job's
secret (spawner/callback.py: the handshake and listener Slurm's agents use). Nothing is
started here: the pods are there already, and each link waits for its pod's call, as long as
`--pod-timeout` allows (pods start when their node has pulled the image). Spare pods'
links (--spare-nodes) are this listener's too: every pod dials the one port. A link is the
connection RemoteSpawner drives (spawner/srun.py's NodeLink); the peer's address is the pod's
(its IP: what the other pods reach it at, unlike a Slurm node's name).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from .callback import Caller, CallbackListener
from .protocol import Kind, encode
from .srun import NodeLink

STEP = "pod"  # what a pod's agent says as its step (callback.py's identity)


class PodLink(NodeLink):
    """A pod's agent, reached through its call. The leader says goodbye before it ends the
    stream (`write_eof`): the agent tells a job ended from a leader lost by it."""

    def write_eof(self) -> None:
        if not self._caller.transport.is_closing():
            self._caller.transport.write(encode(Kind.HEARTBEAT, last=True))
        super().write_eof()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "peername" and self._caller is not None:
            found = self._caller.transport.get_extra_info("peername")
            if found:
                return (found[0].removeprefix("::ffff:"), *found[1:])
        return super().get_extra_info(name, default)


class _Dismissed:
    """The receiver of a retired pod's call, closing after its goodbye: what it still
    sends is dropped."""

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> None:
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        pass


class PodAgents:
    """The leader's listener and a link per follower pod (`pods`: label -> index)."""

    def __init__(self, secret: bytes, port: int, pods: Mapping[str, int], command: str,
                 timeout: float, note: Callable[[str], None]) -> None:
        self._note, self._pods = note, dict(pods)
        self._listener = CallbackListener(secret, self._on_agent,
                                          lambda why: note(f"refused a connection from {why}"))
        self._listener.bind(None, port)
        self._serving = asyncio.ensure_future(self._listener.serve())
        self._command, self._timeout = command, timeout
        self.links: dict[str, PodLink] = {}
        self._retired: set[str] = set()  # pods whose place a spare pod took (`retire`)
        for label in self._pods:  # every pod's call held from the first: a spare pod's too
            self.link(label)

    def link(self, label: str) -> PodLink:
        """The link waiting for `label`'s agent: a new one where the last one's call came
        already (the pod's agent was lost, and the job restarts: its next agent calls)."""
        link = self.links.get(label)
        if link is None or link._called.done():
            link = self.links[label] = PodLink(label, self._command)
            link.call_timeout = self._timeout
        return link

    def retire(self, label: str) -> None:
        """`label` is out of the job for good (quarantined: a spare pod took its place, or
        it was left out from the start): a pod that calls as it (Kubernetes' replacement of
        a lost pod) is told goodbye, so its agent exits 0 and the controller does not make
        it again and again."""
        self._retired.add(label)

    def _on_agent(self, identity: dict[str, Any], caller: Caller
                  ) -> PodLink | _Dismissed | None:
        label = identity["node"]
        ours = identity.get("step") == STEP and str(identity.get("task")) == str(
            self._pods.get(label))  # this pod's agent, by what it says of itself
        if ours and label in self._retired:
            self._note(f"{label}: its agent called, but the pod is quarantined, out of the "
                       "job: told goodbye")
            caller.transport.write(encode(Kind.HEARTBEAT, last=True))
            caller.transport.close()  # once written (Caller aborts where it gets None)
            return _Dismissed()
        link = self.links.get(label)
        if not ours or link is None or not link.take(caller):
            self._note(f"a pod's agent called as {label!r} (pod {identity.get('task')!r}), "
                       "which no pod waiting for its agent is: closed")
            return None
        self._note(f"{label}: its agent called from {caller.peer()}")
        return link

    async def close(self) -> None:
        """No more calls; every link closed (its agent sees the end and exits)."""
        self._listener.close()
        if not self._serving.done():
            self._serving.cancel()
        await asyncio.gather(self._serving, return_exceptions=True)
        for link in self.links.values():
            link.close()
