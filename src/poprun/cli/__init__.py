"""The commands people type: `poprun` (command, options, main, help) and `poprunctl` (ctl).

Top layer: it may import every other part of poprun; nothing imports it. Modules are imported
on first use (docs/architecture.md, "Measured reasons": import what a run needs, when it
needs it)."""
