"""The contained Chromium: launcher, page reader, browser server, containment probe (see README.md)."""
