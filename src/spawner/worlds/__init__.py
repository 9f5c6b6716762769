"""A host's side of the instances' worlds (docs/architecture.md, "The instances' worlds"):
what serves this host's instances, on the launcher's host and on an agent's alike. PMI-1's
server (`pmi1`), its sockets, wire words and spawn message; MPI's published names
(`mpinames`); the PMIx server, its process, gate and link (`pmix*`); the node-level world an
agent runs (`nodeworld`).

Nothing is imported here: the PMIx server's process starts with `python -m
spawner.worlds.pmixproc`, and a job without MPI imports none of this package's modules but
`pmi1ends`."""
