"""What a person sees: the live dashboard, text renderings (plan tables, dry run, report),
rich consoles.

Imports plan and the leaves only."""
