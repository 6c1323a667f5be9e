"""The executable cache (``enableExecutableCaching(path)`` / POPTORCH_CACHE_DIR).

Key: SHA-256 of the programs' popir graph hashes (before optimisation), the options that change compilation
and the code of popir, popsim and poptorch (a changed planner or lowering must not load an executable it did
not build, even at the same version number). Entry: ``_MAGIC``, the key, the SHA-256 of the key and the body,
then the body: the compiled popsim executable's ``to_bytes()`` (JSON and NumPy arrays; reading it runs no
code). An entry loads only for its own key: one stored under another key's name (swapped or copied files), a
damaged or truncated one, one that is not a valid executable or whose programs and variables are not the ones
asked for is logged once, deleted and recompiled. A directory that cannot be created, read or written is
logged once and the model runs uncached. The cache is bounded (POPTORCH_CACHE_MAX_BYTES, default 1 GiB): hits
refresh an entry's time and the least recently used entries are evicted first.
"""

import functools
import hashlib
import os
import pathlib
import tempfile

import popir
import popsim
import poptorch
from poptorch._logging import logger
from poptorch.errors import Error

_MAGIC = b"POPTORCH-EXE-2\n"
_SUFFIX = ".popexe"
_DIGEST_HEX = 64
MAX_BYTES_VARIABLE = "POPTORCH_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 1 << 30
_unusable_directories = set()  # each unusable directory is reported once per process
# Files whose contents decide what an executable is: sources, compiled extensions, templates.
_CODE_SUFFIXES = (".py", ".so", ".pyd", ".pyx", ".pxd", ".html")


def code_fingerprint(directories):
    """SHA-256 of the code files under ``directories`` (relative paths and contents, in a fixed order)."""
    digest = hashlib.sha256()
    for directory in directories:
        root = pathlib.Path(directory)
        for path in sorted(p for p in root.rglob("*") if p.suffix in _CODE_SUFFIXES and p.is_file()):
            digest.update(f"{path.relative_to(root)}\0{path.stat().st_size}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _installed_code():
    """The fingerprint of the installed popir, popsim and poptorch, computed once per process."""
    return code_fingerprint(os.path.dirname(package.__file__) for package in (popir, popsim, poptorch))


def key(graphs, options):
    """The cache key of compiling ``graphs`` ({program: Graph}) with ``options``."""
    digest = hashlib.sha256()
    digest.update(f"{poptorch.__version__};{_installed_code()};".encode())
    for name in sorted(graphs):
        digest.update(f"{name}={graphs[name].hash()};".encode())
    for option, value in sorted(options._compile_key().items()):
        digest.update(f"{option}={value};".encode())
    return digest.hexdigest()


def max_bytes_from_environment():
    """The cache's size bound: POPTORCH_CACHE_MAX_BYTES (a positive integer of bytes) or 1 GiB."""
    value = os.environ.get(MAX_BYTES_VARIABLE)
    if value is None:
        return DEFAULT_MAX_BYTES
    if not value.strip().isdigit() or int(value) < 1:
        raise Error(
            f"{MAX_BYTES_VARIABLE} must be a positive whole number of bytes (for example 1073741824), got "
            f"{value!r}; fix or unset the environment variable"
        )
    return int(value)


def _unusable(directory, exc):
    if directory not in _unusable_directories:
        _unusable_directories.add(directory)
        logger.warning(
            "The executable cache directory %s cannot be used (%s); running without the cache. Set "
            "POPTORCH_CACHE_DIR or enableExecutableCaching() to a writable directory.",
            directory,
            exc,
        )


class ExecutableCache:
    """A directory of cache entries, one file per key."""

    def __init__(self, directory, max_bytes=None):
        self.directory = directory
        self.max_bytes = max_bytes or max_bytes_from_environment()
        os.makedirs(directory, exist_ok=True)

    @staticmethod
    def open(options):
        """The cache configured by ``options``, or None when caching is off or its directory is unusable."""
        directory = options.executable_cache_dir
        if not directory:
            return None
        max_bytes = max_bytes_from_environment()
        try:
            return ExecutableCache(directory, max_bytes)
        except OSError as exc:
            _unusable(directory, exc)
            return None

    def _path(self, key):
        return os.path.join(self.directory, key + _SUFFIX)

    def load(self, key, graphs=None):
        """The executable stored under ``key`` (for ``graphs``, {program: Graph}, when given), or None: a
        missing entry is a miss; an entry that fails any check is logged, removed and is a miss."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            _unusable(self.directory, exc)
            return None
        try:
            exe = popsim.Executable.from_bytes(_verified_body(data, key))
            if graphs is not None:
                _check_interface(exe, graphs)
        except popsim.Error as exc:
            logger.warning("Removing executable cache entry %s: %s; recompiling", path, exc)
            _remove(path)
            return None
        try:
            os.utime(path)
        except OSError:
            pass  # an entry we may read but not touch still serves; it only ages for eviction
        return exe

    def store(self, key, exe):
        """Store the compiled executable ``exe`` under ``key``, then evict the least recently used entries.
        A directory that refuses the write is reported once; the caller runs on uncached."""
        body = exe.to_bytes()
        data = _MAGIC + key.encode() + b"\n" + _digest(key, body) + b"\n" + body
        try:
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, self._path(key))
            except BaseException:
                _remove(tmp)
                raise
            self._evict()
        except OSError as exc:
            _unusable(self.directory, exc)

    def _evict(self):
        entries = []
        for name in os.listdir(self.directory):
            if name.endswith(_SUFFIX):
                path = os.path.join(self.directory, name)
                stat = os.stat(path)
                entries.append((stat.st_mtime_ns, stat.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            logger.info("Evicting executable cache entry %s", path)
            _remove(path)
            total -= size


def _digest(key, body):
    return hashlib.sha256(key.encode() + b"\n" + body).hexdigest().encode()


def _verified_body(data, key):
    """The popsim bytes of an entry after checking its tag, that it was stored for ``key`` and its checksum."""
    if not data.startswith(_MAGIC):
        raise popsim.Error("not an executable cache entry of this version")
    at = len(_MAGIC)
    stored_key = data[at : at + len(key)].decode(errors="replace")
    if len(data) < at + len(key) + 1 or stored_key != key or data[at + len(key) : at + len(key) + 1] != b"\n":
        raise popsim.Error("the entry was stored for another key (a file renamed, swapped or copied)")
    at += len(key) + 1
    digest, body = data[at : at + _DIGEST_HEX], data[at + _DIGEST_HEX + 1 :]
    if data[at + _DIGEST_HEX : at + _DIGEST_HEX + 1] != b"\n" or _digest(key, body) != digest:
        raise popsim.Error("checksum mismatch (a damaged or truncated entry)")
    return body


def _check_interface(exe, graphs):
    """An entry's programs and variables must be those of ``graphs``: a valid executable of another model
    stored under this key is refused."""
    expected = {v.name: (tuple(v.shape), str(v.dtype)) for g in graphs.values() for v in g.inputs if v.kind != "input"}
    found = {name: (tuple(t.shape), str(t.dtype)) for name, t in exe.variables.items()}
    if sorted(exe.programs) != sorted(graphs) or found != expected:
        raise popsim.Error("its programs or variables are not those of this model")


def _remove(path):
    try:
        os.remove(path)
    except OSError:
        pass
