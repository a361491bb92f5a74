"""The containment probe: a static page that tries every escape route, and the runner that loads it
in the contained Chromium and reports each attempt. See README.md in this folder for the targets file."""

from .runner import OUTCOMES, ROUTES, ProbeError, load_targets, run_probe, validate_targets

PAGE_DIR = __import__("pathlib").Path(__file__).parent / "page"

__all__ = ["OUTCOMES", "PAGE_DIR", "ROUTES", "ProbeError", "load_targets", "run_probe", "validate_targets"]
