"""Poplar's ``POPLAR_ENGINE_OPTIONS`` report switches: with ``autoReport.all`` (or one of the profile
outputs) set, compiling writes the simulated profile (profile.json) and its HTML report (report.html) to
``autoReport.directory`` (default: the working directory), in a folder named after the model
(``Options.modelName``, else "training" or "inference").

The simulator's profile is static (cycles and memory are known when compiling), so the report is written
then. Engine options the simulator does not model are refused rather than ignored."""

import json
import os

from poptorch.errors import Error

ENV = "POPLAR_ENGINE_OPTIONS"
_SWITCHES = ("autoReport.all", "autoReport.outputGraphProfile", "autoReport.outputExecutionProfile")
_DIRECTORY = "autoReport.directory"


def _flag(name, value):
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise Error(f'{ENV}: {name} must be "true" or "false", got {value!r}')


def report_directory(environ=os.environ):
    """The folder reports go to when ``POPLAR_ENGINE_OPTIONS`` asks for them, else None."""
    text = environ.get(ENV)
    if not text:
        return None
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise Error(f'{ENV} is not valid JSON ({exc}): set it to e.g. \'{{"autoReport.all": "true"}}\'') from None
    if not isinstance(options, dict):
        raise Error(f"{ENV} must be a JSON object of engine options, got {text!r}")
    unknown = sorted(set(options) - {*_SWITCHES, _DIRECTORY})
    if unknown:
        raise Error(
            f"{ENV}: the simulator does not model the engine option(s) {', '.join(unknown)}; it supports "
            f"{', '.join((*_SWITCHES, _DIRECTORY))}. Remove them from {ENV}."
        )
    if not any(_flag(name, options[name]) for name in _SWITCHES if name in options):
        return None
    directory = options.get(_DIRECTORY, ".")
    if not isinstance(directory, str) or not directory:
        raise Error(f"{ENV}: {_DIRECTORY} must be a folder name, got {directory!r}")
    return directory


def write(profile, directory, name):
    """Write profile.json and report.html of ``profile`` under ``directory/name``; returns the report's path."""
    folder = os.path.join(directory, name)
    os.makedirs(folder, exist_ok=True)
    profile.to_json(os.path.join(folder, "profile.json"))
    return profile.save_html(os.path.join(folder, "report.html"), title=f"{name} (popsim profile)")
