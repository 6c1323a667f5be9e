"""The executable cache (``enableExecutableCaching(path)`` / POPTORCH_CACHE_DIR).

Key: SHA-256 of the programs' popir graph hashes (before optimisation), the options that change
compilation and the poptorch version. Entry: the compiled popsim executable, pickled (its programs and
tile plans; weights are uploaded after loading), so a hit skips the popir passes and popsim's lowering.
Each entry file starts with a magic tag and the SHA-256 of its payload: a corrupt or
truncated entry is logged, deleted and recompiled, never raised. The cache is bounded
(POPTORCH_CACHE_MAX_BYTES, default 1 GiB): hits refresh an entry's time and the least recently used
entries are evicted first.
"""

import hashlib
import os
import pickle
import tempfile

import poptorch
from poptorch._logging import logger

_MAGIC = b"POPTORCH-EXE-1\n"
_SUFFIX = ".popexe"


def key(graphs, options):
    """The cache key of compiling ``graphs`` ({program: Graph}) with ``options``."""
    digest = hashlib.sha256()
    digest.update(poptorch.__version__.encode())
    for name in sorted(graphs):
        digest.update(f"{name}={graphs[name].hash()};".encode())
    for option, value in sorted(options._compile_key().items()):
        digest.update(f"{option}={value};".encode())
    return digest.hexdigest()


class ExecutableCache:
    """A directory of cache entries, one file per key."""

    def __init__(self, directory, max_bytes=None):
        self.directory = directory
        self.max_bytes = max_bytes or int(os.environ.get("POPTORCH_CACHE_MAX_BYTES", 1 << 30))
        os.makedirs(directory, exist_ok=True)

    @staticmethod
    def open(options):
        """The cache configured by ``options``, or None when caching is off."""
        directory = options.executable_cache_dir
        return ExecutableCache(directory) if directory else None

    def _path(self, key):
        return os.path.join(self.directory, key + _SUFFIX)

    def load(self, key):
        """The executable stored under ``key``, or None (missing or corrupt entries are a miss)."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        payload = _verified_payload(data)
        try:
            if payload is None:
                raise ValueError("checksum mismatch")
            exe = pickle.loads(payload)
        except Exception as exc:  # noqa: BLE001 - any damage to an entry means: recompile
            logger.warning("Ignoring corrupt executable cache entry %s (%s); recompiling", path, exc)
            _remove(path)
            return None
        os.utime(path)
        return exe

    def store(self, key, exe):
        """Store the compiled executable ``exe`` under ``key``; then evict the least recently used entries."""
        payload = pickle.dumps(exe, protocol=pickle.HIGHEST_PROTOCOL)
        data = _MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, self._path(key))
        self._evict()

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


def _verified_payload(data):
    if not data.startswith(_MAGIC):
        return None
    header_end = data.find(b"\n", len(_MAGIC))
    if header_end < 0:
        return None
    checksum, payload = data[len(_MAGIC) : header_end].decode(errors="replace"), data[header_end + 1 :]
    return payload if hashlib.sha256(payload).hexdigest() == checksum else None


def _remove(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
