"""Pure planning: the configuration, host lists, mpirun arguments, topologies, placement,
Poplar options, and the plan of a launch. No process, socket or terminal is touched here
(sysfs and small config files are read through narrow functions).

Imports the leaves only."""
