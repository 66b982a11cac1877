"""One entry point per check, run on the original and on its conversion side by side.

A check takes the two directories and the row and returns a ``Cell``. It first runs the entry point
on the original: if that fails, the cell is "n/a" (the original cannot do it either, with its
reason). Then the converted model: a failure is "✗" with the reason, outputs further apart than
``TOLERANCE`` (relative: max |Δ| / max |original|, fp32) are "✗" with the number, anything
else is "✓". Task heads the checkpoint does not hold are newly initialised on both sides; the
converted side gets the original's fresh values, so the comparison sees the backbone alone.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from normswap.compile_cache import compiled
from normswap.errors import first_line

TOLERANCE = 1e-5
TEXT = "In the beginning God created the heaven and the earth."
TEXTS = [TEXT, "And the earth was without form, and void."]


@dataclass
class Cell:
    status: str  # "ok" | "fail" | "n/a"
    detail: str = ""
    max_rel_diff: float | None = None
    parts: dict = field(default_factory=dict)  # per class / task: relative difference or failure

    def as_dict(self) -> dict:
        return {"status": self.status, "detail": self.detail, "max_rel_diff": self.max_rel_diff, "parts": self.parts}


class NotApplicable(Exception):
    """The original cannot do this (no such class or task, or it fails): the cell is "n/a"."""


def rel_diff(a, b) -> float:
    """max |a - b| / max |a| over matching floating tensors (nested dicts/lists/tuples)."""
    pairs = list(_tensor_pairs(a, b))
    if not pairs:
        raise ValueError("no floating-point outputs to compare")
    worst = 0.0
    for x, y in pairs:
        x, y = x.detach().double(), y.detach().double()
        if x.shape != y.shape:
            return float("inf")
        scale = x.abs().max().item() or 1.0
        worst = max(worst, (x - y).abs().max().item() / scale)
    return worst


def _tensor_pairs(a, b):
    if isinstance(a, torch.Tensor):
        if a.is_floating_point():
            yield a, b
    elif isinstance(a, dict):
        for k in a:
            if k in b:
                yield from _tensor_pairs(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        for x, y in zip(a, b):
            yield from _tensor_pairs(x, y)
    elif isinstance(a, float):
        yield torch.tensor([a]), torch.tensor([b])


def describe(e: BaseException) -> str:
    """An exception in a cell: its type and the first line of its message."""
    return f"{type(e).__name__}: {first_line(e, 160)}"


@contextlib.contextmanager
def quiet():
    """transformers' load reports and progress bars go to a buffer, not the matrix's output."""
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        transformers.logging.set_verbosity(level)


def side_by_side(run, original, converted, row, *, exact=True) -> Cell:
    """``run(directory, remote, partner)`` on both; ``partner`` is what the original's run returned
    (None for the original itself). Returns the cell."""
    try:
        with quiet():
            ref = run(original, False, None)
    except NotApplicable as e:
        return Cell("n/a", str(e))
    except Exception as e:
        return Cell("n/a", f"the original fails: {describe(e)}")
    try:
        with quiet():
            got = run(converted, True, ref)
    except Exception as e:
        return Cell("fail", describe(e))
    # a pooled-exact row's raw stream moves by design (--exact-outputs pooled): compared, it would fail every cell
    ref["outputs"], got["outputs"] = (_without(o, row.moved_outputs) for o in (ref["outputs"], got["outputs"]))
    if not ref["outputs"]:
        moved = ", ".join(row.moved_outputs)
        return Cell("n/a", f"every output it compares is one the pooled conversion moves ({moved})")
    parts = {}
    for key in ref["outputs"]:
        if key not in got["outputs"]:
            parts[key] = "missing on the converted model"
            continue
        parts[key] = rel_diff(ref["outputs"][key], got["outputs"][key])
    for key, why in got.get("errors", {}).items():
        parts[key] = why
    numbers = [v for v in parts.values() if isinstance(v, float)]
    worst = max(numbers) if numbers else None
    failed = {k: v for k, v in parts.items() if not isinstance(v, float) or (exact and v > TOLERANCE)}
    for key, same in got.get("equal", {}).items():
        if not same:
            failed[key] = "differs"
    if failed:
        key, why = next(iter(failed.items()))
        why = f"relative difference {why:.2g}" if isinstance(why, float) else why
        return Cell("fail", f"{key}: {why}", worst, parts)
    detail = ", ".join(sorted(ref["outputs"]))
    return Cell("ok", detail, worst, parts)


def _without(outputs, moved):
    """``outputs`` (nested dicts of outputs by name) without the entries named in ``moved``."""
    if not moved or not isinstance(outputs, dict):
        return outputs
    kept = {k: _without(v, moved) for k, v in outputs.items() if k not in moved}
    return {k: v for k, v in kept.items() if not (isinstance(v, dict) and not v)}


# -- loading one class on both sides ---------------------------------------------------------


def load(auto_name: str, directory, remote: bool, partner_model=None):
    """``auto_name``.from_pretrained; on the converted side the weights the checkpoint lacks (a new
    head) are copied from the original's fresh ones, after checking that exactly the same keys
    were newly initialised on both sides."""
    import transformers

    auto = getattr(transformers, auto_name)
    model, info = auto.from_pretrained(
        str(directory), trust_remote_code=remote, output_loading_info=True, dtype=torch.float32
    )
    model.eval()
    missing = set(info.get("missing_keys") or [])
    state = model.state_dict()
    # the fresh values as loaded: a check may train the original in place before the converted side loads
    model.normswap_fresh = {k: state[k].detach().clone() for k in missing if k in state}
    if partner_model is not None:
        mine, theirs = set(model.normswap_fresh), set(partner_model.normswap_fresh)
        if mine != theirs:
            raise RuntimeError(f"newly initialised weights differ from the original's: {sorted(mine ^ theirs)[:3]}")
        with torch.no_grad():
            model.load_state_dict(partner_model.normswap_fresh, strict=False)
        model.normswap_fresh = {k: v.clone() for k, v in partner_model.normswap_fresh.items()}
    return model


def classes_of(directory) -> dict:
    import json

    from normswap.checkpoint.write import registered_classes

    model_type = json.loads((Path(directory) / "config.json").read_text())["model_type"]
    return registered_classes(model_type)


def _inputs(model, batch=1):
    from normswap.architectures.probes import probe_inputs

    return probe_inputs(model, batch=batch, seq_len=12, seed=0, dtype=torch.float32)


def _forward(model, inputs):
    from normswap.architectures.probes import model_outputs

    return model_outputs(model, inputs)


def main_class(directory, row) -> str:
    """The Auto name of the class that was converted."""
    import transformers

    for auto, cls in classes_of(directory).items():
        if cls is getattr(transformers, row.class_name, None):
            return auto
    raise NotApplicable(f"{row.class_name} is registered with no Auto class")


# -- the checks ---------------------------------------------------------------------------------


def check_auto_classes(original, converted, row) -> Cell:
    """Every Auto class transformers registers for the model type: loads from the converted
    checkpoint (trust_remote_code) and gives the original's outputs, bare model included."""

    def run(directory, remote, partner):
        outputs, errors, models = {}, {}, {}
        for auto in classes_of(original):
            if partner is not None and auto not in partner["models"]:
                continue
            try:
                model = load(auto, directory, remote, partner["models"][auto] if partner else None)
                outputs[auto] = _forward(model, _inputs(model))
                models[auto] = model
            except Exception as e:
                if partner is None:
                    continue  # the original cannot: not part of the comparison
                errors[auto] = describe(e)
        if partner is None and not outputs:
            raise NotApplicable("no Auto class builds the original")
        return {"outputs": outputs, "errors": errors, "models": models}

    return side_by_side(run, original, converted, row, exact=row.exact)


def check_pipeline(original, converted, row) -> Cell:
    """pipeline() for each task the model type has: text generation, fill-mask, feature extraction,
    image classification, speech recognition."""
    from transformers import pipeline

    tasks = {
        "text-generation": "AutoModelForCausalLM",
        "fill-mask": "AutoModelForMaskedLM",
        "feature-extraction": "AutoModel",
        "image-classification": "AutoModelForImageClassification",
        "automatic-speech-recognition": "AutoModelForSpeechSeq2Seq",
    }

    def run(directory, remote, partner):
        import numpy as np

        classes = classes_of(original)
        outputs, errors, models = {}, {}, {}
        for task, auto in tasks.items():
            if auto not in classes or (partner is not None and task not in partner["outputs"]):
                continue
            try:
                model = load(auto, directory, remote, partner["models"][task] if partner else None)
                pipe = pipeline(
                    task,
                    model=model,
                    tokenizer=_maybe_tokenizer(directory),
                    **_maybe_processor(directory, task),
                    device="cpu",
                )
                if task == "text-generation":
                    out = pipe(TEXT, max_new_tokens=6, do_sample=False, return_tensors=True)
                    result = torch.tensor(out[0]["generated_token_ids"], dtype=torch.float64)
                elif task == "fill-mask":
                    out = pipe(f"In the beginning God {pipe.tokenizer.mask_token} the heaven.", top_k=3)
                    result = {
                        "scores": torch.tensor([o["score"] for o in out]),
                        "tokens": torch.tensor([float(o["token"]) for o in out]),
                    }
                elif task == "feature-extraction":
                    result = torch.tensor(np.array(pipe(TEXT)))
                elif task == "image-classification":
                    image = _image(model)
                    result = torch.tensor([o["score"] for o in pipe(image, top_k=2)])
                else:
                    audio = np.random.default_rng(0).standard_normal(pipe.feature_extractor.n_samples).astype("float32")
                    out = pipe(
                        {"raw": audio, "sampling_rate": pipe.feature_extractor.sampling_rate},
                        generate_kwargs={"max_new_tokens": 4},
                    )
                    result = torch.tensor([float(ord(c)) for c in out["text"]] or [0.0], dtype=torch.float64)
                outputs[task] = result
                models[task] = model
            except Exception as e:
                if partner is None:
                    continue
                errors[task] = describe(e)
        if partner is None and not outputs:
            raise NotApplicable("no pipeline task runs on the original")
        return {"outputs": outputs, "errors": errors, "models": models}

    return side_by_side(run, original, converted, row, exact=row.exact)


def _maybe_tokenizer(directory):
    if not (Path(directory) / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def _maybe_processor(directory, task) -> dict:
    if not (Path(directory) / "preprocessor_config.json").exists():
        return {}
    if task == "image-classification":
        from transformers import AutoImageProcessor

        return {"image_processor": AutoImageProcessor.from_pretrained(str(directory))}
    if task == "automatic-speech-recognition":
        from transformers import AutoFeatureExtractor

        return {"feature_extractor": AutoFeatureExtractor.from_pretrained(str(directory))}
    return {}


def _image(model):
    import numpy as np
    from PIL import Image

    size = getattr(model.config, "image_size", 32)
    size = size[0] if isinstance(size, (list, tuple)) else size
    pixels = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _generation_class(directory, row):
    classes = classes_of(directory)
    for auto in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq"):
        if auto in classes:
            return auto
    raise NotApplicable("no generating class for this model type")


def check_generate(original, converted, row) -> Cell:
    """generate() greedily with the KV cache: the same tokens and step scores as the original,
    and the same tokens as the converted model without the cache."""

    def run(directory, remote, partner):
        auto = _generation_class(original, row)
        model = load(auto, directory, remote, partner["models"]["m"] if partner else None)
        inputs = _inputs(model)
        inputs.pop("decoder_input_ids", None)
        kwargs = dict(
            max_new_tokens=6, min_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True
        )
        with torch.no_grad():
            cached = model.generate(**inputs, use_cache=True, **kwargs)
            plain = model.generate(**inputs, use_cache=False, **kwargs)
        tokens = cached.sequences.double()
        return {
            "outputs": {"tokens": tokens, "scores": list(cached.scores)},
            "models": {"m": model},
            "equal": {"tokens without the cache": torch.equal(cached.sequences, plain.sequences)},
        }

    return side_by_side(run, original, converted, row, exact=row.exact)


def check_compile(original, converted, row) -> Cell:
    """torch.compile of the converted class: its outputs against the original's (eager)."""

    def run(directory, remote, partner):
        auto = main_class(original, row)
        model = load(auto, directory, remote, partner["models"]["m"] if partner else None)
        inputs = _inputs(model)
        if partner is None:
            return {"outputs": {"forward": _forward(model, inputs)}, "models": {"m": model}}
        return {"outputs": {"forward": _forward(compiled(model), inputs)}}

    return side_by_side(run, original, converted, row, exact=row.exact)


def check_round_trip(original, converted, row) -> Cell:
    """save_pretrained -> from_pretrained (trust_remote_code): the reloaded model gives the same outputs."""

    def run(directory, remote, partner):
        auto = main_class(original, row)
        model = load(auto, directory, remote)
        inputs = _inputs(model)
        before = _forward(model, inputs)
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            again = load(auto, tmp, remote)
            after = _forward(again, inputs)
        return {"outputs": {"reloaded": after}, "equal": {"reloaded bit for bit": rel_diff(before, after) == 0.0}}

    return side_by_side(run, original, converted, row, exact=row.exact)


def _training_batch(model, auto):
    """Inputs with labels for the class's own loss (a causal/masked LM, seq2seq, or a classifier)."""
    inputs = _inputs(model, batch=2)
    if auto in ("AutoModelForCausalLM", "AutoModelForMaskedLM"):
        inputs["labels"] = inputs["input_ids"].clone()
    elif auto in ("AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq"):
        inputs["labels"] = inputs.pop("decoder_input_ids", inputs.get("input_ids")).clone()
    else:
        inputs["labels"] = torch.tensor([0, 1])
    return inputs


def _trainable_class(directory):
    classes = classes_of(directory)
    for auto in (
        "AutoModelForCausalLM",
        "AutoModelForMaskedLM",
        "AutoModelForSeq2SeqLM",
        "AutoModelForSpeechSeq2Seq",
        "AutoModelForImageClassification",
        "AutoModelForSequenceClassification",
        "AutoModelForAudioClassification",
    ):
        if auto in classes:
            return auto
    raise NotApplicable("no class with a training loss for this model type")


class _Batches(torch.utils.data.Dataset):
    def __init__(self, batch):
        self.batch = batch

    def __len__(self):
        return next(iter(self.batch.values())).shape[0] * 4

    def __getitem__(self, i):
        n = next(iter(self.batch.values())).shape[0]
        return {k: v[i % n] for k, v in self.batch.items()}


def _without_dropout(model) -> None:
    """Dropout off (modules and the config values some attention code reads at run time): the
    conversion is exact for the deterministic function; a dropped-out centred write is no longer
    centred, so with dropout on the two models are different random functions."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for key, value in list(vars(module).items()):  # functional dropout / layer drop read from attributes
            if isinstance(value, float) and "drop" in key:
                setattr(module, key, 0.0)
    for cfg in (model.config, *(v for v in vars(model.config).values() if hasattr(v, "to_dict"))):
        for key, value in list(vars(cfg).items()):
            if isinstance(value, float) and "drop" in key:
                setattr(cfg, key, 0.0)


def check_trainer(original, converted, row) -> Cell:
    """transformers.Trainer, 3 steps with dropout off: the first step's loss (both start from the
    same function) equals the original's; every loss is finite. Later steps differ by design: the
    converted weights are another parametrisation of the function, so the same gradient step moves
    it differently."""
    from transformers import Trainer, TrainingArguments

    def run(directory, remote, partner):
        auto = _trainable_class(original)
        model = load(auto, directory, remote, partner["models"]["m"] if partner else None)
        _without_dropout(model)
        model.train()
        batch = _training_batch(model, auto)
        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(
                output_dir=tmp,
                max_steps=3,
                per_device_train_batch_size=2,
                learning_rate=1e-3,
                logging_steps=1,
                save_strategy="no",
                report_to=[],
                use_cpu=True,
                seed=0,
                dataloader_num_workers=0,
                disable_tqdm=True,
                remove_unused_columns=False,
            )
            trainer = Trainer(model=model, args=args, train_dataset=_Batches(batch))
            trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        if len(losses) != 3 or not all(torch.isfinite(torch.tensor(losses))):
            raise RuntimeError(f"losses {losses}")
        return {"outputs": {"first-step loss": float(losses[0])}, "models": {"m": model}}

    return side_by_side(run, original, converted, row, exact=row.exact)


def check_peft(original, converted, row) -> Cell:
    """PEFT LoRA on every linear layer: attach (outputs unchanged), 2 training steps, merge (the
    merged model equals the adapter model); the attached model's outputs against the original's."""

    def run(directory, remote, partner):
        from peft import LoraConfig, get_peft_model

        auto = _trainable_class(original)
        model = load(auto, directory, remote, partner["models"]["m"] if partner else None)
        batch = _training_batch(model, auto)
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        torch.manual_seed(0)
        lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
        attached = _forward(lora, inputs)
        optim = torch.optim.SGD([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
        lora.train()
        for _ in range(2):
            loss = lora(**batch).loss
            loss.backward()
            optim.step()
            optim.zero_grad()
        lora.eval()
        adapted = _forward(lora, inputs)
        merged = _forward(lora.merge_and_unload(), inputs)
        return {
            "outputs": {"attached": attached},
            "models": {"m": model},
            "equal": {
                "merged equals adapter model": rel_diff(adapted, merged) <= TOLERANCE,
                "training moved the adapter": rel_diff(attached, adapted) > 0,
            },
        }

    return side_by_side(run, original, converted, row, exact=row.exact)


def check_sentence_transformers(original, converted, row) -> Cell:
    """SentenceTransformer(dir) with the model's modules.json and pooling: the same embeddings."""

    def run(directory, remote, partner):
        if not (Path(original) / "modules.json").exists():
            raise NotApplicable("not a text model (no sentence-transformers files)")
        if not (Path(directory) / "modules.json").exists():
            raise RuntimeError("modules.json was not carried over")
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(str(directory), device="cpu", trust_remote_code=remote)
        return {"outputs": {"embeddings": torch.as_tensor(model.encode(TEXTS, convert_to_numpy=True))}}

    return side_by_side(run, original, converted, row, exact=row.exact)


def check_export_stock(original, converted, row) -> Cell:
    """`normswap export --format stock` (normswap.export), then the export loaded with stock
    transformers and no remote code: the original's outputs."""

    def run(directory, remote, partner):
        auto = main_class(original, row)
        if not remote:
            model = load(auto, directory, False)
            return {"outputs": {"stock class": _forward(model, _inputs(model))}, "models": {"m": model}}
        try:
            from normswap.export import export_checkpoint
        except ImportError:
            raise RuntimeError("normswap.export is not installed") from None
        with tempfile.TemporaryDirectory() as tmp:
            dest = export_checkpoint(directory, Path(tmp) / "stock", "stock")
            model = load(auto, dest, False, partner["models"]["m"])
            return {"outputs": {"stock class": _forward(model, _inputs(model))}}

    return side_by_side(run, original, converted, row, exact=row.exact)


def check_export_onnx(original, converted, row) -> Cell:
    """`normswap export --format onnx` (torch.onnx.export; the export itself checks onnxruntime's outputs against
    PyTorch's before it publishes), then the graph run in onnxruntime on the same token ids: the converted
    graph's outputs against the original graph's. Token models only (the export takes input_ids alone)."""
    import importlib.util

    if importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnxscript") is None:
        return Cell("n/a", "onnxruntime / onnxscript not installed")

    def run(directory, remote, partner):
        from normswap.export import run_export
        from normswap.export.onnx import read_export, run_session, session

        with tempfile.TemporaryDirectory() as tmp:
            record = run_export(directory, Path(tmp) / "onnx", "onnx")
            vocab = int(json.loads((Path(directory) / "config.json").read_text())["vocab_size"])
            ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
            out = run_session(session(read_export(Path(tmp) / "onnx")), ids)
        return {"outputs": {record["outputs"][0]: out}}

    return side_by_side(run, original, converted, row, exact=row.exact)


CHECKS = {
    "auto classes": check_auto_classes,
    "pipeline": check_pipeline,
    "Trainer": check_trainer,
    "PEFT LoRA": check_peft,
    "SentenceTransformer": check_sentence_transformers,
    "generate + KV cache": check_generate,
    "torch.compile": check_compile,
    "save/load round trip": check_round_trip,
    "export stock": check_export_stock,
    "export ONNX": check_export_onnx,
}
