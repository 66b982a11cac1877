"""normswap's one timing instrument: paired, interleaved speed ratios with a null control.

Why pairs. On this project's shared 2-core machine the host's own speed swings by ×2 within
seconds (other jobs, frequency, caches): the same decode step measured 212 to 417 tokens/s in
five whole-generation repeats. No timing of one function alone can tell a 3 % difference through
that, and neither can comparing two functions' timings taken at different moments. What does work
is to time the two functions back to back, many times, over blocks short enough that the host
barely changes within one pair: the *ratio within a pair* cancels whatever the host was doing,
and the median of many such ratios is stable (docs/speed.md shows the
measurements).

How (:func:`compare`):
- warm-up: every function runs ``warmup`` untimed blocks first (allocator, lazy init, caches);
- a *round* pairs the baseline with every other function once, in a shuffled order; a pair runs
  one block (``calls_per_sample`` calls; one number, or one a function, so that a function ten times
  slower than the baseline does not spend a round on ten times the calls) of each, A then B in one
  round and B then A in the next,
  so neither side always enjoys the warmer position; each block starts with ``lead_in`` untimed
  calls of its own function, so that no block inherits a cache another function left (the
  baseline, in every pair, would otherwise often follow itself and look faster than its copy);
- each pair's ratio is ``baseline seconds a call / candidate seconds a call`` — the candidate's
  speed over the baseline's, above 1 when the candidate is faster (normswap's convention for every
  speed ratio);
- the estimate is the median of the per-pair ratios, its interval a percentile bootstrap of that
  median (pairs resampled whole, so the pairing survives the resampling);
- the **null control** is the baseline against a second copy of itself (the caller supplies it:
  the same model loaded again, at another address), timed the same way in the same rounds. It is
  what "no difference" looks like during this run; two identical copies can differ by ~1 %;
- **replicas**: a function may be given as several copies (a list: the same model loaded several
  times), and its blocks then rotate through them. Two onnxruntime sessions of one graph differ by
  ~1 % idle and ~2 % beside a busy process, steadily over a whole run (each session's buffers land
  somewhere else in memory): with one copy a side that placement is a fixed bias no number of pairs
  removes, and the null control (a second copy) reads it as noise outside its band. Rotating through
  N copies a side pairs every copy with every other, so the median sees the spread of placements
  instead of one draw of it;
- the **stop rule**: rounds continue until every interval, the null's included, is narrower than
  ``target_halfwidth`` on each side ("converged"), or the time budget ("budget") or the pair cap
  ("max_pairs") runs out; the result says which.

Verdicts: the rules of normswap/stats/verdicts.py (``speed_ratio_verdict``): "too noisy to tell"
when the null control's interval is not inside [1 − ``NULL_BAND``, 1 + ``NULL_BAND``]; else
"faster" / "slower" when the candidate's whole interval lies further from 1 than the null control's
reached on either side; else "no measurable difference". The interval is
normswap/stats/bootstrap.py's ``median_interval``.

The clock is injectable (``clock=``), so the tests plant timings with a fake clock and never
depend on how fast the machine running them is.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

from normswap.stats.bootstrap import median_interval
from normswap.stats.levels import LEVEL
from normswap.stats.verdicts import NULL_BAND, null_control_verdict, speed_ratio_verdict

BOOTSTRAP_DRAWS = 1000
CONVERGED, BUDGET, MAX_PAIRS = "converged", "budget", "max_pairs"
METHOD = (
    "median of per-pair speed ratios (baseline seconds / candidate seconds; interleaved pairs, order "
    f"alternating), {LEVEL:.0%} percentile bootstrap over pairs; a verdict needs the null control (the "
    f"baseline against a second copy of itself) within [{1 - NULL_BAND:.2f}, {1 + NULL_BAND:.2f}] "
    "(else: too noisy to tell) and an interval further from 1 than the null's reaches on either side"
)


@dataclasses.dataclass(frozen=True)
class Ratio:
    """One function's speed over the baseline's: the median per-pair ratio and its interval."""

    ratio: float
    low: float
    high: float
    pairs: int
    verdict: str

    @property
    def halfwidth(self) -> float:
        return (self.high - self.low) / 2

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Comparison:
    """What :func:`compare` measured: ``candidates[name]`` and ``null`` against ``baseline``."""

    baseline: str
    null_name: str | None
    candidates: dict[str, Ratio]
    null: Ratio | None
    stop_reason: str
    elapsed_s: float
    rounds: int
    calls_per_sample: int  # the baseline's calls a block
    target_halfwidth: float
    # per function: [(baseline seconds a call, its seconds a call)] of every pair, in the order they ran
    pair_seconds: dict[str, list[tuple[float, float]]]
    # per function: its median seconds per call over all its timed blocks (absolute throughput)
    seconds_per_call: dict[str, float]
    # per function: its fastest block's seconds per call (what the machine allows at best)
    fastest_seconds_per_call: dict[str, float]
    # per function: how many copies its blocks rotated through (1: one)
    replicas: dict[str, int] = dataclasses.field(default_factory=dict)
    # per function: its calls a block
    calls_per_function: dict[str, int] = dataclasses.field(default_factory=dict)
    # rounds of every pair (compare(balanced=True)), not of the baseline against each other function
    balanced: bool = False

    def __getitem__(self, name: str) -> Ratio:
        return self.null if name == self.null_name else self.candidates[name]

    def to_json(self, samples: bool = False) -> dict:
        out = {
            "baseline": self.baseline,
            "null_name": self.null_name,
            "candidates": {k: v.to_json() for k, v in self.candidates.items()},
            "null": self.null.to_json() if self.null else None,
            "stop_reason": self.stop_reason,
            "elapsed_s": round(self.elapsed_s, 3),
            "rounds": self.rounds,
            "calls_per_sample": self.calls_per_sample,
            "calls_per_function": dict(self.calls_per_function),
            "target_halfwidth": self.target_halfwidth,
            "null_band": NULL_BAND,
            "seconds_per_call": dict(self.seconds_per_call),
            "replicas": dict(self.replicas),
            "balanced": self.balanced,
            "method": METHOD,
        }
        if samples:
            out["pair_seconds"] = {k: [list(p) for p in v] for k, v in self.pair_seconds.items()}
        return out


def calibrate_calls(
    fn: Callable[[], object], block_s: float, *, max_calls: int = 1000, clock=time.perf_counter, sync=None
) -> int:
    """How many calls of ``fn`` make one block of about ``block_s`` seconds (one timed call decides)."""
    seconds = _block(fn, 1, clock, sync)
    return max(1, min(max_calls, round(block_s / max(seconds, 1e-9))))


def _block(fn, calls: int, clock, sync, lead_in: int = 0) -> float:
    for _ in range(lead_in):
        fn()
    if sync:
        sync()
    t0 = clock()
    for _ in range(calls):
        fn()
    if sync:
        sync()
    return clock() - t0


def _ratios(pairs: list[tuple[float, float]]) -> list[float]:
    return [base / other for base, other in pairs if other > 0]


def _estimates(pair_seconds, draws: int, seed: int) -> dict[str, tuple[float, float, float]]:
    return {name: median_interval(_ratios(p), draws=draws, seed=seed) for name, p in pair_seconds.items() if p}


def _converged(estimates, target_halfwidth: float) -> bool:
    return all((high - low) / 2 <= target_halfwidth for _, low, high in estimates.values())


def _copies_for_pair(copies: dict[str, list], baseline: str, name: str, k: int) -> dict[str, Callable]:
    """The copies the k-th pair of ``name`` against the baseline runs: the baseline's copy k mod nb and
    ``name``'s copy (k div nb) mod nc, so every nb x nc pairs walk every combination once. (One cycle
    a function, read as blocks come, would alias: the baseline runs twice a round, so a null copy
    could meet only some of its copies.)"""
    nb, nc = len(copies[baseline]), len(copies[name])
    if name == baseline:  # the baseline timed alone
        return {baseline: copies[baseline][k % nb]}
    return {baseline: copies[baseline][k % nb], name: copies[name][(k // nb) % nc]}


def compare(
    fns: Mapping[str, Callable[[], object] | Sequence[Callable[[], object]]],
    baseline: str,
    null: str | None,
    *,
    calls_per_sample: int | Mapping[str, int] = 5,
    target_halfwidth: float = 0.01,
    budget_s: float = 60.0,
    min_pairs: int = 30,
    max_pairs: int = 5000,
    warmup: int = 3,
    lead_in: int = 1,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
    sync: Callable[[], object] | None = None,
    check_every: int = 20,
    draws: int = BOOTSTRAP_DRAWS,
    band: float = NULL_BAND,
    progress: Callable[[str], object] | None = None,
    balanced: bool = False,
) -> Comparison:
    """Time every function in ``fns`` against ``fns[baseline]`` in interleaved pairs (module doc).

    A value of ``fns`` may be a list of copies of one function (replicas, module doc): its blocks
    rotate through them, and "converged" waits until every copy has met every baseline copy.
    ``fns[null]`` is the null control: the baseline's second copy (None: a run without one, whose
    verdicts rest on 1 alone). Every other entry is a candidate. Rounds run until all intervals are
    within ``target_halfwidth`` ("converged", checked every ``check_every`` rounds once
    ``min_pairs`` are in), ``budget_s`` seconds of ``clock`` have passed ("budget") or
    ``max_pairs`` rounds ran ("max_pairs"). ``sync`` (e.g. torch.cuda.synchronize) runs before
    every clock read. Ratios: candidate speed / baseline speed (> 1: faster). With the baseline
    alone, each round times it once (its absolute speed, no ratio).

    ``lead_in`` untimed calls of a block's own function come right before it: the baseline runs in
    every pair, so without them it would often follow itself, its weights still in the CPU's caches,
    while its copy always follows another model — measured: the null control read 0.93 on kjv-gpt2
    decode. With them every timed block starts from its own function's warm state.

    ``balanced``: a round times every pair of functions once (the candidates against each other too,
    untimed for the ratios), so every function runs as often as the baseline and follows every other
    as often: in the default round the baseline runs once a pair, k times for k candidates, and on
    this project's host that slot alone can read 2-5 % faster than an identical copy.
    Costs (k+1)/2 times the blocks of a round; the ratios are still read from the pairs that hold
    the baseline."""
    copies = _copies(fns, baseline, null)
    # with copies, no "converged" before every combination of copies has met once
    min_pairs = max([min_pairs] + [len(copies[baseline]) * len(fs) for name, fs in copies.items() if name != baseline])
    calls = _calls_per_function(fns, calls_per_sample)
    _warm(copies, calls, warmup, clock, sync)
    rounds = _Rounds(copies, calls, baseline, balanced, clock, sync, lead_in)

    def converged(done: int) -> bool:
        estimates = _estimates(rounds.pair_seconds, draws, seed)
        if progress and estimates:
            widest = max((h - lo) / 2 for _, lo, h in estimates.values())
            progress(f"{done} pairs, widest half-width {widest:.4f} (target {target_halfwidth})")
        return _converged(estimates, target_halfwidth)

    run = _run_until_stop(rounds, random.Random(seed), clock, budget_s, min_pairs, max_pairs, check_every, converged)
    run |= {"calls_per_sample": calls[baseline], "calls_per_function": calls, "target_halfwidth": target_halfwidth}
    run["replicas"] = {name: len(fs) for name, fs in copies.items()}
    run["balanced"] = bool(balanced and len(rounds.others) > 1)
    return _comparison(baseline, null, rounds.pair_seconds, rounds.blocks, run, band=band, draws=draws, seed=seed)


def _copies(fns, baseline: str, null: str | None) -> dict[str, list]:
    """Every function as its list of copies (one function: a list of one), after checking the keys."""
    if baseline not in fns or (null is not None and null not in fns) or null == baseline:
        raise ValueError(f"compare: baseline {baseline!r} and null {null!r} must be two different keys of fns")
    copies = {name: list(f) if isinstance(f, Sequence) else [f] for name, f in fns.items()}
    if not all(copies.values()):
        raise ValueError("compare: a function given as a list needs at least one copy")
    return copies


def _calls_per_function(fns, calls_per_sample: int | Mapping[str, int]) -> dict[str, int]:
    calls = {n: calls_per_sample if isinstance(calls_per_sample, int) else int(calls_per_sample[n]) for n in fns}
    if min(calls.values()) < 1:
        raise ValueError("compare: every function needs at least one call a block")
    return calls


def _warm(copies: dict[str, list], calls: dict[str, int], warmup: int, clock, sync) -> None:
    """``warmup`` untimed blocks of every copy of every function."""
    for name, fs in copies.items():
        for f in fs:
            for _ in range(warmup):
                _block(f, calls[name], clock, sync)


class _Rounds:
    """The rounds of one comparison: which pairs a round runs, in which order, on which copies, and
    the seconds they took."""

    def __init__(self, copies, calls, baseline: str, balanced: bool, clock, sync, lead_in: int):
        self.copies, self.calls, self.baseline, self.balanced = copies, calls, baseline, balanced
        self.clock, self.sync, self.lead_in = clock, sync, lead_in
        self.others = [name for name in copies if name != baseline]
        self.pair_seconds: dict[str, list[tuple[float, float]]] = {name: [] for name in self.others}
        self.blocks: dict[str, list[float]] = {name: [] for name in copies}

    def _pairs(self, rng: random.Random) -> list[tuple[str, str]]:
        baseline, others = self.baseline, self.others
        rng.shuffle(others)
        if self.balanced and len(others) > 1:
            names = [baseline, *others]
            pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
            rng.shuffle(pairs)
            return pairs
        return [(baseline, name) for name in others] or [(baseline, baseline)]  # alone: its speed only

    def run(self, rounds: int, rng: random.Random) -> None:
        """Round number ``rounds``: A then B in even rounds, B then A in odd ones."""
        baseline, copies = self.baseline, self.copies
        for a, b in self._pairs(rng):
            order = (a, b) if rounds % 2 == 0 else (b, a)
            name = b if a == baseline else a  # the side that is not the baseline (alone: the baseline)
            if baseline in order:
                nth = len(self.pair_seconds[name]) if name != baseline else rounds  # this pair's number
                pick = _copies_for_pair(copies, baseline, name, nth)
            else:  # a balanced round's pair of two candidates: rotates their copies too
                pick = {k: copies[k][rounds % len(copies[k])] for k in order}
            seconds = {  # seconds a call: blocks of different lengths compare
                k: _block(pick[k], self.calls[k], self.clock, self.sync, self.lead_in) / self.calls[k]
                for k in dict.fromkeys(order)
            }
            if baseline in order and name != baseline:
                self.pair_seconds[name].append((seconds[baseline], seconds[name]))
            for k, sec in seconds.items():
                self.blocks[k].append(sec)


def _run_until_stop(rounds: _Rounds, rng, clock, budget_s, min_pairs, max_pairs, check_every, converged) -> dict:
    """Rounds until the stop rule says: converged, budget or max_pairs (module doc)."""
    start = clock()
    done, stop_reason = 0, MAX_PAIRS
    while done < max_pairs:
        rounds.run(done, rng)
        done += 1
        if clock() - start >= budget_s:
            stop_reason = BUDGET
            break
        if done >= min(min_pairs, max_pairs) and done % check_every == 0 and converged(done):
            stop_reason = CONVERGED
            break
    return {"stop_reason": stop_reason, "elapsed_s": clock() - start, "rounds": done}


def _comparison(baseline, null, pair_seconds, blocks, run: dict, *, band, draws, seed) -> Comparison:
    estimates = _estimates(pair_seconds, draws, seed)
    null_low, null_high = estimates[null][1:] if null is not None else (None, None)

    def ratio(name):
        med, low, high = estimates[name]
        pairs = len(pair_seconds[name])
        if name == null:  # the yardstick: within its band it is "no difference" by construction
            word = null_control_verdict(low, high, pairs, band)
        else:
            word = speed_ratio_verdict(low, high, null_low, null_high, band, pairs=pairs)
        return Ratio(med, low, high, pairs, word)

    return Comparison(
        baseline=baseline,
        null_name=null,
        candidates={name: ratio(name) for name in estimates if name != null},
        null=ratio(null) if null is not None else None,
        pair_seconds=pair_seconds,
        seconds_per_call={k: statistics.median(v) for k, v in blocks.items() if v},
        fastest_seconds_per_call={k: min(v) for k, v in blocks.items() if v},
        **run,
    )
