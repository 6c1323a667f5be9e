"""Run every benchmark in bench/ in turn (``make bench``); each prints its own figures."""

import pathlib
import subprocess
import sys

here = pathlib.Path(__file__).resolve().parent
failed = []
for script in sorted(here.glob("*.py")):
    if script.name == "run_all.py" or script.name.startswith("_"):
        continue
    print(f"\n=== {script.name}", flush=True)
    if subprocess.run([sys.executable, str(script), *sys.argv[1:]], cwd=here.parent).returncode:
        failed.append(script.name)
sys.exit(f"failed: {', '.join(failed)}" if failed else 0)
