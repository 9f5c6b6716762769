"""The instances' notes of the spare-host tests: a program that, in each attempt, writes what
its instance saw to `<where>/<rank>-<attempt>.json` (whole: written then renamed), waits until
every instance of the attempt has noted, then does what the test says; and the notes read
back."""

from __future__ import annotations

import json
from pathlib import Path

_NOTE_AND_WAIT = """
import json, os, sys, time, glob
where = sys.argv[1]
rank, attempt = os.environ["RANK"], int(os.environ.get("POPDIST_RESTART_COUNT", "0"))
note = {note}
with open(f"{{where}}/{{rank}}-{{attempt}}.tmp", "w") as fh:
    json.dump(note, fh)
os.rename(f"{{where}}/{{rank}}-{{attempt}}.tmp", f"{{where}}/{{rank}}-{{attempt}}.json")
deadline = time.monotonic() + 60
while len(glob.glob(f"{{where}}/*-{{attempt}}.json")) < int(os.environ["WORLD_SIZE"]):
    assert time.monotonic() < deadline, "the other instances' notes never came"
    time.sleep(0.02)
"""


def noting(note: str, then: str) -> str:
    """The program (`python -c` it with the notes' directory as its first argument): `note`
    is a Python expression (RANK, attempt and os are there), `then` what it does next."""
    return _NOTE_AND_WAIT.format(note=note) + then


def notes(where: Path) -> dict[str, dict]:
    """Every note written so far, by `<rank>-<attempt>`."""
    return {p.stem: json.loads(p.read_text()) for p in where.glob("*.json")}
