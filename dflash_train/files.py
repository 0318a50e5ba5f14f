"""Outputs: atomic writes, and the one rule every command that writes follows.

Every write here goes to a hidden sibling first, is fsynced, and is renamed into place; the
parent folder is fsynced after the rename so the new name survives a power cut. A folder that
already exists is renamed aside before the new one takes its name, and removed only once the
new one is in place: at no moment is neither on disk. What they create gets the mode a plain
`open()` would give it under the user's umask (mkstemp/mkdtemp alone make it private).

The rule for outputs: a command never overwrites a file or folder it did not create
(`check_new_output`) and never writes into its own inputs (`check_outside_inputs`); an output is
owned by one live process at a time (`hold_output`: a kernel lock, released when the process
ends however it ends); what a killed writer left beside an output is cleaned, or put back,
before the output is written again (`recover_interrupted_write`). A command that writes one file
at its end does all of that through `NewFileOutput`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import unicodedata
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable

from .errors import ConfigError, UserError, named_by_flag, os_error_reason


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes, read in 16 MiB pieces (never whole in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


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


def _fsynced_sibling(path: Path, write: Callable[[BinaryIO], object], mode: int | None) -> Path:
    """What `write` writes to its handle, in a hidden temporary file beside `path` (made first),
    fsynced, with `mode` (default: the umask's); the caller gives it its name or removes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp, umask_mode() if mode is None else mode)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return Path(temp)


def write_file_atomic(path: str | Path, write: Callable[[BinaryIO], object], mode: int | None = None) -> Path:
    """`path` replaced, all at once, by what `write(handle)` writes (streamed: a large file is never
    held in memory whole); a crash leaves the old file or the new one, never a mix."""
    path = Path(path)
    temp = _fsynced_sibling(path, write, mode)
    try:
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_bytes_atomic(path: str | Path, data: bytes, mode: int | None = None) -> Path:
    return write_file_atomic(path, lambda handle: handle.write(data), mode)


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
    return check_outside_inputs(out, flag, inputs)


def check_outside_inputs(path: str | Path, flag: str, inputs: Iterable[str | Path] = ()) -> Path:
    """Refuse an output path below a file, or inside or equal to one of the command's `inputs`
    (for outputs a command may resume or add to, which `check_new_output` would refuse)."""
    if str(path) == "-":
        raise ConfigError(f"{flag} -: standard output is not an output here; give a file path")
    out = Path(path)
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


def check_folder_name(name: str, where: str, taken: Iterable[str] = ()) -> str:
    """`name` as the key two folder names are the same under (Unicode-normalised, case-folded for
    case-insensitive disks); refuses a name that is not a plain folder name (letters, digits, '-',
    '_', '.', not first: no separator, never `..` or a hidden staging name), and one of `taken`
    (what its parent holds besides)."""
    key = unicodedata.normalize("NFC", name).casefold()
    if not name or name.startswith(".") or not all(c.isalnum() or c in "-_." for c in name):
        raise ConfigError(f"{where} {name!r}: use a plain folder name (letters, digits, '-', '_', '.' but not first): "
                          "it names a folder inside --out")
    if key in {t.casefold() for t in taken}:
        raise ConfigError(f"{where} {name!r}: the run writes its own {name} there; choose another name")
    return key


def umask_mode(executable: bool = False) -> int:
    """The mode a plain `open()` would give a new file (or folder, `executable=True`) under the
    process's umask: mkstemp/mkdtemp create private ones, which a server running as another user
    cannot read."""
    return (0o777 if executable else 0o666) & ~_current_umask()


def _current_umask() -> int:
    # Read, not set and restored: setting it would, for an instant, apply to files other threads create.
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)  # no /proc: a file created by another thread meanwhile is private, never open to all
    os.umask(mask)
    return mask


def apply_umask(root: Path) -> None:
    """Give `root` and everything below it the modes the umask gives new files and folders: some
    writers (safetensors' `save_file`, mkstemp, mkdtemp) create private ones whatever the umask."""
    file_mode, folder_mode = umask_mode(), umask_mode(executable=True)
    os.chmod(root, folder_mode)
    for written in root.rglob("*"):
        if not written.is_symlink():
            os.chmod(written, folder_mode if written.is_dir() or _is_program(written) else file_mode)


def _is_program(path: Path) -> bool:
    """A file its writer made executable (a built binary): it stays executable when modes are reset."""
    return path.is_file() and bool(path.stat().st_mode & 0o100)


def write_new_file_atomic(path: str | Path, data: bytes, flag: str = "") -> Path:
    """Write `data` to `path`, which must not exist: fsynced and complete or absent, never over a
    file that appeared meanwhile. If one did, the data goes to the first free `NAME.N.SUFFIX`
    beside it (returned), so neither the other file nor this result is lost. A write the disk
    refuses (full, a size limit, read-only), or no free name, is one `UserError` naming `flag`
    (the user's flag for `path`, if any) and the file; nothing is left under any of the names."""
    path = Path(path)
    named = named_by_flag(path, flag)
    try:
        temp = _fsynced_sibling(path, lambda handle: handle.write(data), None)
    except OSError as error:
        reason = os_error_reason(error)
        if reason is None:
            raise
        # A failed write of an open file names no file: name it here, with the flag that chose it.
        raise UserError(f"{named}: cannot write it: {reason}; nothing was written there") from error
    try:
        _pause_for_tests("before_final_link")
        for attempt in range(1000):
            target = path if attempt == 0 else path.with_name(f"{path.stem}.{attempt}{path.suffix}")
            try:
                os.link(temp, target)  # creates the name only if it is free, atomically
            except FileExistsError:
                continue
            break
        else:
            raise UserError(f"{named}: cannot write it: it and every numbered name beside it ({path.stem}.1{path.suffix} "
                            f"to {target.name}) exist; nothing was written (move some away, or choose another "
                            f"{flag or 'path'})")
    finally:
        temp.unlink(missing_ok=True)
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
        apply_umask(staging)
        fsync_tree(staging)
        if final_dir.exists():
            aside = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.old.", dir=final_dir.parent))
            os.replace(final_dir, aside / final_dir.name)
        _pause_for_tests("before_final_rename")
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
                os.chmod(written, 0o755 if written.is_dir() or _is_program(written) else 0o644)
        else:
            apply_umask(staging)
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
    return [entry for entry in sorted(folder.iterdir()) if _clean_leftover(folder, entry)]


def recover_interrupted_write(final: str | Path) -> list[str]:
    """`remove_leftover_staging` for the one output `final` (only the hidden names its own writes
    use, so a user's folder holding it is otherwise untouched): what an earlier write of it,
    killed between its steps, left beside it. Returns one line per thing cleaned or put back.
    Call while holding `hold_output(final)`."""
    final = Path(final)
    if not final.parent.is_dir():
        return []
    said = []
    for entry in sorted(final.parent.iterdir()):
        match = _ASIDE.fullmatch(entry.name) or _STAGING.fullmatch(entry.name)
        if match and match["name"] == final.name:
            said.append(_clean_leftover(final.parent, entry))
    return [line for line in said if line]


def _clean_leftover(folder: Path, entry: Path) -> str | None:
    """Clean one leftover of a killed writer; a line saying what was done, None if `entry` is not one."""
    aside = _ASIDE.fullmatch(entry.name)
    if aside and entry.is_dir():
        kept, final = entry / aside["name"], folder / aside["name"]
        if kept.exists() and not final.exists():
            os.replace(kept, final)
            fsync_dir(folder)
            shutil.rmtree(entry, ignore_errors=True)
            return (f"put back {final}: a write that was replacing it was killed and had left it hidden "
                    f"as {entry / aside['name']}")
        shutil.rmtree(entry, ignore_errors=True)
        return f"removed {entry}: the old copy of {final} that a killed write had already replaced"
    if _STAGING.fullmatch(entry.name):
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        return f"removed {entry}: the unfinished copy a killed write left"
    return None


# --- one live process per output -----------------------------------------------------------------

class OutputInUse(UserError):
    """Another live process holds the output (it is named with its pid)."""


class OutputLock:
    """An exclusive `flock` on `.NAME.lock` beside the output NAME, held while a command writes it.
    The kernel drops the lock when the holding process ends, kill -9 included, so a crash never
    leaves an output locked; the file is removed on release (and the inode is re-checked after
    locking, so a process that opened it just before that removal does not lock a dead file).

    Missing folders above the output are made (`--out runs/new/p.jsonl` works like `mkdir -p`),
    and removed again on release if the output was never written and they are still empty: a run
    that fails leaves the disk as it found it. A folder another process made, or that holds
    anything, is kept."""

    def __init__(self, output: str | Path, flag: str):
        resolved = Path(output).resolve()
        if resolved.parent == resolved:
            raise ConfigError(f"{flag} {output}: the root folder cannot be an output")
        self.output, self.flag, self._final = Path(output), flag, resolved
        self.path = resolved.parent / f".{resolved.name}.lock"
        self._fd: int | None = None
        self._made: list[Path] = []  # the folders above the output this process made, outermost first

    def acquire(self) -> "OutputLock":
        check_outside_inputs(self.output, self.flag)  # a parent that is a file: one line, not a traceback
        try:
            self._fd = self._lock()
            os.ftruncate(self._fd, 0)
            # The program and its first argument (`dflash-train train`): enough to recognise it, no flag values.
            program = " ".join([Path(sys.argv[0]).name, *sys.argv[1:2]]) if sys.argv and sys.argv[0] else "python"
            os.write(self._fd, f"pid {os.getpid()}: {program[:100]}\n".encode("utf-8", "replace"))
        except BaseException:
            self.release()
            raise
        return self

    def _lock(self) -> int:
        while True:
            self._make_parents()
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)  # the umask applies
            except FileNotFoundError:
                if self._missing_folders():
                    continue  # another process that had made the folder too removed it as it ended: make it again
                raise ConfigError(f"{self.flag} {self.output}: {self.path.parent} cannot hold files "
                                  "(a dangling link, or a system folder)") from None
            except OSError as error:  # the lock beside the output is ours: name the flag, not the lock
                reason = os_error_reason(error)
                if reason is None:
                    raise
                raise ConfigError(f"{self.flag} {self.output}: cannot write in {self.path.parent}: {reason}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _lock_holder(fd)
                os.close(fd)
                raise OutputInUse(f"{self.flag} {self.output} is in use by another live process ({holder}); "
                                  f"wait for it to end, or choose another {self.flag}") from None
            try:
                current = os.stat(self.path)
            except FileNotFoundError:
                current = None
            opened = os.fstat(fd)
            if current is not None and (current.st_ino, current.st_dev) == (opened.st_ino, opened.st_dev):
                return fd
            os.close(fd)  # the holder removed the file as we opened it: lock the new one

    def _missing_folders(self) -> list[Path]:
        """The folders above the output that do not exist, innermost first."""
        missing, folder = [], self.path.parent
        while not os.path.lexists(folder):
            missing.append(folder)
            folder = folder.parent
        return missing

    def _make_parents(self) -> None:
        for folder in reversed(self._missing_folders()):
            try:
                folder.mkdir()
            except FileExistsError:
                continue  # another process made it meanwhile: not ours to remove
            self._made.append(folder)

    def release(self) -> None:
        if self._fd is not None:
            try:
                if os.path.samestat(os.stat(self.path), os.fstat(self._fd)):
                    self.path.unlink()
            except FileNotFoundError:
                pass
            os.close(self._fd)  # closing drops the lock
            self._fd = None
        if not os.path.lexists(self._final):
            for folder in reversed(self._made):
                if not remove_if_empty(folder):
                    break
        self._made = []

    def __enter__(self) -> "OutputLock":
        return self if self._fd is not None else self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def remove_if_empty(folder: Path) -> bool:
    """Remove `folder` if it holds nothing (what was written into it keeps it); whether it went."""
    try:
        folder.rmdir()
    except OSError:
        return False
    return True


def hold_output(output: str | Path, flag: str) -> OutputLock:
    """Take the output `output` (named by `flag` in messages) for this process, or refuse with
    `OutputInUse` naming the live holder's pid. Use as `with hold_output(out, "--out"):`."""
    return OutputLock(output, flag).acquire()


class NewFileOutput:
    """The one file a command writes at its end (`eval --json`, `eval-merge --json`, `prompts
    --out`, `self-prompts --out`, `export --format gguf`), the same way for each: held by this
    process from the start (`hold_output`), cleaned first of what an earlier write of it left when
    killed midway (`recover_interrupted_write`, each line given to `say`), written once at the end
    (`write_new_file_atomic`). `with NewFileOutput(path, "--json") as output: ... output.write(data)`."""

    def __init__(self, path: str | Path, flag: str, say: Callable[[str], object] = print):
        self.path, self.flag, self.say = Path(path), flag, say
        self._lock = OutputLock(path, flag)

    def __enter__(self) -> "NewFileOutput":
        self._lock.acquire()
        try:
            for line in recover_interrupted_write(self.path.resolve()):
                self.say(line)
        except BaseException:
            self._lock.release()
            raise
        return self

    def write(self, data: bytes) -> Path:
        """`data` under the output's name (or, if a file took that name meanwhile, the first free
        numbered name beside it: returned); a write the disk refuses is one line naming the flag."""
        return write_new_file_atomic(self.path, data, self.flag)

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def _lock_holder(fd: int) -> str:
    """What the holder wrote into the lock file (it writes right after locking: wait a moment)."""
    for _ in range(20):
        text = os.pread(fd, 400, 0).decode("utf-8", "replace").strip()
        if text:
            return text
        time.sleep(0.05)
    return "its pid is not recorded yet"


class _Resumed(Exception):
    pass


def _resume(_signum: int, _frame: object) -> None:
    raise _Resumed


def _pause_for_tests(point: str) -> None:
    """Sleep at a named point of a write when DFLASH_TEST_PAUSE_AT says so, so a test can kill a
    real process exactly there (`POINT:SECONDS`), or change the disk under it and let it go on
    (SIGUSR1 ends the pause); it prints the point first, to be waited for."""
    wanted = os.environ.get("DFLASH_TEST_PAUSE_AT", "")
    if wanted.partition(":")[0] != point:
        return
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGUSR1, _resume) if main else None
    try:
        print(f"paused at {point}", file=sys.stderr, flush=True)
        time.sleep(float(wanted.partition(":")[2] or 60))
    except _Resumed:
        pass
    finally:
        if main:
            signal.signal(signal.SIGUSR1, previous)
