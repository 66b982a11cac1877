"""Throughput, memory and time-in-norm-layers, measured for several models in one run.

Fairness rules (every model sees the same conditions):
- all models are measured in the same process, interleaved: each repeat visits every model once
  (in a rotated order, so no model always runs right after another), and a result is the median
  over repeats, so drifts of the machine (clock, thermal, other processes) spread over all models;
- warm-up runs (allocator, kernels' first calls, lazy init) come first and are not measured;
  they also pick how many calls one measurement makes so that each lasts at least ``min_time``;
- the device is synchronised before every clock read.

Measurements, on random token ids (throughput does not depend on the values):
- forward: inference forward of batch_size x seq_len under torch.inference_mode;
- train_step: forward + backward + AdamW step (lr=0, so weights never change but every
  optimizer operation still runs), in train mode;
- generate: greedy generation with the KV cache, one sequence; prefill (the prompt) and decode
  (one token per step) timed separately; generate = new tokens / (prefill + decode time);
- norm_time_share: share of the inference forward spent inside the norm layers, timed by
  forward hooks (CUDA events on GPU, perf_counter on CPU) in separate, hooked calls so the
  hooks never slow the throughput numbers.
Peak memory is measured by :mod:`normswap.evaluate.memory`.

A null control (``null_control=``: the baseline loaded a second time) is measured like any other
model, interleaved with the rest; evaluate/stats.py judges every ratio against its spread. The
machine's load average before and after the run and its CPU count come back with the summaries
(:func:`measure_speed_run`), so a results.json says how busy the machine was.

With ``compile=True`` every model is wrapped in ``torch.compile`` (Inductor; decoding with a
growing KV cache makes Dynamo recompile once with dynamic shapes) before the warm-up, which then
also pays the compilation; the original and the converted model are both compiled, so the ratio
compares compiled with compiled. Norm time is
not measured then: per-module hooks would break the compiled graph that fuses the norms.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import statistics
import time

import torch

from normswap.evaluate.config import SpeedConfig
from normswap.evaluate.kinds import training_loss
from normswap.evaluate.perplexity import model_device
from normswap.model_facts import context_length, norm_modules


def _cache_of(out):
    cache = out.get("cache") if hasattr(out, "get") else None
    return cache if cache is not None else out.past_key_values


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Bench:
    """One model's prepared inputs and measurement functions."""

    def __init__(self, name, model, cfg: SpeedConfig):
        self.name = name
        self.model = model
        self.cfg = cfg
        # what this model can be timed on: an ONNX graph (evaluate/onnx_model.py) only runs forward
        self.kinds = tuple(k for k in cfg.kinds if k in getattr(model, "speed_kinds", cfg.kinds))
        onnx = getattr(model, "is_onnx", False)
        # the compiled wrapper shares the model's parameters and train/eval state
        self.run = torch.compile(model) if cfg.compile and not onnx else model
        self.device = model_device(model)
        vocab = int(model.config.vocab_size)
        g = torch.Generator().manual_seed(cfg.seed)
        context = context_length(model) or (cfg.seq_len + cfg.new_tokens + cfg.prompt_len)
        self.seq_len = min(cfg.seq_len, context)
        self.new_tokens = max(1, min(cfg.new_tokens, context // 2))
        self.prompt_len = max(1, min(cfg.prompt_len, context - self.new_tokens))
        self.batch = torch.randint(0, vocab, (cfg.batch_size, self.seq_len), generator=g).to(self.device)
        self.prompt = torch.randint(0, vocab, (1, self.prompt_len), generator=g).to(self.device)
        # transformers 5.x renamed `past_key_values` to `cache` (the old name still works, with a
        # deprecation warning); remote-code models may have either.
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.optimizer = None
        self.calls: dict[str, int] = {}
        self.samples: dict[str, list] = {
            k: [] for k in ("forward", "train_step", "prefill", "decode", "norm_share", "norm_ms")
        }

    # -- single operations -------------------------------------------------------------------
    def _forward(self):
        with torch.inference_mode():
            self.run(input_ids=self.batch, use_cache=False)

    def _train_step(self):
        if self.optimizer is None:
            # lr=0: the update is computed and applied, but leaves the weights as they were, so
            # later measurements (and the caller) still see the model that was loaded.
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.0, weight_decay=0.0)
        self.model.train()
        try:
            training_loss(self.model, self.batch, forward=self.run).backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        finally:
            self.model.eval()

    def _generate(self) -> tuple[float, float]:
        """(prefill seconds, decode seconds) of one greedy generation."""
        with torch.inference_mode():
            _sync(self.device)
            t0 = time.perf_counter()
            out = self.run(input_ids=self.prompt, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            _sync(self.device)
            t1 = time.perf_counter()
            past = _cache_of(out)
            for _ in range(self.new_tokens - 1):
                out = self.run(input_ids=token, use_cache=True, **{self.cache_arg: past})
                past = _cache_of(out)
                token = out.logits[:, -1:].argmax(-1)
            _sync(self.device)
            t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    def _norm_share(self) -> tuple[float, float, float]:
        """(share of forward time in norm layers, norm ms, forward ms) of one hooked forward."""
        norms = norm_modules(self.model)
        cuda = self.device.type == "cuda"
        marks: list = []

        def pre(_m, _a):
            if cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                marks.append(ev)
            else:
                marks.append(time.perf_counter())

        def post(_m, _a, _o):
            pre(_m, _a)

        handles = []
        for _, m in norms:
            handles.append(m.register_forward_pre_hook(pre))
            handles.append(m.register_forward_hook(post))
        try:
            with torch.inference_mode():
                _sync(self.device)
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    t0 = None
                else:
                    t0 = time.perf_counter()
                self.model(input_ids=self.batch, use_cache=False)
                if cuda:
                    end.record()
                _sync(self.device)
                t1 = time.perf_counter()
        finally:
            for h in handles:
                h.remove()
        if cuda:
            total_ms = start.elapsed_time(end)
            norm_ms = sum(marks[i].elapsed_time(marks[i + 1]) for i in range(0, len(marks) - 1, 2))
        else:
            total_ms = (t1 - t0) * 1e3
            norm_ms = sum(marks[i + 1] - marks[i] for i in range(0, len(marks) - 1, 2)) * 1e3
        return (norm_ms / total_ms if total_ms > 0 else 0.0), norm_ms, total_ms

    # -- timed measurements ------------------------------------------------------------------
    def _timed(self, fn, calls: int) -> float:
        _sync(self.device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(self.device)
        return time.perf_counter() - t0

    def warm_up(self):
        cfg = self.cfg
        for kind, fn in (("forward", self._forward), ("train_step", self._train_step)):
            if kind not in self.kinds:
                continue
            for _ in range(max(cfg.warmup, 1)):
                elapsed = self._timed(fn, 1)
            self.calls[kind] = max(1, min(cfg.max_calls, math.ceil(cfg.min_time / max(elapsed, 1e-9))))
        if "generate" in self.kinds:
            for _ in range(max(cfg.warmup, 1)):
                self._generate()
        if "norm_share" in self.kinds:
            self._norm_share()

    def measure_once(self):
        tokens = self.batch.numel()
        if "forward" in self.kinds:
            n = self.calls["forward"]
            self.samples["forward"].append(tokens * n / self._timed(self._forward, n))
        if "train_step" in self.kinds:
            n = self.calls["train_step"]
            self.samples["train_step"].append(tokens * n / self._timed(self._train_step, n))
        if "generate" in self.kinds:
            prefill, decode = self._generate()
            self.samples["prefill"].append((prefill, decode))
        if "norm_share" in self.kinds:
            share, norm_ms, _ = self._norm_share()
            self.samples["norm_share"].append(share)
            self.samples["norm_ms"].append(norm_ms)

    def _generation_samples(self) -> dict:
        """Per-repeat tokens/s of generation (stats.py pairs them across models by repeat)."""
        pairs = self.samples["prefill"]
        if not pairs:
            return {}
        return {
            "generate": [self.new_tokens / (p + d) for p, d in pairs],
            "prefill": [self.prompt_len / p if p > 0 else None for p, _ in pairs],
            "decode": [(self.new_tokens - 1) / d if d > 0 and self.new_tokens > 1 else None for _, d in pairs],
        }

    def summary(self) -> dict:
        s = self.samples
        tps: dict = {}
        if s["forward"]:
            tps["forward"] = statistics.median(s["forward"])
        if s["train_step"]:
            tps["train_step"] = statistics.median(s["train_step"])
        if s["prefill"]:
            pre = statistics.median(p for p, _ in s["prefill"])
            dec = statistics.median(d for _, d in s["prefill"])
            tps["generate"] = statistics.median(self.new_tokens / (p + d) for p, d in s["prefill"])
            tps["prefill"] = self.prompt_len / pre if pre > 0 else None
            tps["decode"] = (self.new_tokens - 1) / dec if dec > 0 and self.new_tokens > 1 else None
        out = {
            "tokens_per_second": tps,
            "norm_time_share": statistics.median(s["norm_share"]) if s["norm_share"] else None,
            "norm_time": None,
            "speed_setup": {
                "batch_size": self.cfg.batch_size,
                "seq_len": self.seq_len,
                "prompt_len": self.prompt_len,
                "new_tokens": self.new_tokens,
                "repeats": len(s["forward"] or s["train_step"] or s["prefill"] or s["norm_share"]),
                "calls_per_measurement": dict(self.calls),
                "samples": {k: v for k, v in (("forward", s["forward"]), ("train_step", s["train_step"])) if v}
                | self._generation_samples()
                | ({"norm_ms": list(s["norm_ms"])} if s["norm_ms"] else {})
                # per-repeat shares: the report draws their range on the "time in norms" bars
                | ({"norm_share": list(s["norm_share"])} if s["norm_share"] else {}),
            },
        }
        if s["norm_share"]:
            norms = norm_modules(self.model)
            out["norm_time"] = {
                "share_of_forward": out["norm_time_share"],
                "norm_ms_per_forward": statistics.median(s["norm_ms"]),
                "layers": len(norms),
                "classes": sorted({type(m).__name__ for _, m in norms}),
            }
        return out


def measure_speed(models, config: SpeedConfig | None = None, progress=None) -> dict[str, dict]:
    """Measure ``models`` (a list of (name, model)) interleaved; ``{name: summary}``."""
    return measure_speed_run(models, config, progress)["models"]


def machine_load() -> dict:
    """The 1/5/15-minute load averages and the CPUs this process may use (what a busy machine shows)."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on this platform
        load = None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"load_average": load, "cpu_count": os.cpu_count(), "usable_cpus": cpus}


def measure_speed_run(models, config: SpeedConfig | None = None, progress=None, *, null_control=None) -> dict:
    """Measure ``models`` and the optional ``null_control`` (name, model) interleaved.

    ``{"models": {name: summary}, "null_control": summary or None, "machine": {...}}``: ``machine``
    holds :func:`machine_load` before and after the timed repeats (``load_before``,
    ``load_after``), the CPU counts and the torch threads used.
    """
    cfg = config or SpeedConfig()
    if cfg.compile:
        cfg = dataclasses.replace(cfg, kinds=tuple(k for k in cfg.kinds if k != "norm_share"))
    named = list(models) + ([null_control] if null_control is not None else [])
    benches = [_Bench(name, model, cfg) for name, model in named]
    before = machine_load()
    if not cfg.compile:
        summaries = _measure(benches, cfg, progress)
    else:
        # Models of one class share their forward's code object, and Dynamo caps the graphs per code
        # object (recompile_limit, 8): past it the *later* models silently run eager, which measured
        # their compiled decode at half speed. Each model gets the default budget of its own.
        from torch import _dynamo

        with _dynamo.config.patch(recompile_limit=_dynamo.config.recompile_limit * len(benches)):
            summaries = _measure(benches, cfg, progress)
    after = machine_load()
    control = summaries.pop(null_control[0]) if null_control is not None else None
    machine = {
        "load_before": before["load_average"],
        "load_after": after["load_average"],
        "cpu_count": before["cpu_count"],
        "usable_cpus": before["usable_cpus"],
        "torch_threads": torch.get_num_threads(),
    }
    return {"models": summaries, "null_control": control, "machine": machine}


def _measure(benches, cfg: SpeedConfig, progress) -> dict[str, dict]:
    for b in benches:
        if progress:
            progress(f"warm-up {b.name}")
        b.warm_up()
    for r in range(cfg.repeats):
        k = r % len(benches)
        for b in benches[k:] + benches[:k]:
            if progress:
                progress(f"repeat {r + 1}/{cfg.repeats}: {b.name}")
            b.measure_once()
    return {b.name: b.summary() for b in benches}
