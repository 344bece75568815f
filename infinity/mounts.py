"""Which mount holds a path (its filesystem and device), read from /proc/self/mountinfo: what `infinity report`
and `infinity aio-bench` say about the folder they look at."""

from __future__ import annotations

import os
from dataclasses import dataclass

MOUNTINFO = "/proc/self/mountinfo"


@dataclass(frozen=True, slots=True)
class Mount:
    mount_point: str
    fstype: str
    source: str


def _unescape_mountinfo(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (\\040 ...)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def find_mount(path: str, mountinfo: str) -> Mount | None:
    """The mount holding ``path`` (absolute, resolved): the longest mount point that contains it."""
    best: Mount | None = None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 2:
            continue
        point = _unescape_mountinfo(fields[4])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.mount_point)):
            best = Mount(point, tail[0], _unescape_mountinfo(tail[1]))
    return best


def mount_of(path: str) -> Mount | None:
    """The mount holding ``path`` on this machine (None where /proc/self/mountinfo cannot be read)."""
    try:
        with open(MOUNTINFO) as f:
            return find_mount(os.path.realpath(path), f.read())
    except OSError:
        return None
