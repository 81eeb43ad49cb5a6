"""The machine a benchmark runs on (versions, the filesystem of a directory) and the files
under a directory (sizes, dropping their page cache)."""

import os
import platform


def files_under(root: str) -> dict:
    """{absolute path: size} of every regular file under ``root``."""
    found = {}
    if os.path.isdir(root):
        for dirpath, _, names in os.walk(root):
            for name in names:
                path = os.path.join(dirpath, name)
                if os.path.isfile(path):
                    found[os.path.abspath(path)] = os.path.getsize(path)
    return found


def filesystem_of(path: str) -> str:
    """Mount point and type of the filesystem holding ``path`` (Linux), else ''."""
    try:
        real = os.path.realpath(path)
        best = ("", "")
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                mount, fstype = fields[1], fields[2]
                if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best[0]):
                    best = (mount, fstype)
        return f"{best[1]} at {best[0]}" if best[0] else ""
    except OSError:
        return ""


def versions() -> str:
    """``Python x, torch y, deepspeed z``: the machine line of every benchmark's header."""
    from importlib import metadata
    parts = [f"Python {platform.python_version()}"]
    for package in ("torch", "deepspeed"):
        try:
            parts.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{package} not installed")
    return ", ".join(parts)


def evict_page_cache(root: str) -> None:
    """Write back and drop the page cache of every file under ``root`` (no root needed:
    ``posix_fadvise(DONTNEED)`` on files this user can read), so a load reads storage."""
    os.sync()
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)
