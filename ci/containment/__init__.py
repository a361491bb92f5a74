"""The containment smoke test: a network-namespace lab that proves the contained browser reaches nothing
it shouldn't. ``ci/containment-smoke`` runs it; ``ci/README.md`` says what it does and what a pass means."""

import sys
from pathlib import Path

# The lab shares its DNS server and namespace helpers with the test suite (tests/dnslab.py, lab_util.py).
_TESTS = str(Path(__file__).resolve().parents[2] / "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
