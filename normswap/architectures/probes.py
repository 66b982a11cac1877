"""Probe inputs of the right kind and shape for any model: token ids, images, audio features.

Used by discovery (its trace and its exactness check) and by convert's verification for models
that do not take text alone (vision encoders take ``pixel_values``, Whisper ``input_features``
plus ``decoder_input_ids``, CLIP both ids and pixels). Values are random but seeded.
"""

from __future__ import annotations

import inspect

import torch

from normswap.model_facts import context_length, sub_config


def _first(config, names, default):
    for n in names:
        v = getattr(config, n, None)
        # sizes only: XLNet's max_position_embeddings is -1 ("unlimited"), which is no length
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
        if isinstance(v, (list, tuple)) and v and isinstance(v[0], int) and v[0] > 0:
            return v[0]
    return default


def _vocab(config) -> int:
    return _first(sub_config(config, "text_config", "decoder"), ("vocab_size",), 256) or 256


def forward_parameters(model) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def required_parameters(model) -> set[str]:
    return {
        n
        for n, p in inspect.signature(model.forward).parameters.items()
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def takes_text_only(model) -> bool:
    """True for models whose forward needs nothing but ``input_ids``."""
    params = forward_parameters(model)
    needs = {"pixel_values", "input_features"} & params
    return (
        getattr(model, "main_input_name", "input_ids") == "input_ids"
        and not needs
        and not ("decoder_input_ids" in params and getattr(model.config, "is_encoder_decoder", False))
    )


def probe_inputs(model, *, batch: int = 2, seq_len: int = 16, seed: int = 0, dtype=None, ids=None, device=None) -> dict:
    """Keyword arguments for ``model(**inputs)``: every main input the forward takes.

    ``ids`` (a [batch, seq] LongTensor) replaces the random token ids, e.g. real text in verify.
    """
    config = model.config
    params = forward_parameters(model)
    required = required_parameters(model)
    gen = torch.Generator().manual_seed(seed)
    dtype = dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    device = device or next((p.device for p in model.parameters()), torch.device("cpu"))
    out: dict = {}
    main = getattr(model, "main_input_name", "input_ids")
    length = min(seq_len, context_length(config) or seq_len) if ids is None else ids.shape[1]
    vocab = _vocab(config)

    def random_ids(n):
        return torch.randint(0, vocab, (ids.shape[0] if ids is not None else batch, n), generator=gen)

    if "pixel_values" in params and (main == "pixel_values" or "pixel_values" in required or "input_ids" in params):
        vision = sub_config(config, "vision_config")
        size = _first(vision, ("image_size",), 32)
        channels = _first(vision, ("num_channels",), 3)
        out["pixel_values"] = torch.randn(batch, channels, size, size, generator=gen)
    if "input_features" in params and main == "input_features":
        audio = sub_config(config, "encoder_config", "audio_config")
        mels = _first(audio, ("num_mel_bins", "feature_size"), 80)
        frames = 2 * _first(audio, ("max_source_positions",), 32)
        out["input_features"] = torch.randn(batch, mels, frames, generator=gen)
    if "input_values" in params and main == "input_values":
        audio = sub_config(config, "audio_config")
        mels = _first(audio, ("num_mel_bins",), 0)
        if mels:  # spectrogram models (AST): [batch, frames, mel bins]
            out["input_values"] = torch.randn(batch, _first(audio, ("max_length",), 128), mels, generator=gen)
        else:  # raw waveform models (wav2vec2 family): [batch, samples]
            out["input_values"] = torch.randn(batch, 4000, generator=gen)
    if "input_ids" in params and (
        main == "input_ids" or "input_ids" in required or "pixel_values" in out and main != "pixel_values"
    ):
        out["input_ids"] = ids if ids is not None else random_ids(length)
    if "decoder_input_ids" in params and getattr(config, "is_encoder_decoder", False):
        dec_len = min(length, _first(config, ("max_target_positions", "max_position_embeddings"), length))
        out["decoder_input_ids"] = ids[:, :dec_len] if ids is not None else random_ids(dec_len)
    batch_of = next(iter(out.values())).shape[0] if out else batch
    for key, value in list(out.items()):
        out[key] = value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
        assert value.shape[0] == batch_of
    return out


def model_outputs(model, inputs, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every floating-point tensor the model returns, by name (nested tuples flattened).

    The forward runs with the random generators seeded by ``seed`` (and restored afterwards), so
    models that draw at run time (ViT-MAE's patch masking, ViLT's patch sampling) draw the same for
    a source and its conversion.
    """
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(seed)
        out = model(**inputs)
    return flat_outputs(out)


def flat_outputs(out) -> dict[str, torch.Tensor]:
    """A forward's floating-point tensors by name (``model_outputs``' names: nested tuples and
    outputs flattened to ``a.0``, ``vision_model_output.pooler_output``), caches left out."""
    items = out.items() if hasattr(out, "items") else enumerate(out if isinstance(out, (tuple, list)) else (out,))
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix, value):
        if isinstance(value, torch.Tensor):
            if value.is_floating_point():
                flat[prefix] = value
        elif isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)
        elif hasattr(value, "items") and not hasattr(value, "get_seq_length"):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)

    for k, v in items:
        if k in ("past_key_values",) or hasattr(v, "get_seq_length"):
            continue  # caches repeat the projections already compared through the outputs
        walk(str(k), v)
    return flat


def complete_inputs(model, inputs: dict) -> dict:
    """Verification's text probe, plus images / audio features / decoder ids where the model needs them
    (built on the CPU in float32: ``model`` may be a meta-device skeleton)."""
    if takes_text_only(model):
        return inputs
    return probe_inputs(model, ids=inputs.get("input_ids"), dtype=torch.float32, device="cpu")
