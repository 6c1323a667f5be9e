"""The popdata catalogue shares the popdata suite's datasets and process helpers."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "popdata"))
