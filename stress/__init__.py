"""Reliability campaigns (issue 14): evidence at scale that a save commits atomically,
survives kills, power loss, I/O errors and corruption, and leaks nothing.

One module per campaign, each with ``run(size) -> result`` (``trials``, ``failures``,
``seconds``, ``details``; ``size`` is ``"small"``, run by `make test` through
``tests/test_stress.py``, or ``"full"``, run by ``make stress``) and ``able_to_fail()``:
the same checks run on deliberately broken save paths, which they must catch.

``python -m stress --size full`` runs them, writes the raw results to
``docs/reliability.json`` and rewrites the generated parts of ``docs/reliability.md``
from it (`stress.report`); no figure in that page is typed by hand.

Shared machinery: `stress.fsops` (interposes on the ``os`` calls of a local save to
record, fail or skip them), `stress.crashstate` (what a power loss can leave),
`stress.workload` (the job every campaign checkpoints, and broken commit strategies).
"""

from __future__ import annotations

CAMPAIGNS = {
    "kill": "1. kill -9 at random moments",
    "killranks": "1b. kill -9 at two ranks",
    "incremental": "1c. kill -9 with incremental checkpoints",
    "nodekill": "1d. A node lost, with replicas on its peer",
    "powerloss": "2. Power-loss replay",
    "powerlossranks": "2b. Power-loss replay at two ranks",
    "ioerrors": "3. I/O errors",
    "ioranks": "3b. I/O errors at two ranks",
    "corruption": "4. Corruption",
    "corruptranks": "4b. Corruption of two-rank checkpoints",
    "hostile": "5. Hostile inputs",
    "objectstore": "6. Object storage faults",
    "objectstoreranks": "6b. Object storage faults at two ranks",
    "endurance": "7. Endurance",
    "enduranceranks": "7b. Endurance at two ranks",
}
"""Every campaign of the issue, in its order; those without a module are not done yet."""

DONE = (
    "kill",
    "killranks",
    "incremental",
    "nodekill",
    "powerloss",
    "powerlossranks",
    "ioerrors",
    "ioranks",
    "corruption",
    "corruptranks",
    "hostile",
    "objectstore",
    "objectstoreranks",
    "endurance",
    "enduranceranks",
)
