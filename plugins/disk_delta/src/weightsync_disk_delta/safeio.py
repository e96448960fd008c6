"""Reading a shared root without trusting it. Every path component below the root is opened
relative to the one before with O_NOFOLLOW, so no symbolic link can lead outside the root (or
anywhere at all); only regular files are read, so a FIFO or a device is refused before it is
opened for reading (nothing blocks, nothing streams forever); and never more bytes are read than
the caller allows, so what a file claims cannot cost memory."""

from __future__ import annotations

import errno
import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from weightsync.errors import PayloadError


class Missing(PayloadError):
    """The file or directory does not exist (a version that was never published, or retired)."""

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _refuse(path: Path, e: OSError, want: str) -> PayloadError:
    if e.errno == errno.ENOENT:
        return Missing(f"{path} is missing")
    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        return PayloadError(f"{path} (or a directory above it) is a symbolic link or not {want}; "
                            f"a published root holds only real directories and regular files, "
                            f"so nothing behind it was read")
    return PayloadError(f"{path} cannot be read ({e.strerror})")


@contextmanager
def open_dir(root: Path, parts: Sequence[str]) -> Iterator[int]:
    """A descriptor of root/parts..., every part opened with O_NOFOLLOW below the root (the root
    itself is the operator's choice and may be a link)."""
    path = root
    try:
        fd = os.open(root, _DIR)
    except OSError as e:
        raise _refuse(root, e, "a directory") from None
    try:
        for part in parts:
            _check_part(part)
            path = path / part
            try:
                nfd = os.open(part, _DIR | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                raise _refuse(path, e, "a directory") from None
            os.close(fd)
            fd = nfd
        yield fd
    finally:
        os.close(fd)


def _check_part(part: str) -> None:
    if not part or part in (".", "..") or "/" in part or "\0" in part:
        raise PayloadError(f"path component {part!r} is not allowed")


def _open_regular(root: Path, parts: Sequence[str]) -> tuple[int, os.stat_result, Path]:
    """(descriptor, its stat, path) of a regular file root/parts..., refused before it is opened
    when it is anything else."""
    *dirs, leaf = parts
    _check_part(leaf)
    path = root.joinpath(*parts)
    with open_dir(root, dirs) as dfd:
        try:
            st = os.stat(leaf, dir_fd=dfd, follow_symlinks=False)
        except OSError as e:
            raise _refuse(path, e, "a regular file") from None
        if not stat.S_ISREG(st.st_mode):
            raise PayloadError(f"{path} is {_kind(st.st_mode)}, not a regular file; a published "
                               f"root holds only regular files, so it was not read")
        try:
            fd = os.open(leaf, _FILE, dir_fd=dfd)
        except OSError as e:
            raise _refuse(path, e, "a regular file") from None
    st2 = os.fstat(fd)
    if not stat.S_ISREG(st2.st_mode) or (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise PayloadError(f"{path} was replaced while it was opened; it was not read")
    return fd, st2, path


def stat_regular(root: Path, parts: Sequence[str]) -> int:
    """The size of a regular file root/parts... (PayloadError if it is missing, a link, or not a
    regular file)."""
    fd, st, _ = _open_regular(root, parts)
    os.close(fd)
    return st.st_size


def read_regular(root: Path, parts: Sequence[str], *, limit: int, exact: int | None = None
                 ) -> bytearray:
    """The bytes of a regular file root/parts..., at most `limit` of them, or exactly `exact`:
    a file of any other size is refused before it is read."""
    fd, st, path = _open_regular(root, parts)
    try:
        size = st.st_size
        if exact is not None and size != exact:
            raise PayloadError(f"{path} holds {size} bytes, but the manifest says {exact}; it was "
                               f"not read")
        if size > limit:
            raise PayloadError(f"{path} holds {size} bytes, more than the {limit} a file of its kind "
                               f"may hold; it was not read")
        buf = bytearray(size)
        view = memoryview(buf)
        got = 0
        while got < size:
            n = os.readv(fd, [view[got:]])
            if n == 0:
                break
            got += n
        if got != size or os.read(fd, 1):
            raise PayloadError(f"{path} changed size while it was read; it was not used")
        return buf
    except OSError as e:
        raise _refuse(path, e, "a regular file") from None
    finally:
        os.close(fd)


def hash_regular(root: Path, parts: Sequence[str], exact: int, chunk: int = 8 << 20) -> str:
    """xxh3-128 of a regular file root/parts... of exactly `exact` bytes, read in chunks (no
    copy of it is kept)."""
    import xxhash
    fd, st, path = _open_regular(root, parts)
    try:
        if st.st_size != exact:
            raise PayloadError(f"{path} holds {st.st_size} bytes, but the manifest says {exact}; "
                               f"it was not read")
        h = xxhash.xxh3_128()
        got = 0
        while got < exact:
            b = os.read(fd, min(chunk, exact - got))
            if not b:
                break
            h.update(b)
            got += len(b)
        if got != exact or os.read(fd, 1):
            raise PayloadError(f"{path} changed size while it was read; it was not used")
        return h.hexdigest()
    except OSError as e:
        raise _refuse(path, e, "a regular file") from None
    finally:
        os.close(fd)


def list_dir(root: Path, parts: Sequence[str]) -> list[str]:
    """Names in root/parts... ([] when it is missing)."""
    try:
        with open_dir(root, parts) as fd:
            return os.listdir(fd)
    except Missing:
        return []
