"""The error types every layer may raise; the CLI prints a UserError as one line and exits 2,
a RunFailed as one line and exits 1."""

from __future__ import annotations

import errno


class UserError(Exception):
    """An input the user can fix (config, data, model choice); printed without a traceback."""


class ConfigError(UserError, ValueError):
    """A configuration value or key is wrong; the message says which and how to fix it."""


class StoppedAndKept(KeyboardInterrupt):
    """A Ctrl-C a command has handled: it kept what it finished and said so (and how to resume);
    the CLI exits 130 without the `aborted` of an unhandled one."""


class RunFailed(Exception):
    """A run stopped because going on would produce garbage (e.g. gradients non-finite step after
    step); the message says why and what was kept."""


def named_by_flag(path: object, flag: str = "") -> str:
    """How a message names a path: after the flag the user gave it with (`--data x.jsonl`), if any."""
    return f"{flag} {path}" if flag else str(path)


# OS errors about the user's paths and disks: the user can fix them, so they are one line, exit 2.
_USER_ERRNOS = {errno.EACCES: "permission denied (this user may not read or write it)",
                errno.EPERM: "operation not permitted", errno.EISDIR: "is a folder, a file was expected",
                errno.ENOTDIR: "a path component is not a folder", errno.EEXIST: "already exists",
                errno.EBUSY: "busy (a mount point, or the current folder)", errno.EROFS: "read-only file system",
                errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                errno.EFBIG: "file too large for this file system or limit", errno.ENAMETOOLONG: "name too long",
                errno.ELOOP: "too many symbolic links"}


def os_error_reason(error: OSError) -> str | None:
    """What is wrong, in words and by the errno's name ("no space left on the device (ENOSPC)"),
    for the OS errors a user's paths and disks give; None for any other (a bug: its traceback is wanted)."""
    reason = _USER_ERRNOS.get(error.errno)
    if reason is None:
        return None
    return f"{reason} ({errno.errorcode.get(error.errno, '')})"
