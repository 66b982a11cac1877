"""Per-call cost at decode size (batch 1, one token, width 96) of a converted tied token table's
centred lookup against a plain nn.Embedding lookup, and of the RMSNorm module against nn.LayerNorm,
each with a null control (the same module timed twice). Interleaved rounds of 2,000 calls, median
and minimum per call over 15 rounds, 1 thread, no gradient.

    PYTHONPATH=. python3 bench/tied_lookup.py > results/tied-lookup-20261201T2303Z/tied-lookup.txt
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from normswap.checkpoint.remote_code import _CenteredEmbedding  # noqa: E402
from normswap.modules import RMSNorm  # noqa: E402
from normswap.testing import kernel_backend  # noqa: E402


def per_call(f, n=2000):
    t0 = time.perf_counter_ns()
    for _ in range(n):
        f()
    return (time.perf_counter_ns() - t0) / n / 1000


def run(cases):
    with torch.no_grad():
        for f in cases.values():
            per_call(f, 200)
        res = {k: [] for k in cases}
        for _ in range(15):
            for k, f in cases.items():
                res[k].append(per_call(f))
    for k, v in res.items():
        print(f"{k:34s} median {statistics.median(v):7.2f} us  min {min(v):7.2f} us")


def main(argv=None) -> int:
    import argparse

    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    torch.set_num_threads(1)
    V, D = 8192, 96
    torch.manual_seed(0)
    plain = nn.Embedding(V, D)
    centred = nn.Embedding(V, D)
    centred.load_state_dict(plain.state_dict())
    centred.__class__ = _CenteredEmbedding
    ln, rms = nn.LayerNorm(D), RMSNorm(D, elementwise_affine=False)
    ids, x = torch.tensor([[5]]), torch.randn(1, 1, D)
    print(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} load {os.getloadavg()}")
    run(
        {
            "nn.Embedding lookup": lambda: plain(ids),
            "nn.Embedding lookup (null control)": lambda: plain(ids),
            "centred lookup (one compiled call)": lambda: centred(ids),
            "nn.LayerNorm": lambda: ln(x),
            "normswap RMSNorm (no gamma)": lambda: rms(x),
        }
    )
    with kernel_backend("torch"):  # the path before #32's compiled call: lookup, cached means, subtraction
        run({"centred lookup (three ATen ops)": lambda: centred(ids), "nn.Embedding lookup": lambda: plain(ids)})
    print(f"# load after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
