"""The matrix's rows: a tiny randomised original of each architecture, saved the way users get
models (weights, a real tokenizer or processor, sentence-transformers files), and its conversion.

Rows are every curated family (its first test config), every architecture the committed survey
converts exactly through discovery (its shrunk default config), and every architecture it converts
exactly on its pooled outputs (``--exact-outputs pooled``: the raw stream it returns moves by its
per-token mean, which the matrix then leaves out of its comparisons; data/raw_stream_outputs.json).
Text rows get a BPE tokenizer trained on the embedded corpus with exactly the model's vocabulary
size; image and audio rows get their model type's own processor sized to the tiny config.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# sentence-transformers' own layout: a Transformer module in the root, mean pooling in 1_Pooling/
ST_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
]


@dataclass(frozen=True)
class Row:
    name: str  # family name, or the model_type of a discovered architecture
    model_type: str
    class_name: str  # the class converted (the family's causal/masked LM or the survey's class)
    curated: bool
    exact: bool  # the conversion is exact (pre-LN); approximate rows are compared, not required to match
    # converted with --exact-outputs pooled: these outputs (the raw stream) move by design and are not compared
    moved_outputs: tuple[str, ...] = ()

    @property
    def pooled(self) -> bool:
        return bool(self.moved_outputs)

    def as_dict(self) -> dict:
        out = {
            "name": self.name,
            "model_type": self.model_type,
            "class": self.class_name,
            "curated": self.curated,
            "exact": self.exact,
        }
        if self.pooled:
            out["moved_outputs"] = list(self.moved_outputs)
        return out


def all_rows() -> list[Row]:
    """Every curated family, then every architecture the survey converts exactly through discovery."""
    from normswap.architectures import all_families
    from normswap.architectures.survey import shipped_rows

    rows = []
    for fam in all_families():
        if not fam.test_configs:
            continue
        config = _curated_config(fam)
        rows.append(
            Row(fam.name, fam.model_types[0], _curated_class(config).__name__, True, fam.placement_for(config) == "pre")
        )
    for r in shipped_rows():
        if r.get("curated") or r.get("status") != "exact":
            continue
        rows.append(Row(r["model_type"], r["model_type"], _discovered_class(r), False, True))
    for r in pooled_rows():
        rows.append(Row(r["model_type"], r["model_type"], r["class"], False, True, tuple(r["changed_outputs"])))
    return rows


def pooled_rows() -> list[dict]:
    """The committed raw-stream survey's rows that convert exactly on their pooled outputs
    (docs/raw-stream-outputs.sh writes data/raw_stream_outputs.json)."""
    from importlib import resources

    path = resources.files("normswap.architectures").joinpath("data", "raw_stream_outputs.json")
    return [r for r in json.loads(path.read_text()) if r.get("status") == "exact-on-pooled"]


def _discovered_class(survey_row) -> str:
    """The encoder-decoder class users load (Whisper's speech-to-text model) where the model type has
    one, else the class the survey converted (its decoder-only or bare model)."""
    from normswap.checkpoint.write import registered_classes

    classes = registered_classes(survey_row["model_type"])
    for auto in ("AutoModelForSpeechSeq2Seq", "AutoModelForSeq2SeqLM"):
        if auto in classes:
            return classes[auto].__name__
    return survey_row["class"]


def _curated_config(fam):
    from transformers import AutoConfig

    return AutoConfig.for_model(fam.model_types[0], **fam.test_configs[0])


def _curated_class(config):
    """The class a user converts: the masked LM of an encoder family, else the causal LM, else the bare model."""
    from normswap.checkpoint.write import registered_classes

    classes = registered_classes(config.model_type)
    for auto in ("AutoModelForMaskedLM", "AutoModelForCausalLM", "AutoModel"):
        if auto in classes:
            return classes[auto]
    raise ValueError(f"{config.model_type}: no model class")


def row_config(row: Row):
    from transformers import AutoConfig

    from normswap.architectures import get_family
    from normswap.architectures.tiny import shrink_config

    if row.curated:
        return _curated_config(get_family(row.name))
    return shrink_config(AutoConfig.for_model(row.model_type))


def build_original(row: Row, directory: Path, *, seed: int = 0):
    """Save a tiny randomised float32 ``row`` model with its tokenizer/processor and
    sentence-transformers files into ``directory``; return the model."""
    import transformers

    from normswap.architectures.probes import forward_parameters
    from normswap.architectures.tiny import tiny_instance
    from normswap.model_facts import input_embeddings

    config = row_config(row)
    model = tiny_instance(config, getattr(transformers, row.class_name), seed=seed, shrink=False, dtype=torch.float32)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    params = forward_parameters(model)
    vocab = getattr(getattr(config, "text_config", None) or config, "vocab_size", None)
    if (
        "input_ids" in params
        and isinstance(vocab, int)
        and vocab >= 64
        and getattr(model, "main_input_name", "input_ids") == "input_ids"
    ):
        corpus_tokenizer(vocab).save_pretrained(directory)
        table = input_embeddings(model)  # None for a model of two towers (CLIPModel): no sentence-transformers
        if table is not None:
            write_sentence_transformers_files(directory, table.weight.shape[1])
    processor = _processor(config, model)
    if processor is not None:
        processor.save_pretrained(directory)
    return model


@functools.lru_cache(maxsize=8)
def corpus_tokenizer(vocab_size: int):
    """A BPE tokenizer trained on the embedded corpus' training split, ids 0..vocab_size-1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from normswap.data import load_documents

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    docs = [d for _, d in zip(range(200), load_documents("embedded", "train"))]
    tok.train_from_iterator(
        docs, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False)
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        bos_token="[CLS]",
        eos_token="[SEP]",
        model_max_length=64,
    )


def write_sentence_transformers_files(directory: Path, width: int) -> None:
    """modules.json, 1_Pooling/config.json and the two ST configs: mean pooling over the model."""
    directory = Path(directory)
    (directory / "modules.json").write_text(json.dumps(ST_MODULES, indent=2))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32, "do_lower_case": False}))
    (directory / "config_sentence_transformers.json").write_text(json.dumps({"similarity_fn_name": "cosine"}))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": int(width), "pooling_mode_mean_tokens": True})
    )


def _processor(config, model):
    """The model type's own image processor or feature extractor, sized to the tiny config (or None)."""
    import transformers
    from transformers.models.auto.feature_extraction_auto import FEATURE_EXTRACTOR_MAPPING_NAMES
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    main = getattr(model, "main_input_name", "input_ids")
    model_type = config.model_type
    if main == "pixel_values" and model_type in IMAGE_PROCESSOR_MAPPING_NAMES:
        names = IMAGE_PROCESSOR_MAPPING_NAMES[model_type]
        names = list(names.values()) if isinstance(names, dict) else names  # {backend: class name}
        names = [n for n in (names if isinstance(names, (tuple, list)) else (names,)) if isinstance(n, str)]
        size = getattr(getattr(config, "vision_config", None) or config, "image_size", 32)
        size = size[0] if isinstance(size, (list, tuple)) else size
        for name in names:
            cls = getattr(transformers, name, None)
            if cls is None:
                continue
            try:
                return cls(size={"height": size, "width": size}, crop_size={"height": size, "width": size})
            except Exception:
                continue
    if main == "input_features" and model_type in FEATURE_EXTRACTOR_MAPPING_NAMES:
        cls = getattr(transformers, FEATURE_EXTRACTOR_MAPPING_NAMES[model_type], None)
        mels = getattr(config, "num_mel_bins", 80)
        frames = 2 * getattr(config, "max_source_positions", 1500)
        try:  # one chunk of exactly the frames the tiny encoder takes (hop 160)
            return cls(feature_size=mels, sampling_rate=frames * 160, chunk_length=1, hop_length=160)
        except Exception:
            return None
    return None


def convert(original_dir: Path, out_dir: Path, *, verify: bool = True, pooled: bool = False) -> dict:
    """`normswap convert` (auto mode: exact where the architecture allows), verification included
    unless ``verify`` is off (the matrix's approximate rows: measuring how far an approximate
    conversion is from its original is `normswap eval`'s job, and costs minutes); ``pooled``:
    ``--exact-outputs pooled``."""
    from normswap.convert.pipeline import convert_checkpoint

    extra = {"exact_outputs": "pooled"} if pooled else {}
    return convert_checkpoint(str(original_dir), str(out_dir), verify=verify, **extra)
