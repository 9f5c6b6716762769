"""The launcher's side of the instances' worlds (docs/architecture.md, "The instances'
worlds"): the root that combines what the hosts' worlds send. PMI-1's (`pmi1`: the root
server, its key-value space and world-wide barrier), Open MPI's PMIx (`pmix`: the fences and
direct modex across hosts), MPI_Comm_spawn's worlds (`spawn`) and Horovod's Gloo rendezvous
(`horovod`). Part of `run/` (a launch while it runs): the same layer rule."""
