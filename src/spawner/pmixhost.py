"""This host's PMIx service for one job, on the launcher and on an agent alike
(docs/architecture.md, "The instances' worlds"): the server (spawner/pmixserver.py), started
at the first world that needs it, in a private 0700 directory; per world, a namespace and a
private directory in /dev/shm for Open MPI's segments. Both directories are registered with
the lifeline before they exist, so a SIGKILLed owner leaves neither; the server's libpmix
threads start after the lifeline's fork (it forks at its creation, long before).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from collections.abc import Mapping

from . import pmixplan


def _usable_cpus() -> int:
    """The CPUs this host's instances may run on: this process's (they inherit it)."""
    try:
        return len(os.sched_getaffinity(0))
    except OSError:
        return os.cpu_count() or 1


class PmixHost:
    def __init__(self, path: str, lifeline, hostname: str,
                 loop: asyncio.AbstractEventLoop, given: str | None = None) -> None:
        """`given`: the libpmix the user named (--libpmix), for the agents too."""
        self.path, self.hostname, self.loop = path, hostname, loop
        self.given = given
        self._lifeline = lifeline
        self.server = None  # spawner.pmixserver.PmixServer, once a world needs it
        self._starting: threading.Thread | None = None
        self._start_error: BaseException | None = None
        self._saved_env: dict[str, str | None] = {}
        self._tmpdir: str | None = None
        self._shm: dict[str, str] = {}  # nspace -> its segments' directory

    @property
    def version(self) -> str:
        return self.server.version if self.server is not None else ""

    def prestart(self, kvsname: str) -> None:
        """Start the server in a thread now, while the launch prepares the rest: its start
        (~30-60 ms here, libpmix's own initialisation) is then off the launch's path. The
        first `open()` waits for it. `kvsname`: any of the job's (its directory is named
        after the job, for `poprunctl reap`: spawner/reaphere.pmix_prefixes)."""
        from .pmixserver import SERVER_MCA, PmixServer
        from .reaphere import pmix_prefixes

        tmp, _ = pmix_prefixes(kvsname)
        self._tmpdir = self._make_dir(os.path.basename(tmp), os.path.dirname(tmp))
        self.server = PmixServer(self.path, self._tmpdir, self.hostname, self.loop)
        # Set here, in the loop's thread, not by the starting one: os.environ is changed in
        # one thread only. The instances' environments are built from copies made earlier.
        self._saved_env = {key: os.environ.get(key) for key in SERVER_MCA}
        os.environ.update(SERVER_MCA)
        self._starting = threading.Thread(target=self._start_in_thread,
                                          name="poprun-pmix-start", daemon=True)
        self._starting.start()

    def _start_in_thread(self) -> None:
        try:
            self.server.start()
        except BaseException as exc:  # noqa: BLE001 - raised by open(), in the loop's thread
            self._start_error = exc

    def _started(self, kvsname: str) -> None:
        if self._starting is None:
            self.prestart(kvsname)
        self._join()
        if self._start_error is not None:
            raise self._start_error

    def _join(self) -> None:
        """Wait for the server's start, then take its parameters out of the environment."""
        if self._starting is not None:
            self._starting.join()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env = {}

    def _make_dir(self, prefix: str, parent: str | None = None) -> str:
        if self._lifeline is not None:
            return self._lifeline.make_temp_dir(prefix, parent)
        import tempfile

        return tempfile.mkdtemp(prefix=prefix, dir=parent)

    def open(self, world: pmixplan.World, handler):
        """`world`'s namespace here (a spawner.pmixserver.Namespace)."""
        from .reaphere import pmix_prefixes

        self._started(world.nspace)
        _, shm = pmix_prefixes(world.nspace)
        self._shm[world.nspace] = self._make_dir(os.path.basename(shm), os.path.dirname(shm))
        # In the server's directory: the lifeline and `poprunctl reap` remove it with that
        # (made again, private, where a /tmp cleaner took it meanwhile).
        os.makedirs(self._tmpdir, 0o700, exist_ok=True)
        os.mkdir(pmixplan.nsdir(self._tmpdir, world.nspace), 0o700)
        return self.server.open(world, handler)

    def instance_env(self, ns, rank: int, environ: Mapping[str, str] | None) -> dict[str, str]:
        """Every variable that leads `rank` to this server, and what Open MPI's mpirun would
        set for this host (pmixplan.instance_variables)."""
        return {**ns.client_env(rank),
                **pmixplan.instance_variables(dict(environ or {}), self._shm[ns.world.nspace],
                                              len(ns.world.local_ranks), _usable_cpus())}

    def close_world(self, ns) -> None:
        """The world's instances are gone: its namespace and segments go."""
        ns.close()
        shutil.rmtree(pmixplan.nsdir(self._tmpdir, ns.world.nspace), ignore_errors=True)
        path = self._shm.pop(ns.world.nspace, None)
        if path is not None:
            self._remove(path)

    def _remove(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)
        if self._lifeline is not None:
            self._lifeline.discard_dir(path)

    def close(self) -> None:
        """The job ends: the server stops and its directory goes."""
        for path in list(self._shm.values()):
            self._remove(path)
        self._shm.clear()
        self._join()
        if self.server is not None:
            self.server.close()
            self.server = None
        if self._tmpdir is not None:
            self._remove(self._tmpdir)
            self._tmpdir = None
