"""Atomic file and folder writes: a reader sees the old content or the new, never a mix.

Every write here goes to a hidden sibling first, is fsynced, and is renamed into place; the
parent folder is fsynced after the rename so the new name survives a power cut. A folder that
already exists is renamed aside before the new one takes its name, and removed only once the
new one is in place: at no moment is neither on disk.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

from .errors import ConfigError


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside `path` durable (a no-op where the platform cannot open folders)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file below `root`, then every folder, deepest first."""
    for folder, _dirs, names in os.walk(root, topdown=False):
        for name in names:
            with open(os.path.join(folder, name), "rb") as handle:
                os.fsync(handle.fileno())
        fsync_dir(folder)


def write_bytes_atomic(path: str | Path, data: bytes, mode: int | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(temp, mode)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_text_atomic(path: str | Path, text: str, mode: int | None = None) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"), mode)


def write_json_atomic(path: str | Path, data: Any, mode: int | None = None, **dump: Any) -> Path:
    return write_text_atomic(path, json.dumps(data, **({"indent": 1} | dump)) + "\n", mode)


def check_new_output(path: str | Path, flag: str, inputs: Iterable[str | Path] = ()) -> Path:
    """Refuse, before any work starts, an output path that would overwrite something: one that
    exists (a file, a folder or a dangling link), one below a file, or one inside or equal to any
    of the command's `inputs` (its models, data and prompts are never written into)."""
    out = Path(path)
    if os.path.lexists(out):
        kind = "a folder" if out.is_dir() else "a file"
        raise ConfigError(f"{flag} {path} already exists ({kind}); choose a new path (nothing is ever overwritten)")
    for parent in out.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{flag} {path}: {parent} is a file, not a folder")
            break
    resolved = out.resolve()
    for item in inputs:
        if not item:
            continue
        source = Path(item).resolve()
        if resolved == source or source in resolved.parents:
            raise ConfigError(f"{flag} {path} is inside the input {item}; write outputs outside a command's inputs")
    return out


def umask_mode(executable: bool = False) -> int:
    """The mode a plain `open()` would give a new file (or folder, `executable=True`) under the
    process's umask: mkstemp/mkdtemp create private ones, which a server running as another user
    cannot read."""
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if executable else 0o666) & ~mask


def write_new_file_atomic(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path`, which must not exist: fsynced and complete or absent, never over a
    file that appeared meanwhile. If one did, the data goes to the first free `NAME.N.SUFFIX`
    beside it (returned), so neither the other file nor this result is lost."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp, umask_mode())
        for attempt in range(1000):
            target = path if attempt == 0 else path.with_name(f"{path.stem}.{attempt}{path.suffix}")
            try:
                os.link(temp, target)  # creates the name only if it is free, atomically
            except FileExistsError:
                continue
            break
        else:
            raise FileExistsError(f"{path} and 999 numbered siblings exist")
    finally:
        Path(temp).unlink(missing_ok=True)
    fsync_dir(path.parent)
    return target


def write_dir_atomically(final_dir: str | Path, build: Callable[[Path], None]) -> Path:
    """Run `build(staging)` in a hidden sibling folder, fsync it, then put it at `final_dir`.

    An existing `final_dir` is renamed aside first and deleted only after the new folder took
    its name; a crash at any point leaves the old folder (under its name or aside) or the new
    one, never a half-written folder under the final name. Whether replacing `final_dir` is
    allowed at all is the caller's decision (see `export.check_export_target`)."""
    final_dir = Path(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.", dir=final_dir.parent))
    aside: Path | None = None
    try:
        build(staging)
        fsync_tree(staging)
        if final_dir.exists():
            aside = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.old.", dir=final_dir.parent))
            os.replace(final_dir, aside / final_dir.name)
        os.replace(staging, final_dir)
        fsync_dir(final_dir.parent)
    except BaseException:
        if aside is not None and (aside / final_dir.name).exists() and not final_dir.exists():
            os.replace(aside / final_dir.name, final_dir)  # put the old folder back
        raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
        if aside is not None and final_dir.exists():
            shutil.rmtree(aside, ignore_errors=True)
    return final_dir



def publish_dir_once(
    final_dir: str | Path, build: Callable[[Path], None], *, is_complete: Callable[[Path], bool],
    staging_prefix: str | None = None, shared: bool = False,
) -> Path:
    """A folder written once and never replaced (a cache entry several processes may race to
    fill): `build(staging)`, fsync, rename to `final_dir`. If another process published a
    complete `final_dir` first, theirs is kept and ours discarded. `shared` makes the folder
    readable by everyone (mkdtemp and some writers make files private)."""
    final_dir = Path(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=staging_prefix or f".{final_dir.name}.", dir=final_dir.parent))
    try:
        build(staging)
        if shared:
            os.chmod(staging, 0o755)
            for written in staging.rglob("*"):
                os.chmod(written, 0o755 if written.is_dir() else 0o644)
        fsync_tree(staging)
        try:
            os.rename(staging, final_dir)
        except OSError:
            if not is_complete(final_dir):
                raise
            # Lost the race to a concurrent writer of the same entry: theirs is as good as ours.
        fsync_dir(final_dir.parent)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return final_dir

# The hidden names the writers above leave when killed between their steps: a staging folder
# `.NAME.XXXXXXXX`, a temporary file `.NAME.XXXXXXXX.tmp`, an old folder renamed aside
# `.NAME.old.XXXXXXXX/NAME` (XXXXXXXX: tempfile's 8 random characters).
_ASIDE = re.compile(r"\.(?P<name>.+)\.old\.[a-z0-9_]{8}")
_STAGING = re.compile(r"\.(?P<name>.+)\.[a-z0-9_]{8}(\.tmp)?")


def remove_leftover_staging(folder: str | Path) -> list[Path]:
    """Clean up after writers of this module killed mid-write in `folder`: staging folders and
    temporary files are removed; an old folder renamed aside whose replacement never took its
    name is put back under it. Returns what was removed. Call only while nothing writes there."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for entry in sorted(folder.iterdir()):
        aside = _ASIDE.fullmatch(entry.name)
        if aside and entry.is_dir():
            kept, final = entry / aside["name"], folder / aside["name"]
            if kept.exists() and not final.exists():
                os.replace(kept, final)
                fsync_dir(folder)
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        elif _STAGING.fullmatch(entry.name):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed
