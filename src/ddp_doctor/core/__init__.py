"""core: the typed data every stage shares, and the few helpers under all of them.

The finding codes (`codes`), typed errors (`errors`), a rank's observations and the model it wrapped (`records`),
the findings and the diagnosis (`findings`), the figures' data (`figures`), the files a rank leaves for the
supervisor (`rankfiles`, `beacon`, `phase`), rank lists in words (`ranks`), stack frames (`frames`), what differs
between torch versions (`compat`) and logging helpers (`log`). Nothing here imports from another stage.
"""

from __future__ import annotations

VERSION = "0.1.0"
"""The tool's version (`ddp_doctor.__version__`, the report's `tool_version`)."""
CHECK_ENV_VAR = "DDP_DOCTOR_CHECK"
"""Set in the environment of every rank that `ddp-doctor check` (or `bench`) starts, to the rank's `RankConfig`:
a framework callback in such a rank stands by, as the launcher follows the model already."""
