"""The vetting build's child, run by tokenizer_vet.py as ``python -I THIS_FILE PARENT_PID``.

It imports nothing from normswap and nothing but the standard library and ``tokenizers`` (whose folder the
parent names), so it starts in a fraction of a second and a model directory cannot put a module on its path
(``-I``). It caps its own CPU time (``RLIMIT_CPU``: the kernel ends it past the budget of the whole run, and
of each step), asks the kernel to kill it if the parent dies, then builds each tokenizer file the parent pipes
to it as transformers would (the file, then the added tokens ``tokenizer_config.json`` declares), and probes
it (one encode, then a decode of it and of every added token). It writes one JSON line per finished step on
stdout, with the CPU seconds the step took, so the parent knows how far it got when the kernel ends it.
"""

import json
import math
import os
import resource
import signal
import sys
import time


def _die_with_parent(parent: int) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before the death signal was armed
        os._exit(1)


def _say(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def _step(name: str, what: str, budget: float, fn):
    """Run ``fn`` under ``budget`` CPU seconds (the kernel ends this process past them: SIGXCPU at the soft
    limit); say how much CPU it took, or how it failed (a Rust panic is a BaseException)."""
    t0 = time.process_time()
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (min(math.ceil(t0 + budget), hard), hard))
    try:
        value = fn()
    except Exception as e:  # the library refused the file: transformers will say why in its own words
        _say(file=name, step=what, error=f"{type(e).__name__}: {str(e).strip()[:300]}", panic=False)
        return None
    except BaseException as e:  # noqa: BLE001 - pyo3_runtime.PanicException
        _say(file=name, step=what, error=f"{type(e).__name__}: {str(e).strip()[:300]}", panic=True)
        return None
    _say(file=name, step=what, cpu=time.process_time() - t0)
    return value


def main() -> None:
    parent = int(sys.argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the command decides what a Ctrl-C means
    _die_with_parent(parent)
    job = json.loads(sys.stdin.buffer.readline())  # then each file's bytes, as many as the job says
    cpu = int(job["cpu_limit"])  # the whole run's; each step lowers the soft limit to its own budget
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    sys.path.insert(0, job["tokenizers_dir"])
    from tokenizers import AddedToken, Tokenizer

    added = [AddedToken(**t) for t in job["added"]]
    for name, size, build_budget in job["files"]:
        data = sys.stdin.buffer.read(size).decode("utf-8", errors="replace")

        def build(data=data):
            tok = Tokenizer.from_str(data)
            tok.add_tokens(added)  # normalized added tokens run the normalizer, as in transformers' __init__
            return tok

        tok = _step(name, "build", build_budget, build)
        if tok is None:
            return

        def probe(tok=tok):
            enc = tok.encode_batch([job["probe"]], add_special_tokens=False)
            ids = [enc[0].ids] + [[i] for i in sorted(tok.get_added_tokens_decoder())]
            tok.decode_batch(ids, skip_special_tokens=False)  # a decoder's patterns run on every token
            return True

        if _step(name, "probe", job["probe_budget"], probe) is None:
            return


if __name__ == "__main__":
    main()
