"""The GPU machine's package set, simulated for `bash bench/gpu.sh --dry-run`: the packages named in
NORMSWAP_UNIMPORTABLE (comma-separated; the dry run names lm_eval and datasets, which that machine
lacks) become uninstalled for every Python process started with this directory on PYTHONPATH.

``sys.modules[name] = None`` is what Python itself reads as "not installed": ``import name`` raises
ModuleNotFoundError and ``importlib.util.find_spec(name)`` returns None, so code that probes for an
optional package (transformers does, normswap's lm-eval check does) takes its not-installed path
rather than crashing on a blocker. Python imports ``sitecustomize`` at start-up from the first
directory of sys.path that holds one; nothing else here has one."""

import os
import sys

for _name in filter(None, (n.strip() for n in os.environ.get("NORMSWAP_UNIMPORTABLE", "").split(","))):
    sys.modules.setdefault(_name, None)
