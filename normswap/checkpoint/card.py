"""The model card (README.md) written next to the weights, generated from the manifest."""

from __future__ import annotations

from pathlib import Path


def _fmt(x, spec=".3g"):
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def render_model_card(manifest: dict, config: dict) -> str:
    """The card: what was converted and how, its verification, its fine-tune, and how to load it."""
    conv = manifest.get("conversion") or {}
    source = conv.get("source") or manifest.get("source") or "unknown source"
    lines = [
        "---",
        "library_name: transformers",
        "tags: [normswap, rmsnorm]",
        "---",
        f"# {source} with RMSNorm (normswap)",
        "",
    ]
    lines += conversion_section(config.get("normswap") or {}, source)
    lines += verification_section(manifest.get("verification") or {})
    lines += slice_section(manifest.get("slice") or {})
    lines += finetune_section(manifest.get("finetune") or {})
    lines += load_section(config)
    return "\n".join(lines)


def conversion_section(block: dict, source: str) -> list[str]:
    """The converted config's ``normswap`` block as a table, and what its mode means."""
    if not block:
        return []
    norms = block.get("norms", {})
    gam = {}
    bet = {}
    for rec in norms.values():
        gam[rec["gamma"]] = gam.get(rec["gamma"], 0) + 1
        bet[rec["beta"]] = bet.get(rec["beta"], 0) + 1
    head = (
        "untied (folded)"
        if block.get("untied")
        else ("tied, kept exact" if block.get("tied") else "untied in the source")
    )
    if block.get("logits_bias"):
        head += (
            "; its bias holds the final norm's β ("
            + ", ".join(f"{h}.bias = W·β of {n}" for h, n in block["logits_bias"].items())
            + ")"
        )
    lines = [
        f"Converted from **{source}** ({block.get('source_class', '')}, family `{block.get('family')}`) by "
        f"normswap {block.get('normswap_version')} in **{block.get('mode')}** mode.",
        "",
        "| what | value |",
        "|---|---|",
        f"| norms replaced by RMSNorm | {len(norms)} |",
        f"| γ (weight) | {', '.join(f'{k}: {v}' for k, v in sorted(gam.items()))} |",
        f"| β (bias) | {', '.join(f'{k}: {v}' for k, v in sorted(bet.items()))} |",
        f"| biases created in reading linears | {len(block.get('added_biases', {}))} |",
        f"| outputs centred at run time | {', '.join(block.get('centered_outputs', [])) or 'none'} |",
        f"| output head | {head} |",
        f"| left alone | {', '.join(x['module'] for x in block.get('left_alone', [])) or 'none'} |",
        "",
    ]
    if block.get("mode") == "exact":
        lines += [
            "Exact mode: every write into the residual stream was made zero-mean, so each RMSNorm computes "
            "what the LayerNorm it replaced computed (same ε); γ and β were folded into the reading linears "
            "wherever the norm's output only feeds linears.",
            "",
        ]
    if block.get("exact_outputs"):
        lines += [
            f"Converted with `--exact-outputs pooled`: exact outputs {', '.join(block['exact_outputs'])}. "
            f"Not exact: {', '.join(block.get('shifted_outputs') or [])} (the raw residual stream, which moves "
            "by its per-token mean); verification compared the exact outputs only.",
            "",
        ]
    if block.get("mode") != "exact":
        lines += [
            "Approximate mode: the residual stream was *not* centred, so the model's function changed; "
            "heal it with `normswap finetune`.",
            "",
        ]
    return lines


def verification_section(ver: dict) -> list[str]:
    if not ver:
        return []
    return [
        "## Verification",
        "",
        "| measure | value |",
        "|---|---|",
        f"| probe tokens | {ver.get('probe_tokens')} |",
        f"| max abs Δ log-prob (float32) | {_fmt(ver.get('max_abs_logprob_diff'))} |",
        *(
            [f"| max abs Δ of {', '.join(ver['compared_outputs'])} (float32) | {_fmt(ver.get('max_abs_diff'))} |"]
            if ver.get("compared_outputs")
            else []
        ),
        f"| source float32-vs-float64 noise floor | {_fmt(ver.get('noise_floor'))} |",
        f"| probe perplexity, source | {_fmt(ver.get('probe_perplexity_source'), '.4f')} |",
        f"| probe perplexity, converted | {_fmt(ver.get('probe_perplexity_converted'), '.4f')} |",
        f"| threshold / passed | {_fmt(ver.get('threshold'))} / {ver.get('passed')} |",
        "",
    ]


FINETUNE_SETTINGS = (
    "data",
    "steps",
    "lr",
    "warmup_steps",
    "schedule",
    "seq_len",
    "batch_size",
    "trainable",
    "distill_from",
    "seed",
)


def finetune_section(ft: dict) -> list[str]:
    if not ft:
        return []
    lines = ["## Fine-tune", "", "| setting | value |", "|---|---|"]
    lines += [f"| {k} | {ft[k]} |" for k in FINETUNE_SETTINGS if k in ft]
    for k, v in (ft.get("final_metrics") or {}).items():
        lines.append(f"| {k} | {_fmt(v, '.4f') if isinstance(v, float) else v} |")
    return lines + [""]


def slice_section(info: dict) -> list[str]:
    """What `normswap slice` did: width, basis, head, parameters, its check, and the energy each norm's
    input kept (the dropped energy is the rest)."""
    if not info:
        return []
    ver = info.get("verification") or {}
    lines = [
        "## Sliced (normswap slice)",
        "",
        f"The residual stream was rotated onto its **{info.get('basis')}** basis and cut from "
        f"**{info.get('hidden_size')}** to **{info.get('width')}** dimensions (fraction {_fmt(info.get('fraction'))}), "
        f"calibrated on {info.get('calibration_tokens', 0):,} tokens of the training split of `{info.get('data')}`. "
        "The all-ones direction, which an exact conversion's centred stream never uses, is the first one deleted: "
        "the sliced model centres nothing at run time.",
        "",
        "| what | value |",
        "|---|---|",
        f"| parameters | {info.get('parameters_before', 0):,} -> {info.get('parameters_after', 0):,} |",
        f"| stream energy kept (all norms' inputs) | {_fmt(info.get('kept_energy_total'), '.6f')} |",
        f"| output head | {info.get('head', 'n/a')} |",
        f"| rotation alone (width d − 1) vs the conversion, max abs Δ log-prob | {_fmt(ver.get('max_abs_diff'))} "
        f"(threshold {_fmt(ver.get('threshold'))}) |",
        "",
    ]
    energy = info.get("kept_energy") or {}
    if energy:
        lines += ["| norm | energy kept | dropped |", "|---|---|---|"]
        lines += [f"| `{name}` | {kept:.6f} | {1 - kept:.2e} |" for name, kept in energy.items()]
        lines.append("")
    lines += [f"Every figure, per norm: `{info.get('figures', 'slice.json')}`.", ""]
    return lines


def load_section(config: dict) -> list[str]:
    """How to load it: the Auto class its ``auto_map`` names first (else the causal LM one)."""
    auto = next((k for k in (config.get("auto_map") or {}) if k != "AutoConfig"), "AutoModelForCausalLM")
    return [
        "## Load",
        "",
        "```python",
        f"from transformers import {auto}, AutoTokenizer",
        f"model = {auto}.from_pretrained('PATH', trust_remote_code=True)",
        "tokenizer = AutoTokenizer.from_pretrained('PATH')  # the source's tokenizer, no remote code",
        "# or: import normswap; model = normswap.load_model('PATH')",
        "```",
        "",
        "The bundled `modeling_normswap.py` uses normswap's fused RMSNorm kernels when normswap is installed "
        "and a plain PyTorch RMSNorm otherwise. The weights are stored as the transformers variant "
        "`normswap` (`model.normswap.safetensors`) so that loading without `trust_remote_code`, which would "
        "build the stock LayerNorm model, fails instead of computing something else. "
        "Details: `normswap_manifest.json`.",
        "",
    ]


def write_model_card(directory, manifest: dict, config: dict) -> Path:
    path = Path(directory) / "README.md"
    path.write_text(render_model_card(manifest, config))
    return path
