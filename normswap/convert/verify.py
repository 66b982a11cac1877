"""Built-in verification: run a probe batch through the source and the written checkpoint.

Causal LMs are compared on per-token log-probabilities over the whole vocabulary; other models
(encoders) on their first output (hidden states or MLM logits). The verdict is the two-part rule of
convert/pass_rule.py: the conversion's arithmetic carried out in float64 against the source in
float64 (is it exact), and the written float32 checkpoint's drift from the float64 source, held to
the tolerance or to 4x the source's own float32 noise floor with that floor's share capped (in
tied-embedding models whose rows share a large common offset the floor reaches 4-7e-6; CTRL's
√d-scaled embeddings 1.4e-5). For 16-bit outputs, the converted weights before their rounding to
that dtype give the rounding floor (what rounding alone moves the outputs by, also when the source
already was 16-bit).

Memory stays bounded at every model size: each model is a skeleton whose parameters are
placeholders without storage, and every module that owns parameters gets them from the weight
files just before its forward and drops them right after (``Blockwise``). At any instant one
module's weights are resident (the largest is usually the embedding or the head), plus the
probe's activations: ``peak_bytes`` is that figure, and convert refuses up front when it does not
fit in the available memory.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from normswap.architectures.probes import complete_inputs, flat_outputs
from normswap.checkpoint.remote_code import run_stored_logits_biases
from normswap.checkpoint.tensor_source import numel
from normswap.convert import pass_rule
from normswap.convert.release_memory import release_freed_memory
from normswap.convert.tensor_match import persistent_buffers
from normswap.errors import NormswapError
from normswap.model_facts import context_length

PROBE_TEXT = (
    "In the beginning the model read a LayerNorm, and the LayerNorm subtracted the mean before it "
    "divided by the spread. Then the converter centred every write into the residual stream, so the "
    "mean was already zero, and a cheaper RMSNorm could do the same work. The numbers below say "
    "whether it did: the largest change in any token's log-probability, and the perplexity of this "
    "very paragraph, measured before and after."
)
# Tokens per probe row (two rows: the paragraph and random ids). A pass costs about 2 x parameters x
# tokens multiply-adds, the bulk of verification's time; a wrong conversion moves log-probs by
# orders of magnitude more than rounding at every position, so 32 per row (64 tokens x the whole
# vocabulary) leaves the decision unchanged at half the cost of 64.
SEQ_LEN = 32
ALLOCATOR_SLACK = 64 * 2**20  # heap pages freed but not yet handed back, thread-local caches


def verification_ids(tokenizer, config, seq_len: int = SEQ_LEN, seed: int = 0) -> dict:
    """Verification's token batch (model keyword arguments): real text when a tokenizer exists, and random ids.

    Two rows of ``input_ids``; every probe input is built here, so a model that needs other
    inputs has one place to add them.
    """
    vocab = int(getattr(config, "vocab_size", None) or 256)
    seq_len = min(seq_len, context_length(config) or seq_len)
    gen = torch.Generator().manual_seed(seed)
    rand = torch.randint(0, vocab, (seq_len,), generator=gen)
    text = None
    if tokenizer is not None:
        ids = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
        ids = [i for i in ids if i < vocab]
        if len(ids) >= 8:
            reps = math.ceil(seq_len / len(ids))
            text = torch.tensor((ids * reps)[:seq_len])
    second = torch.randint(0, vocab, (seq_len,), generator=gen)
    return {"input_ids": torch.stack([text if text is not None else rand, second])}


class Arena:
    """One reusable buffer that holds the weights of the module (or nested modules) running now.

    Weights are taken in call order and given back in reverse (a module's forward nests inside
    its parent's), so a stack over one buffer serves every module of every pass: pages are faulted
    in once, by the largest module, instead of once per module and pass. The buffer grows to the
    largest set of weights resident at once, which is what a fresh allocation per module peaked
    at too.
    """

    ALIGN = 64

    def __init__(self):
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.stack: list = []  # (start, stop) of each tensor handed out, in order
        self.high = 0  # the most bytes wanted at once: the buffer's size after the next reset

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        n = numel(shape) * dtype.itemsize
        start = -(-self.stack[-1][1] // self.ALIGN) * self.ALIGN if self.stack else 0
        self.high = max(self.high, start + n)
        if start + n > self.buffer.numel():  # grows between runs (see give_back); a fresh tensor meanwhile
            self.stack.append((start, start + n))
            return torch.empty(shape, dtype=dtype)
        self.stack.append((start, start + n))
        return self.buffer[start : start + n].view(dtype).view(tuple(shape))

    def give_back(self, count: int) -> None:
        del self.stack[len(self.stack) - count :]
        if not self.stack and self.high > self.buffer.numel():
            self.buffer = torch.empty(0, dtype=torch.uint8)
            release_freed_memory()
            self.buffer = torch.empty(self.high, dtype=torch.uint8)


class Blockwise:
    """A model skeleton run with each module's own parameters loaded only during its forward.

    ``fetch(key, dtype, out=None)`` returns the state-dict tensor ``key`` in ``dtype`` (in ``out``, a
    tensor of that shape and dtype from the shared ``Arena``, when given). Parameters are
    replaced by storage-free placeholders of the right shape, dtype and device (so code that
    asks for ``model.device`` or ``.dtype`` sees the truth); a module that owns parameters loads
    them in a forward pre-hook and releases them in a forward hook. A parameter that some code
    reads without calling its module (no hook fires) is detected after the run, and the run is
    repeated with every parameter resident, where that fits.
    """

    def __init__(self, model, fetch, dtype, device="cpu", arena=None):
        self.model, self.fetch, self.dtype, self.device = model, fetch, dtype, torch.device(device)
        # a tied head's logits bias W·β runs as the files hold it: β is not resident when the head
        # runs, and the stored values are what a loader reads
        run_stored_logits_biases(model)
        self.arena = arena if arena is not None else Arena()
        self.slots = []  # (module, parameter name, state-dict key, placeholder)
        placeholders = {}
        for mname, module in model.named_modules():
            for pname, p in list(module._parameters.items()):
                if p is None:
                    continue
                holder = placeholders.get(id(p))
                if holder is None:
                    empty = torch.zeros((), dtype=dtype if p.dtype.is_floating_point else p.dtype, device=self.device)
                    holder = placeholders[id(p)] = nn.Parameter(empty.expand(p.shape), requires_grad=False)
                module._parameters[pname] = holder
                self.slots.append((module, pname, f"{mname}.{pname}" if mname else pname, holder))
        persistent = persistent_buffers(model)
        for mname, module in model.named_modules():
            for bname, buf in list(module._buffers.items()):
                if buf is None:
                    continue
                key = f"{mname}.{bname}" if mname else bname
                if key in persistent:  # stored in the files: take the stored value
                    buf = fetch(key, buf.dtype if not buf.dtype.is_floating_point else dtype)
                elif buf.dtype.is_floating_point:
                    buf = buf.to(dtype)
                module._buffers[bname] = buf.to(self.device)
        self.loaded: set = set()
        self._by_module: dict = {}
        self._frames: list = []  # arena tensors taken by each module whose forward is running

    def _load(self, module, args):
        pushed = 0
        for m, pname, key, holder in self._owned(module):
            if self.device.type == "cpu" and holder.dtype == self.dtype:
                value = self.fetch(key, self.dtype, out=self.arena.take(holder.shape, self.dtype))
                pushed += 1
            else:
                value = self.fetch(key, self.dtype).to(self.device)
            m._parameters[pname] = nn.Parameter(value, requires_grad=False)
            self.loaded.add(key)
        self._frames.append(pushed)

    def _drop(self, module, args, output):
        for m, pname, _, holder in self._owned(module):
            m._parameters[pname] = holder
        self.arena.give_back(self._frames.pop())

    def _owned(self, module):
        owned = self._by_module.get(id(module))
        if owned is None:
            owned = self._by_module[id(module)] = [s for s in self.slots if s[0] is module]
        return owned

    def __call__(self, inputs: dict):
        modules = {id(m): m for m, *_ in self.slots}
        handles = []
        for module in modules.values():
            handles.append(module.register_forward_pre_hook(self._load))
            handles.append(module.register_forward_hook(self._drop))
        try:
            with torch.no_grad():
                out = self.model(**{k: v.to(self.device) for k, v in inputs.items()})
        finally:
            for h in handles:
                h.remove()
        unused = [key for _, _, key, holder in self.slots if key not in self.loaded]
        if unused:
            raise _NotBlockwise(unused[0])
        return out

    def resident(self, inputs: dict):
        """Run with every parameter loaded (for models whose code reads parameters outside their module)."""
        for m, pname, key, _ in self.slots:
            m._parameters[pname] = nn.Parameter(self.fetch(key, self.dtype).to(self.device), requires_grad=False)
        try:
            with torch.no_grad():
                return self.model(**{k: v.to(self.device) for k, v in inputs.items()})
        finally:
            for m, pname, _, holder in self.slots:
                m._parameters[pname] = holder


class _NotBlockwise(Exception):
    pass


def outputs(
    build, fetch, dtype, inputs, causal, *, device="cpu", resident_ok=False, arena=None, keys=None
) -> torch.Tensor:
    """Log-probs (causal) or first output of a fresh skeleton from ``build()``, weights from ``fetch``;
    with ``keys``, the outputs of those names (``probes.flat_outputs``) flattened end to end instead."""
    model = build()
    if getattr(model.config, "use_cache", None):  # one forward, no generation: a key/value cache is copying only
        model.config.use_cache = False
    runner = Blockwise(model, fetch, dtype, device, arena)
    try:
        out = runner(inputs)
    except _NotBlockwise as e:
        if not resident_ok:
            raise NormswapError(
                f"verification: this model reads {e.args[0]} outside its module, so it cannot run one "
                "module at a time, and the whole model does not fit in memory: rerun with --no-verify"
            ) from None
        out = runner.resident(inputs)
    if keys:
        return declared_outputs(out, keys)
    if causal:
        return out.logits.double().log_softmax(-1).cpu()
    first = out[0] if isinstance(out, (tuple, list)) else next(iter(out.values()))
    return first.double().cpu()


def declared_outputs(out, keys) -> torch.Tensor:
    """The outputs named ``keys`` (those ``--exact-outputs pooled`` keeps exact) as one float64 vector;
    refused when the forward returns none of them (verification would compare nothing)."""
    flat = flat_outputs(out)
    kept = [flat[k].double().flatten().cpu() for k in keys if k in flat]
    if not kept:
        raise NormswapError(
            f"verification: the model returned none of the outputs --exact-outputs pooled keeps ({', '.join(keys)})"
        )
    return torch.cat(kept)


def _perplexity(logprobs, ids) -> float:
    lp = logprobs[0, :-1].gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
    return float(torch.exp(-lp.mean()))


def peak_bytes(model, config, *, rounding: bool, seq_len: int = SEQ_LEN) -> int:
    """An upper bound on what verification holds at once: the largest module's weights in float64
    (with their float32 form in the rounded run and a block of the file), the probe's activations,
    the compared outputs, and allocator slack."""
    largest = 0
    for module in model.modules():
        own = sum(p.numel() for p in module._parameters.values() if p is not None)
        largest = max(largest, own)
    vocab = int(getattr(config, "vocab_size", None) or 256)
    hidden = int(
        getattr(config, "hidden_size", None)
        or getattr(config, "n_embd", None)
        or getattr(config, "d_model", None)
        or 1024
    )
    heads = int(getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None) or 16)
    tokens = 2 * seq_len
    weights = largest * (8 + 4 + 4)  # float64 copy, float32 intermediate, its 16-bit form
    activations = tokens * (16 * hidden + 4 * vocab) * 8 + 2 * heads * seq_len * seq_len * 8
    kept = 3 * tokens * vocab * 8  # compared outputs held across runs (verify: three at most)
    return int(weights + activations + kept + ALLOCATOR_SLACK)


def verify(
    source,
    converted,
    *,
    exact=None,
    unrounded=None,
    tokenizer=None,
    causal=True,
    device="cpu",
    resident_ok=False,
    tolerance=1e-5,
    keys=None,
) -> dict:
    """Compare two checkpoints on the probe and judge them by ``pass_rule.judge``; report every figure
    the verdict rests on.

    ``source`` and ``converted`` are (build, fetch) pairs: ``build()`` a fresh skeleton,
    ``fetch(key, dtype, out=None)`` a weight from the files (see ``Blockwise``). ``exact`` fetches
    the converted weights as the conversion computes them in float64 (question 1 of the pass rule:
    is the conversion mathematically exact); without it, verification answers question 2 alone.
    ``unrounded`` (16-bit outputs) fetches them as computed before their rounding to the output
    dtype: the difference it makes is the rounding floor, measured only when needed. ``resident_ok``:
    the whole model fits in memory, so a model that cannot run module by module may run with all
    its weights loaded. ``keys``: compare only the outputs of these names (``--exact-outputs pooled``).

    Passes: source and converted in float32 (``max_abs_diff``, what a user of both sees), then with
    ``exact`` the source in float64 (the truth: ``noise_floor`` is the source's own float32 rounding,
    ``drift_float32`` the converted float32 model's distance from it) and the converted weights in
    float64 (``exact_float64``). Each pass runs with the same seeded random state (models that sample,
    ViLT's patch choice, see the same draw) and a float64 pass with float64 as torch's default dtype
    (modeling code that builds constants in the default dtype, XGLM's mask floor, then runs).
    """
    (build_src, fetch_src), (build_conv, fetch_conv) = source, converted
    arena = Arena()  # one buffer for the weights of every module of every pass
    skel = build_src()
    inputs = verification_ids(tokenizer, skel.config)
    ids = inputs["input_ids"]
    inputs = complete_inputs(skel, inputs)  # vision / audio / encoder-decoder models need more than ids

    def run(build, fetch, dtype) -> torch.Tensor:  # one pass over the probe inputs; the weights come per module
        typed = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}  # audio / image inputs
        with _pass_state(dtype):
            return outputs(
                build, fetch, dtype, typed, causal, device=device, resident_ok=resident_ok, arena=arena, keys=keys
            )

    ref = run(lambda: skel, fetch_src, torch.float32)
    conv_skel = build_conv()  # the converted and unrounded passes run the same skeleton (weights come per module)
    got = run(lambda: conv_skel, fetch_conv, torch.float32)
    if ref.shape != got.shape:
        raise NormswapError(f"verification: output shapes differ ({tuple(ref.shape)} vs {tuple(got.shape)})")
    diff = pass_rule.max_abs(ref, got)
    result = {
        "probe_tokens": int(ids.numel()),
        "metric": "max_abs_logprob_diff" if causal and not keys else "max_abs_output_diff",
        "max_abs_diff": diff,
        "noise_floor": None,
        "exact_float64": None,
        "drift_float32": diff,
    }
    if keys:
        result["compared_outputs"] = list(keys)
    elif causal:
        result["max_abs_logprob_diff"] = diff
        result["probe_perplexity_source"] = _perplexity(ref, ids)
        result["probe_perplexity_converted"] = _perplexity(got, ids)
    if exact is not None:
        try:
            hi = run(build_src, fetch_src, torch.float64)
            result["noise_floor"] = pass_rule.max_abs(hi, ref)
            result["drift_float32"] = result["max_abs_diff_float64_source"] = pass_rule.max_abs(hi, got)
            del ref  # three probe outputs at most at once (peak_bytes)
            result["exact_float64"] = pass_rule.max_abs(hi, run(lambda: conv_skel, exact, torch.float64))
        except (RuntimeError, NotImplementedError) as e:  # modeling code that does not run in float64 at all
            result["noise_floor_note"] = f"not measured: the model does not run in float64 ({str(e)[:120]})"
    figures = {k: result[k] for k in ("exact_float64", "drift_float32", "noise_floor")}
    verdict = pass_rule.judge(**figures, tolerance=tolerance)
    if unrounded is not None and not verdict["passed"] and "not exact" not in verdict.get("reason", ""):
        # rounding the converted weights to 16 bits moves the outputs by itself (a float32 pass, measured
        # only when the drift needs it): the output dtype's own loss, which the user asked for
        result["rounding_floor"] = pass_rule.max_abs(run(lambda: conv_skel, unrounded, torch.float32), got)
        verdict = pass_rule.judge(**figures, tolerance=tolerance, rounding_floor=result["rounding_floor"])
    result.update(verdict)
    return result


@contextlib.contextmanager
def _pass_state(dtype):
    """One pass's global torch state: a fixed random state, and ``dtype`` as the default dtype."""
    previous = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)
