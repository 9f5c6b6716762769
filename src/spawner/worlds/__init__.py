"""A host's side of the instances' worlds (docs/architecture.md, "The instances' worlds"):
what serves this host's instances, on the launcher's host and on an agent's alike. PMI-1's
server (`pmi1`), its sockets, wire words and spawn message; MPI's published names
(`mpinames`); the PMIx server, its process, gate and link (`pmix*`); the node-level world an
agent runs (`nodeworld`).

Nothing is imported here: each module loads where it is first needed (the PMIx server's
process, a fork of its spawner, imports `pmixproc` and what it needs only in the child;
PMI-1's server is imported once an instance first speaks)."""
