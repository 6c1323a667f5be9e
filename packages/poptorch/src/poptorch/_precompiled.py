"""Precompiled models: ``compileAndExport``, ``loadExecutable`` and ``poptorch.load``.

An exported file is ``MAGIC``, a JSON header line, then its sections, each as long as the header says:
``inputs`` (the example inputs, ``torch.save``d tensors, read back with ``weights_only=True``), ``executable``
(popsim's ``to_bytes``: JSON and NumPy arrays) and, with ``export_model=True``, ``model`` (the model, its
options and optimizer, ``torch.save``d; only ``poptorch.load`` reads it, and like ``torch.load`` of a model
that unpickles code, so load only files you trust). Loading captures the model again on the example inputs
and uses the stored executable instead of compiling; it must match the model and the compile options
(the executable-cache key), else loading is refused.
"""

import contextlib
import hashlib
import io
import json
import os

import torch

import popsim
import poptorch
from poptorch.errors import Error

MAGIC = b"POPTORCH-EXPORT-1\n"
_SECTIONS = ("inputs", "executable", "model")


def export(filename, key, exe, inputs, training, model_state=None):
    """Write an exported file: ``key`` (the cache key), the executable and the example ``inputs``."""
    sections = {"inputs": _saved(inputs), "executable": exe.to_bytes()}
    if model_state is not None:
        with _unhooked(model_state["model"]):
            sections["model"] = _saved(model_state)
    header = {
        "version": poptorch.__version__,
        "key": key,
        "training": training,
        "sections": {name: [len(data), hashlib.sha256(data).hexdigest()] for name, data in sections.items()},
    }
    directory = os.path.dirname(os.path.abspath(filename))
    os.makedirs(directory, exist_ok=True)
    with open(filename, "wb") as f:
        f.write(MAGIC + json.dumps(header).encode() + b"\n")
        for name in _SECTIONS:
            if name in sections:
                f.write(sections[name])


@contextlib.contextmanager
def _unhooked(model):
    """Inside: ``model`` has its own class again (a wrapped model's class is a weight-syncing subclass)."""
    hooked = type(model)
    original = getattr(hooked, "_poptorch_original_class", None)
    if original is not None:
        model.__class__ = original
    try:
        yield
    finally:
        model.__class__ = hooked


def _saved(value):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


class Exported:
    """A parsed exported file: its header and sections (checked against their SHA-256)."""

    def __init__(self, filename):
        try:
            with open(filename, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise Error(f"Cannot read the exported model {filename}: {exc}") from None
        end = data.find(b"\n", len(MAGIC))
        if not data.startswith(MAGIC) or end < 0:
            raise Error(f"{filename} is not a file written by compileAndExport")
        try:
            self.header = json.loads(data[len(MAGIC) : end])
        except ValueError:
            raise Error(f"{filename}: its header is damaged") from None
        if self.header.get("version") != poptorch.__version__:
            raise Error(
                f"{filename} was exported by poptorch {self.header.get('version')}, this is {poptorch.__version__}: "
                "export it again with this version"
            )
        self.filename, self.sections, offset = filename, {}, end + 1
        for name in _SECTIONS:
            if name not in self.header["sections"]:
                continue
            size, digest = self.header["sections"][name]
            body = data[offset : offset + size]
            if len(body) != size or hashlib.sha256(body).hexdigest() != digest:
                raise Error(f"{filename}: its {name} section is damaged or truncated")
            self.sections[name] = body
            offset += size

    def inputs(self):
        """The example (args, kwargs) the model was compiled for."""
        return torch.load(io.BytesIO(self.sections["inputs"]), weights_only=True)

    def model_state(self):
        """The exported model, options and optimizer (``export_model=True`` only)."""
        if "model" not in self.sections:
            raise Error(
                f"{self.filename} holds no model (exported with export_model=False): create the model with "
                "poptorch.trainingModel / inferenceModel and call loadExecutable() instead"
            )
        return torch.load(io.BytesIO(self.sections["model"]), weights_only=False)

    def executable_for(self, key):
        """The stored executable, if it was compiled for ``key`` (this model with these options)."""
        if key != self.header["key"]:
            raise Error(
                f"{self.filename} was compiled for another model or other compile options than this one: "
                "export it again from this model, or keep the options it was exported with"
            )
        try:
            return popsim.Executable.from_bytes(self.sections["executable"])
        except popsim.Error as exc:
            raise Error(f"{self.filename}: its executable cannot be loaded: {exc}") from None


def load(filename, edit_opts_fn=None):
    """The model exported to ``filename`` with ``compileAndExport(..., export_model=True)``, wrapped and
    ready to run without compiling. ``edit_opts_fn(options)`` may change options that do not affect
    compilation (deviceIterations, outputMode, ...)."""
    exported = Exported(filename)
    state = exported.model_state()
    options = poptorch.Options()
    options._values = dict(state["options"])
    if options.connection_type == poptorch.ConnectionType.Never:
        # As PopTorch: an executable compiled for an offline target runs once loaded.
        options.connectionType(poptorch.ConnectionType.Always)
    if edit_opts_fn is not None:
        edit_opts_fn(options)
    if exported.header["training"]:
        wrapper = poptorch.trainingModel(state["model"], options, state["optimizer"])
    else:
        wrapper = poptorch.inferenceModel(state["model"], options)
    wrapper._load_exported(exported)
    return wrapper
