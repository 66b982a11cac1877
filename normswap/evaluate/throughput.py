"""Throughput, memory and time-in-norm-layers, measured for several models in one run.

Fairness rules (every model sees the same conditions):
- all models are timed in the same process by normswap/timing.py: short blocks in interleaved
  pairs against the baseline, in alternating order, a ratio per pair, so drifts of the machine
  (clock, thermal, other processes) cancel within each pair;
- warm-up runs (allocator, kernels' first calls, lazy init) come first and are not measured;
  they also pick how many calls one measurement makes so that each lasts at least ``min_time``;
- the device is synchronised before every clock read.

Measurements, on random token ids (throughput does not depend on the values):
- forward: inference forward of batch_size x seq_len under torch.inference_mode;
- train_step: forward + backward + AdamW step (lr=0, so weights never change but every
  optimizer operation still runs), in train mode;
- generate: greedy generation with the KV cache, one sequence; prefill (the prompt) and decode
  (one token per step) timed separately; generate = new tokens / (prefill + decode time);
- norms (the ``norm_share`` kind): the time in norm layers. One untimed, hooked forward records
  every call the forward makes into a norm layer with the inputs it received; the timed function
  replays those calls, in order, on those inputs, so the instrument times one forward's worth of
  norm work as it times everything else (pairs against the baseline's norms, the null control's
  norms beside them, an interval and a verdict). The hooks never run in a timed block. share =
  norm seconds per call ÷ forward seconds per call, both this run's medians for the model. The
  replayed norms find their inputs where the previous replayed call left the cache, not where the
  forward's matmuls left it: on a model whose activations outgrow the cache, the replay may run
  faster than the same norms do inside the forward.
Peak memory is measured by :mod:`normswap.evaluate.memory`.

A null control (``null_control=``: the baseline loaded a second time) is measured like any other
model, interleaved with the rest; normswap/stats/verdicts.py judges every ratio against its spread. The
machine's load average before and after the run and its CPU count come back with the summaries
(:func:`measure_speed_run`), so a results.json says how busy the machine was.

With ``compile=True`` every model is wrapped in ``torch.compile`` (Inductor, in ``compile_mode``;
decoding with a growing KV cache makes Dynamo recompile once with dynamic shapes) before the
warm-up, which then also pays the compilation; the original and the converted model are both
compiled the same way, so the ratio compares compiled with compiled. ``compile_mode=
"reduce-overhead"`` is how a model is served on a GPU: every step replays a CUDA graph, and the
decode step, whose cache is cut back to the same length before each step, replays one graph. Norm time is
not measured then: a compiled graph fuses the norms into their neighbours, so they have no time of
their own to replay.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import time

import torch

from normswap import timing
from normswap.compile_cache import compiled
from normswap.evaluate.config import SpeedConfig
from normswap.evaluate.kinds import training_loss
from normswap.evaluate.perplexity import model_device
from normswap.host import load_average, usable_cpus
from normswap.model_facts import context_length, norm_modules

# the first check of the stop rule: fewer pairs than this are never called converged
MIN_PAIRS = 20


def _cache_of(out):
    cache = out.get("cache") if hasattr(out, "get") else None
    return cache if cache is not None else out.past_key_values


_REFILL = 64


def _cut(cache, length: int) -> None:
    """Drop the cache's tokens past ``length`` where the cache allows it (transformers 5: ``crop``
    takes the number of tokens to remove, negated)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        try:
            cache.crop(-extra)
        except (RuntimeError, ValueError, NotImplementedError):
            pass  # throughput.py refills it instead


def own_memory(model) -> int:
    """Move every CPU parameter and buffer of ``model`` into freshly allocated memory of its own;
    returns the bytes moved.

    Why: a checkpoint's weights are memory-mapped from its file, and a file loaded twice (the
    baseline and its null control) is mapped twice onto the *same* physical pages. Caches are
    physically indexed, so each of the two warms the other's, while a candidate loaded from another
    file has pages of its own: identical copies then read a few per cent apart and the null control
    no longer measures what the candidate faces (a role swap showed it: whichever model was not the
    baseline read "slower"). With every model on memory of its own, all share alike. Tensors that
    share a storage (tied weights, views) keep sharing one new storage. Device memory (CUDA) is each
    model's own already and is left alone."""
    moved = 0
    fresh: dict = {}
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.device.type != "cpu" or t.numel() == 0:
                continue
            storage = t.untyped_storage()
            new = fresh.get(storage.data_ptr())
            if new is None:
                new = fresh[storage.data_ptr()] = storage.clone()
                moved += storage.nbytes()
            t.set_(new, t.storage_offset(), t.size(), t.stride())
    return moved


class ModelBench:
    """One model's prepared inputs and measurement functions."""

    def __init__(self, name, model, cfg: SpeedConfig):
        self.name = name
        self.model = model
        self.cfg = cfg
        if not getattr(model, "is_onnx", False):
            own_memory(model)  # every timed model, the null control included (see own_memory)
        # what this model can be timed on: an ONNX graph (evaluate/onnx_model.py) only runs forward
        self.kinds = tuple(k for k in cfg.kinds if k in getattr(model, "speed_kinds", cfg.kinds))
        onnx = getattr(model, "is_onnx", False)
        # the compiled wrapper shares the model's parameters and train/eval state
        self.run = compiled(model, mode=cfg.compile_mode) if cfg.compile and not onnx else model
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
        self._decode = None  # (cache, token) after the prompt, made on the first decode step
        # what _norms replays, recorded on its first call: a copy of every norm input of one forward
        # (for a 7B model at 8 × 512 tokens in bf16, ~2 GB), dropped once the norms are timed
        self._norm_inputs = None
        self.norm_calls_per_forward = None
        # the norm layers whose time is measured (found once); a model without any has nothing to
        # replay: no norm time, not a zero one
        self.norms = norm_modules(model) if "norm_share" in self.kinds else []

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

    def _norm_calls(self) -> list:
        """Every call the forward makes into a norm layer, as (module, args, kwargs) with the inputs
        that call received: one untimed forward with hooks records them (kept on the model's device)."""
        calls: list = []

        def keep(x):  # a copy: a later in-place op of the forward must not change what is replayed
            return x.clone() if isinstance(x, torch.Tensor) else x

        def record(module, args, kwargs):
            calls.append((module, tuple(keep(a) for a in args), {k: keep(v) for k, v in kwargs.items()}))

        handles = [m.register_forward_pre_hook(record, with_kwargs=True) for _, m in self.norms]
        try:
            with torch.inference_mode():
                self.model(input_ids=self.batch, use_cache=False)
        finally:
            for h in handles:
                h.remove()
        return calls

    def _norms(self):
        """One forward's worth of norm-layer work: each norm layer run on the inputs it had in a forward
        of ``batch``, in the forward's order. Timed by the instrument against the baseline's, so the
        time in norms gets pairs, an interval and a null control like every throughput."""
        if self._norm_inputs is None:
            self._norm_inputs = self._norm_calls()
            self.norm_calls_per_forward = len(self._norm_inputs)
        with torch.inference_mode():
            for module, args, kwargs in self._norm_inputs:
                module(*args, **kwargs)

    def drop_norm_inputs(self):
        self._norm_inputs = None

    # -- what the timing instrument calls: one operation each -----------------------------------
    def _prefill(self):
        with torch.inference_mode():
            self.run(input_ids=self.prompt, use_cache=True)

    def _decode_step(self):
        """One greedy decode step at a short, fixed KV cache (the prompt's ``prompt_len`` tokens):
        the cache is cut back to the prompt before every step, so every step costs the same however
        many ran (a growing cache would make later blocks slower than earlier ones, whichever model
        ran them). A cache that cannot be cut (some layer kinds refuse) is prefilled again once it
        has grown by ``_REFILL`` tokens, in whichever block that falls: rare, and alike for every model."""
        with torch.inference_mode():
            if self._decode is None or self._decode[0].get_seq_length() >= self.prompt_len + _REFILL:
                out = self.run(input_ids=self.prompt, use_cache=True)
                self._decode = (_cache_of(out), out.logits[:, -1:].argmax(-1))
            cache, token = self._decode
            _cut(cache, self.prompt_len)
            self.run(input_ids=token, use_cache=True, **{self.cache_arg: cache})

    def _generate(self):
        """One whole greedy generation of ``new_tokens`` tokens after the prompt."""
        with torch.inference_mode():
            out = self.run(input_ids=self.prompt, use_cache=True)
            for _ in range(self.new_tokens - 1):
                token = out.logits[:, -1:].argmax(-1)
                out = self.run(input_ids=token, use_cache=True, **{self.cache_arg: _cache_of(out)})

    def _generate_call(self):
        """One call of the model's own ``generate()``, greedy, batch 1, exactly ``new_tokens`` tokens after
        the prompt: what users call, with the host work transformers adds to every step (preparing the
        inputs, the logits processors, the stopping criteria) that _generate's bare loop leaves out."""
        n = self.new_tokens
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        pad = eos[0] if isinstance(eos, list) and eos else eos
        with torch.inference_mode():
            self.model.generate(
                self.prompt,
                attention_mask=torch.ones_like(self.prompt),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0 if pad is None else pad,
            )

    def operation(self, kind: str):
        """The zero-argument callable timed for ``kind``, and the tokens one call processes."""
        tokens = self.batch.numel()
        return {
            "forward": (self._forward, tokens),
            "train_step": (self._train_step, tokens),
            "prefill": (self._prefill, self.prompt_len),
            "decode": (self._decode_step, 1),
            "generate": (self._generate, self.new_tokens),
            "generate_call": (self._generate_call, self.new_tokens),
            "norms": (self._norms, tokens),
        }[kind]

    def timed_kinds(self) -> tuple[str, ...]:
        """The instrument's kinds for this model: ``generate`` stands for prefill, decode and generate;
        ``norm_share`` for ``norms`` (the norm layers' replayed work) and the ``forward`` it is a share of."""
        norms = ("forward", "norms") if self.norms else ()
        expand = {"generate": ("prefill", "decode", "generate"), "norm_share": norms}
        return tuple(dict.fromkeys(k for kind in self.kinds for k in expand.get(kind, (kind,))))

    def summary(self, comparisons: dict) -> dict:
        """This model's results.json speed fields from the run's comparisons (one per timed kind;
        each against its own baseline: the run's, or the model's own for a kind the run's cannot run)."""
        tps, paired, calls = {}, {}, {}
        for kind, cmp in comparisons.items():
            if self.name not in cmp.seconds_per_call:
                continue
            if kind != "norms":
                tps[kind] = self.operation(kind)[1] / cmp.seconds_per_call[self.name]
            calls[kind] = cmp.calls_per_sample
            if self.name != cmp.baseline:  # a kind the baseline cannot run has a baseline of its own
                paired[kind] = cmp[self.name].to_json() | {"stop_reason": cmp.stop_reason}
        if "decode" in tps and self.new_tokens <= 1:
            tps["decode"] = None
        norm_time = self._norm_time(comparisons)
        return {
            "tokens_per_second": tps,
            "norm_time_share": norm_time["share_of_forward"] if norm_time else None,
            "norm_time": norm_time,
            "speed_setup": {
                "batch_size": self.cfg.batch_size,
                "seq_len": self.seq_len,
                "prompt_len": self.prompt_len,
                "new_tokens": self.new_tokens,
                "calls_per_measurement": calls,
                # per kind, against the baseline: {ratio, low, high, pairs, verdict, stop_reason};
                # ``norms`` is the norm layers' speed (speed_intervals.py turns it into a time ratio)
                "paired": paired,
            },
        }

    def _norm_time(self, comparisons: dict) -> dict | None:
        """results.json's ``norm_time``: the replayed norm layers' seconds per call over the forward's,
        both the instrument's medians for this model in this run; None when the norms were not timed."""
        norms, forward = comparisons.get("norms"), comparisons.get("forward")
        if norms is None or self.name not in norms.seconds_per_call:
            return None
        norm_s = norms.seconds_per_call[self.name]
        forward_s = forward.seconds_per_call.get(self.name) if forward is not None else None
        layers = self.norms
        return {
            "share_of_forward": norm_s / forward_s if forward_s else None,
            "norm_ms_per_forward": norm_s * 1e3,
            "layers": len(layers),
            "calls_per_forward": self.norm_calls_per_forward,
            "classes": sorted({type(m).__name__ for _, m in layers}),
            "implementations": implementations(layers),
        }


def implementations(layers) -> dict:
    """What each kind of norm call ran, over a model's norm layers: ``{kind of call: {implementation:
    layers}}``. A converted norm says what normswap.kernels decided for it (``kernels_ran``, e.g.
    ``{"cpu float32 ×128, many rows, inference": {"cpu": 9}}``); any other norm layer ran its own
    forward (``{"own forward": {"LayerNorm": 9}}``)."""
    out: dict = {}
    for _, module in layers:
        ran = getattr(module, "kernels_ran", None)
        for kind, impl in (ran or {"own forward": type(module).__name__}).items():
            out.setdefault(kind, {}).setdefault(impl, 0)
            out[kind][impl] += 1
    return out


def measure_speed(models, config: SpeedConfig | None = None, progress=None) -> dict[str, dict]:
    """Measure ``models`` (a list of (name, model)) interleaved; ``{name: summary}``."""
    return measure_speed_run(models, config, progress)["models"]


def machine_load() -> dict:
    """The 1/5/15-minute load averages and the CPUs this process may use (what a busy machine shows)."""
    return {"load_average": load_average(), "cpu_count": os.cpu_count(), "usable_cpus": usable_cpus()}


def measure_speed_run(
    models, config: SpeedConfig | None = None, progress=None, *, null_control=None, baseline=None
) -> dict:
    """Measure ``models`` and the optional ``null_control`` (name, model) in interleaved pairs.

    ``baseline``: the name every ratio is against (default: the first model). ``{"models": {name:
    summary}, "null_control": summary or None, "machine": {...}, "timing": {kind: the instrument's
    run}}``: ``machine`` holds :func:`machine_load` before and after the timed pairs
    (``load_before``, ``load_after``), the CPU counts and the torch threads used; ``timing`` each
    kind's stop reason, pairs, seconds and calls per block (normswap/timing.py).
    """
    cfg = config or SpeedConfig()
    if cfg.compile:
        cfg = dataclasses.replace(cfg, kinds=tuple(k for k in cfg.kinds if k != "norm_share"))
    named = list(models) + ([null_control] if null_control is not None else [])
    benches = [ModelBench(name, model, cfg) for name, model in named]
    baseline = baseline or benches[0].name
    null_name = null_control[0] if null_control is not None else None
    before = machine_load()
    if not cfg.compile:
        summaries, comparisons = _measure(benches, cfg, progress, baseline, null_name)
    else:
        # Models of one class share their forward's code object, and Dynamo caps the graphs per code
        # object (recompile_limit, 8): past it the *later* models silently run eager, which measured
        # their compiled decode at half speed. Each model gets the default budget of its own.
        from torch import _dynamo

        with _dynamo.config.patch(recompile_limit=_dynamo.config.recompile_limit * len(benches)):
            summaries, comparisons = _measure(benches, cfg, progress, baseline, null_name)
    after = machine_load()
    control = summaries.pop(null_name) if null_name is not None else None
    machine = {
        "load_before": before["load_average"],
        "load_after": after["load_average"],
        "cpu_count": before["cpu_count"],
        "usable_cpus": before["usable_cpus"],
        "torch_threads": torch.get_num_threads(),
    }
    timing_runs = {kind: _run_facts(cmp) for kind, cmp in comparisons.items()}
    return {"models": summaries, "null_control": control, "machine": machine, "timing": timing_runs}


def _run_facts(cmp: timing.Comparison) -> dict:
    keep = ("baseline", "stop_reason", "elapsed_s", "rounds", "calls_per_sample", "target_halfwidth", "null_band")
    return {k: v for k, v in cmp.to_json().items() if k in keep}


def _syncer(benches):
    devices = {b.device for b in benches if b.device.type == "cuda"}
    return (lambda: [torch.cuda.synchronize(d) for d in devices]) if devices else None


def compare_kind(
    benches,
    kind: str,
    cfg: SpeedConfig,
    baseline: str,
    null_name,
    progress=None,
    *,
    calls: int | None = None,
    balanced: bool = False,
) -> timing.Comparison:
    """One kind (forward, decode, ...) of every bench that has it, timed by normswap/timing.py.

    A block is ``calls`` calls, by default as many as make ``cfg.min_time`` seconds on the baseline
    (one whole generation for ``generate`` and ``generate_call``); ``cfg.repeats`` pairs at most, ``cfg.speed_budget``
    seconds at most (for ``generate``, warm-up included: as many pairs as fit, counted beforehand)."""
    taking = [b for b in benches if kind in b.timed_kinds()]
    # benches sharing a name are replicas of one model (timing.compare rotates through them)
    copies: dict = {}
    for b in taking:
        copies.setdefault(b.name, []).append(b.operation(kind)[0])
    fns = {name: fs[0] if len(fs) == 1 else fs for name, fs in copies.items()}
    base = baseline if baseline in fns else taking[0].name  # a kind the baseline cannot run: absolute only
    sync = _syncer(taking)
    for f in copies[base]:
        f()  # the first call pays lazy initialisation (the optimizer, the cache): not a calibration
    max_pairs, warmup = cfg.repeats, max(cfg.warmup, 1)
    if calls is None and kind in ("generate", "generate_call"):
        calls = 1
        max_pairs = min(max_pairs, _generations_within(cfg.speed_budget, copies[base][0], len(fns), warmup, sync))
    elif calls is None:
        calls = timing.calibrate_calls(
            copies[base][0], cfg.min_time, max_calls=cfg.max_calls, clock=time.perf_counter, sync=sync
        )
    if progress:
        progress(f"speed: {kind}, {len(fns)} models in interleaved pairs of {calls} call(s)")
    return timing.compare(
        fns,
        base,
        null_name if base == baseline and null_name in fns else None,
        calls_per_sample=calls,
        target_halfwidth=cfg.target_halfwidth,
        budget_s=cfg.speed_budget,
        min_pairs=min(MIN_PAIRS, max_pairs),
        max_pairs=max_pairs,
        warmup=warmup,
        lead_in=_LEAD_IN,
        seed=cfg.seed,
        clock=time.perf_counter,  # looked up now: tests plant a virtual clock as speed.time
        sync=sync,
        balanced=balanced,
        progress=progress,
    )


# untimed calls before each timed block (timing.compare's lead_in): a block of one whole generation costs two
_LEAD_IN = 1


def _generations_within(budget_s: float, generate, functions: int, warmup: int, sync) -> int:
    """The pairs of ``generate`` blocks that fit ``budget_s`` with the warm-up (at least one).

    A block is one whole generation (a second or more on a large model decoding eagerly), and the
    instrument checks its budget only after each round of pairs, so rounds are counted beforehand from
    one timed generation: the warm-up runs ``warmup`` one-generation blocks of every function, and each
    round pairs the baseline with every other function, two blocks of ``_LEAD_IN`` + 1 generations a pair."""
    if sync:
        sync()
    start = time.perf_counter()
    generate()
    if sync:
        sync()
    seconds = time.perf_counter() - start
    blocks_a_round = 2 * max(functions - 1, 1) * (_LEAD_IN + 1)
    left = budget_s - seconds - functions * warmup * seconds  # this timed generation counts too
    return max(1, int(left // max(blocks_a_round * seconds, 1e-9)))


def _measure(benches, cfg: SpeedConfig, progress, baseline: str, null_name) -> tuple[dict, dict]:
    kinds = dict.fromkeys(k for b in benches for k in b.timed_kinds())
    comparisons = {}
    for kind in kinds:
        comparisons[kind] = compare_kind(benches, kind, cfg, baseline, null_name, progress)
        if kind == "norms":  # the recorded norm inputs are only for this kind's replays
            for b in benches:
                b.drop_norm_inputs()
    summaries = {}
    for b in benches:
        mine = {kind: cmp for kind, cmp in comparisons.items() if cmp.baseline == baseline or b.name == cmp.baseline}
        summaries[b.name] = b.summary(mine)
    return summaries, comparisons
