"""Tiny, real transformers models built from each family's test configs (test helpers; not shipped).

Used by the test suite and bench/convert_precision.py: a model whose γ, β, biases and embeddings
are randomised (embeddings deliberately *not* centred, norms far from γ=1, β=0), so a wrong
conversion cannot pass by luck.
"""

from __future__ import annotations

import os

import torch

from normswap.architectures import get_family
from normswap.architectures.randomize import randomize_


def family_variants(placement=None):
    """(family name, variant index) for every test config of every family."""
    from normswap.architectures import all_families

    out = []
    for fam in all_families():
        for i, cfg in enumerate(fam.test_configs):
            if placement is None or _placement(fam, cfg) == placement:
                out.append((fam.name, i))
    return out


def _placement(fam, cfg_overrides):
    from transformers import AutoConfig

    return fam.placement_for(AutoConfig.for_model(fam.model_types[0], **cfg_overrides))


def tiny_config(family: str, variant: int = 0, **overrides):
    from transformers import AutoConfig

    fam = get_family(family)
    kwargs = dict(fam.test_configs[variant])
    kwargs.update(overrides)
    return AutoConfig.for_model(fam.model_types[0], **kwargs)


def tiny_model(
    family: str, variant: int = 0, *, seed: int = 0, randomize: bool = True, task: str = "auto", **overrides
):
    """Build a tiny model of ``family`` (causal LM where the family has one, else its MLM/base)."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

    config = tiny_config(family, variant, **overrides)
    torch.manual_seed(seed)
    classes = {"causal-lm": (AutoModelForCausalLM,), "masked-lm": (AutoModelForMaskedLM,), "base": (AutoModel,)}
    order = classes.get(task, (AutoModelForCausalLM, AutoModelForMaskedLM, AutoModel))
    model = None
    for auto in order:
        try:
            model = auto.from_config(config)
            break
        except ValueError:
            continue
    if model is None:
        raise ValueError(f"no model class for {family}")
    if randomize:
        randomize_(model, seed)
    return model.eval()


def without_centring(model):
    """``model`` with every LayerNorm computing γ·x/rms(x) + β (same ε): what an approx conversion
    promises, and what an engine that swaps LayerNorm for RMSNorm runs."""
    from normswap.model_facts import is_layernorm

    for module in model.modules():
        if is_layernorm(module):

            def forward(x, m=module):
                y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.eps)
                return y * m.weight + (m.bias if m.bias is not None else 0)

            module.forward = forward
    return model


def assert_no_traceback(args, code, err) -> None:
    """A refusal is one line, never a traceback (issue #22), unless --debug asked for one.

    Every CLI run in the suite passes through here (run_cli, and subprocess runs via
    ``checked_run``), so a refusal that leaks a traceback fails the test that provoked it."""
    if code not in (0, None) and "--debug" not in [str(a) for a in args] and os.environ.get("NORMSWAP_DEBUG") != "1":
        assert "Traceback" not in err, (
            f"normswap {' '.join(map(str, args))} exited {code} with a traceback:\n{err[-3000:]}"
        )
        # main()'s last resort for an exception nobody anticipated: a traceback squeezed into one line
        assert "rerun with --debug for the traceback" not in err, (
            f"normswap {' '.join(map(str, args))}: unanticipated error:\n{err[-3000:]}"
        )


def checked_run(cmd, **kwargs):
    """subprocess.run for a normswap command line, with the no-traceback check on a failure."""
    import subprocess

    proc = subprocess.run(cmd, check=False, **kwargs)
    if isinstance(proc.stderr, (str, bytes)):
        err = proc.stderr if isinstance(proc.stderr, str) else proc.stderr.decode(errors="replace")
        assert_no_traceback(cmd, proc.returncode, err)
    return proc


class VirtualClock:
    """Stands in for the `time` module inside timing code (monkeypatch the module's `time`):
    perf_counter() reads a clock that only the test advances, by a known cost per call of what is
    timed. A wall clock on a shared machine adds noise of the size of any threshold a test could
    afford; with this one the timing code itself (what it times, how it divides, which name it
    credits) is checked exactly. Everything else falls through to the real `time`."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds

    def __getattr__(self, name):
        import time

        return getattr(time, name)


def tiny_wordpiece():
    """A 256-piece lowercase BERT WordPiece tokenizer trained on 30 embedded documents; the same ids every run."""
    import itertools

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from normswap.data import load_documents

    specials = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
    tk = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.train_from_iterator(
        itertools.islice(load_documents("embedded", "train"), 30),
        trainers.WordPieceTrainer(vocab_size=256, special_tokens=list(specials)),
    )
    # the trainer finds the same 256 pieces every time but numbers its ties in hash order, which
    # changes per process: renumber them (specials first, then by spelling) so that every run, on
    # every machine, builds the same model on the same token ids
    pieces = sorted(set(tk.get_vocab()) - set(specials))
    tk.model = models.WordPiece({p: i for i, p in enumerate([*specials, *pieces])}, unk_token="[UNK]")
    tk.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", tk.token_to_id("[CLS]")), ("[SEP]", tk.token_to_id("[SEP]"))],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


# the address-space cap the untrusted-input tests run commands under: every refusal must come well within it
ADDRESS_SPACE_CAP = 4 << 30


def normswap_capped(*args, timeout: int) -> tuple[int, str]:
    """``python -m normswap ARGS`` in a child under a 4 GB address-space cap and a 1 GB file-size cap,
    with a timeout: a read that blocks (a FIFO) or allocates without bound fails the test instead of
    hanging it or the machine. Returns (exit code, stderr)."""
    import resource
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    def limits():
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_CAP, ADDRESS_SPACE_CAP))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 30, 1 << 30))

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    try:
        r = subprocess.run(
            [sys.executable, "-m", "normswap", *map(str, args)],
            env=env, capture_output=True, text=True, timeout=timeout, preexec_fn=limits,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"normswap {' '.join(map(str, args))} did not answer in {timeout} s (a blocking read?)")
    return r.returncode, r.stderr
