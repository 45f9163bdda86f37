from __future__ import annotations

import sys
from pathlib import Path

# Rank functions are pickled by module name into forkserver children; make `tests` importable as top-level modules.
sys.path.insert(0, str(Path(__file__).parent))
