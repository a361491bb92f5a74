"""Files a squid started by a test can use: squid started as root works as its cache_effective_user
('proxy' on Debian), which must read its configuration and write its logs."""

from __future__ import annotations

import os
import pwd
from pathlib import Path


def hand_to_squid_user(workdir: Path) -> None:
    """Give ``workdir`` and the files directly in it to squid's user (when running as root)."""
    try:
        user = pwd.getpwnam("proxy")
    except KeyError:
        user = None
    for path in (workdir, *workdir.iterdir()):
        if user is not None and os.geteuid() == 0:
            os.chown(path, user.pw_uid, user.pw_gid)
        path.chmod(0o755 if path.is_dir() else 0o644)
