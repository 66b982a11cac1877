"""The arms of a study, each built from the same starting model.

``Source`` reads MODEL once: a trained checkpoint (its weights are every arm's start), or a config
(a config.json file, a directory without weights, or any model with ``--from-scratch``), randomly
initialised per seed. ``build_arm`` turns the starting LayerNorm model into one arm:

* ``layernorm`` / ``layernorm-control``: the model as it is (the control differs in its data
  order and dropout stream, interleaved.py, not in its weights); the planted arms
  ``layernorm-planted-lr0.7`` and ``-lr0.5`` too (they differ in their rate: config.PLANTED_LR, the
  study's known handicap);
* ``rmsnorm``: normswap's approximate conversion with ``gamma="reset", beta="drop"`` — every
  LayerNorm that reads the residual stream (the family's norms, see normswap/architectures)
  becomes an RMSNorm with γ = 1, every other weight stays identical;
* ``layernorm-nobias``: those same LayerNorms without β (γ kept): beside rmsnorm it tells the
  mean-centring apart from the β offset;
* ``dyt``: those same LayerNorms replaced by Dynamic Tanh (Zhu et al. 2025, "Transformers without
  Normalization"): γ·tanh(α·x) + β with one learnable scalar α per layer, initially 0.5, and the
  LayerNorm's γ and β;
* ``rmsnorm-exact``: normswap's exact conversion (the same function at step 0; pre-LN only);
* ``rmsnorm-approx``: normswap's approximate conversion with convert's defaults (γ and β folded
  into the layers that read the norm where possible).
* the migration rule's ablations: ``rmsnorm-no-warmup`` (built as rmsnorm; the trainer runs it
  without warmup, config.ARM_SCHEDULE) and ``rmsnorm-keep-gamma`` (trained checkpoints: the trained
  γ stays on each RMSNorm instead of being reset to 1; from scratch γ = 1 either way).

Kernels and precision (study/norm_impl.py): every RMSNorm computes with the implementation the
study chose (``--kernels``: ``torch``'s ``F.rms_norm``, ``normswap``'s module, or under ``best``
whichever was fastest here); the LayerNorms always run PyTorch's fused ``F.layer_norm``. Under
``--precision bf16|fp16`` every norm computes in that dtype (not only autocast around it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from normswap.errors import NormswapError, first_line
from normswap.modules import RMSNorm
from normswap.study import norm_impl
from normswap.study.config import ARMS, BASELINE, CONTROL, DEFAULT_ARMS, PLANTED_LR, TRAINED_DEFAULT, TRAINED_ONLY

FALLBACK_TOKENIZER = "normswap:kjv-gpt2"  # for a bare config: the shipped model's tokenizer
DYT_ALPHA_INIT = 0.5  # the paper's default α₀ (its Table 10 lowers it for wide LLMs)


class DyTNorm(torch.nn.Module):
    """Dynamic Tanh, DyT(x) = γ·tanh(α·x) + β (Zhu, Chen, He, LeCun, Liu 2025), in place of a norm.

    Named ``...Norm`` so that model_facts.norm_modules finds it where the LayerNorm was (the study's
    per-norm measurements and the norm-time share then cover it); α is a one-element tensor, so
    AdamW's groups (matrices only) never decay it."""

    def __init__(self, hidden_size: int, weight=None, bias=None, alpha_init: float = DYT_ALPHA_INIT):
        super().__init__()
        self.hidden_size = hidden_size
        self.alpha = torch.nn.Parameter(torch.full((1,), float(alpha_init)))
        self.weight = torch.nn.Parameter(weight.detach().clone() if weight is not None else torch.ones(hidden_size))
        self.bias = torch.nn.Parameter(bias.detach().clone()) if bias is not None else None

    def forward(self, x):
        y = torch.tanh(self.alpha * x) * self.weight
        return y if self.bias is None else y + self.bias


@dataclass
class Source:
    """What MODEL gives every arm: its config, tokenizer and (when trained) its weights."""

    spec: str
    config: object
    tokenizer: object
    trained: object | None  # the loaded LayerNorm model, or None: random initialisation per seed
    replaced: list[str] | None = None  # replaced_norms(), found once

    @property
    def from_scratch(self) -> bool:
        return self.trained is None

    def start(self, seed: int) -> torch.nn.Module:
        """The starting LayerNorm model of ``seed`` (a fresh copy each call; fp32, train mode)."""
        if self.trained is not None:
            model = copy.deepcopy(self.trained)
        else:
            from transformers import AutoModelForCausalLM

            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(copy.deepcopy(self.config))  # conversion edits the config
        return model.float().train()


def _config_file(spec: str) -> Path | None:
    p = Path(spec)
    if p.is_file() and p.suffix == ".json":
        return p
    if p.is_dir() and (p / "config.json").is_file() and not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        return p / "config.json"
    return None


def _config_from_file(path: Path):
    from transformers import AutoConfig

    from normswap.checkpoint.sizes import read_config

    raw = read_config(path, str(path))  # a regular file of bounded size; every declared size checked
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise NormswapError(f"{path} is not a transformers config (no model_type)")
    raw = {k: v for k, v in raw.items() if k not in ("architectures", "auto_map", "transformers_version")}
    try:
        return AutoConfig.for_model(raw.pop("model_type"), **raw)
    except (ValueError, KeyError, TypeError) as e:
        raise NormswapError(f"{path}: {first_line(e)}") from None


def _tokenizer_for(spec: str, config, directory: Path | None):
    from normswap.checkpoint.load import load_tokenizer
    from normswap.checkpoint.tokenizer_guard import TokenizerRefused

    if directory is None or (directory / "tokenizer.json").exists() or (directory / "tokenizer_config.json").exists():
        try:
            return load_tokenizer(str(directory) if directory is not None else spec)
        except TokenizerRefused:
            raise  # the config's own tokenizer, refused: the study says so instead of using another one
        except NormswapError:
            if directory is None:
                raise
    tok = load_tokenizer(FALLBACK_TOKENIZER)
    if getattr(config, "vocab_size", 0) < len(tok):
        raise NormswapError(
            f"{spec} ships no tokenizer and its vocabulary ({config.vocab_size}) is smaller than the fallback "
            f"{FALLBACK_TOKENIZER}'s ({len(tok)}); give a model directory with a tokenizer"
        )
    return tok


def _is_causal_lm(config) -> bool:
    from normswap.checkpoint.load import is_causal_lm

    return is_causal_lm(config)


def open_source(spec: str, *, from_scratch: bool) -> Source:
    """Read MODEL (a checkpoint, a hub id, normswap:NAME, a config.json or a directory holding only one)."""
    from normswap.checkpoint.load import load_config, load_model, resolve

    config_file = _config_file(spec)
    if config_file is not None:
        config = _config_from_file(config_file)
        tokenizer = _tokenizer_for(spec, config, config_file.parent)
        trained = None
    else:
        resolved = resolve(spec)
        config = load_config(resolved)
        tokenizer = _tokenizer_for(spec, config, None)
        trained = None if from_scratch else load_model(resolved, dtype=torch.float32, task="causal-lm", config=config)
    if trained is None:  # built from the config alone: nothing but the config bounds what is built
        from normswap.checkpoint.sizes import check_without_weights

        check_without_weights(config.to_dict(), spec)
    if not _is_causal_lm(config):
        raise NormswapError(
            f"{spec} is a {getattr(config, 'model_type', '?')} model without a causal-LM head: the study trains "
            "next-token prediction; give a causal LM (GPT-2, GPT-NeoX, OPT, ...)"
        )
    return Source(spec=spec, config=config, tokenizer=tokenizer, trained=trained)


def default_arms(source: Source) -> list[str]:
    arms = list(DEFAULT_ARMS)
    return arms if source.from_scratch else arms + list(TRAINED_DEFAULT)


def check_arms(arms: list[str], source: Source) -> list[str]:
    """The arms in study order (the baseline first); refuses an unknown one or a trained-only one from scratch."""
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise NormswapError(f"--arms: no arm named {unknown[0]!r} (arms: {', '.join(ARMS)})")
    if BASELINE not in arms:
        raise NormswapError(f"--arms must include {BASELINE} (every verdict is a difference from it)")
    if len(set(arms)) != len(arms):
        raise NormswapError("--arms lists an arm twice")
    scratch_only = [a for a in arms if a in TRAINED_ONLY and source.from_scratch]
    if scratch_only:
        raise NormswapError(
            f"--arms {scratch_only[0]} converts a trained checkpoint, but this study starts from random weights "
            "(a config, or --from-scratch): drop it, or study a trained model without --from-scratch"
        )
    return [BASELINE] + [a for a in arms if a != BASELINE]


def _convert(model, arm: str):
    from normswap.convert import convert_model

    options = {
        "rmsnorm": dict(mode="approx", gamma="reset", beta="drop"),
        "rmsnorm-no-warmup": dict(mode="approx", gamma="reset", beta="drop"),
        "rmsnorm-keep-gamma": dict(mode="approx", gamma="keep", beta="drop"),
        "rmsnorm-exact": dict(mode="exact"),
        "rmsnorm-approx": dict(mode="approx"),
    }[arm]
    try:
        return convert_model(model, **options)
    except NormswapError as e:
        msg = str(e)
        if msg.startswith("nothing to convert"):
            raise NormswapError(
                f"nothing to study: {msg.split(': ', 1)[1]} — there is no LayerNorm to replace by RMSNorm"
            ) from None
        raise NormswapError(f"arm {arm}: {msg}") from None


def check_replaceable(source: Source, seed: int) -> int:
    """Refuse a model with no LayerNorm that reads the residual stream; return how many there are."""
    model = source.start(seed)
    plan = _convert(model, "rmsnorm")
    return plan.summary()["norms_replaced"]


def replaced_norms(source: Source) -> list[str]:
    """The names of the LayerNorms the rmsnorm arm replaces (the family's norms that read the
    residual stream): the layernorm-nobias and dyt arms change exactly these."""
    if source.replaced is None:
        model = source.start(0)
        _convert(model, "rmsnorm")
        source.replaced = [n for n, m in model.named_modules() if isinstance(m, RMSNorm)]
    return source.replaced


def _without_bias(model, names: list[str]) -> None:
    for name in names:
        norm = model.get_submodule(name)
        if getattr(norm, "bias", None) is not None:
            norm.bias = None  # F.layer_norm takes None: centring and γ stay, β goes


def _with_dyt(model, names: list[str]) -> None:
    for name in names:
        norm = model.get_submodule(name)
        width = int(norm.weight.shape[-1]) if getattr(norm, "weight", None) is not None else None
        if width is None:
            raise NormswapError(f"arm dyt: the norm {name} has no γ to size DyT from")
        model.set_submodule(name, DyTNorm(width, norm.weight, getattr(norm, "bias", None)))


def build_arm(
    source: Source, arm: str, seed: int, kernel_choice: str, *, precision: str = "fp32", rms_impl: str | None = None
) -> torch.nn.Module:
    """Arm ``arm`` of seed ``seed``: the seed's starting model, converted as the arm says, its
    RMSNorms computing with ``rms_impl`` (default: what ``kernel_choice`` names; ``best`` without a
    measured choice: normswap's) and every norm in ``precision``'s dtype."""
    model = source.start(seed)
    if arm == "layernorm-nobias":
        _without_bias(model, replaced_norms(source))
    elif arm == "dyt":
        _with_dyt(model, replaced_norms(source))
    elif arm not in (BASELINE, CONTROL, *PLANTED_LR):  # a planted arm is layernorm at another rate
        _convert(model, arm)
        norm_impl.use_rms_impl(model, rms_impl or norm_impl.rms_impl_of(kernel_choice, None))
    norm_impl.compute_in(model, precision)
    model.float().train()
    for p in model.parameters():
        p.requires_grad_(True)
    return model
