"""The files besides config and weights that travel with a model (tokenizer, vocabulary,
generation config, chat template, image/audio processor, sentence-transformers modules), and the
rule for carrying them into OUT.

Rule: a side file is carried only when it is a regular file inside the model directory. A
symlink that stays inside is followed (one vocabulary shared by two names is common); a
symlink that leaves the directory is **refused, with its name**, when the model is opened (every
command resolves its models first, so before any work) and again when it is copied. Refused
rather than skipped with a warning because a skipped tokenizer file gives an OUT that silently
tokenises differently or not at all, and because OUT is what users publish: a link such as
``vocab.txt -> ~/.ssh/id_rsa`` must stop the command, not scroll past in a warning. A file that
exists but is not a regular file (a FIFO, a device, a directory) is refused as well: reading
it could block forever or copy something that is not a file.

The same rule covers the files normswap reads itself from a model directory, ``config.json`` and
``normswap_manifest.json`` (:data:`OWN_FILES`): they are read through :func:`open_inside` (the
file opened without following a final link and checked once open, by what it is and where it
really lies) and written into OUT from the loaded object, never copied by path: a
``normswap_manifest.json -> ~/.docker/config.json`` would otherwise be published with OUT, and a
``config.json`` swapped for a link after the weights were read would carry whatever it points to.

The one exception is the hub's own cache layout: a snapshot directory
(``models--org--name/snapshots/<rev>/``) holds symlinks into the same repository folder's
``blobs/``; that repository folder counts as the model directory.

Weight files (:data:`WEIGHT_PATTERNS`) follow the same link rule: a ``model.safetensors`` linked to
another user's private checkpoint would otherwise be read with the reader's rights and published,
converted, as the shared model. Only their size is exempt from the caps below (the weights are what
every other bound is measured against).

Every side file has a size cap, checked on the file's size before any library reads it and again
while convert copies it (a sparse 8 GB ``tokenizer.json`` was copied whole and read whole): a file
holding a vocabulary (:func:`size_cap`) at most :data:`MAX_VOCABULARY_FILE_BYTES`, any other
(configs, templates) at most :data:`MAX_OWN_FILE_BYTES`, a file in a sentence-transformers module
folder (which may hold a head's weights) at most :data:`MAX_MODULE_FILE_BYTES`.

A PEFT adapter (``adapter_config.json``) is refused (:func:`refuse_adapter`): transformers, with PEFT
installed, builds the adapter that file describes before it reads any adapter weight, so a LoRA of
rank 2e7 in 170 bytes asks for 10 GB. normswap has no option to load adapters; merging one into its
base model gives a plain model directory.
"""

from __future__ import annotations

import fnmatch
import os
import stat
from pathlib import Path

from normswap.errors import NormswapError

OWN_FILES = ("config.json", "normswap_manifest.json")  # read by normswap itself, never copied by path
# read by transformers' model loader when present (a PEFT adapter): checked by the rule, never carried
# (an adapter belongs to the weights it was trained on, not to a conversion of them)
ADAPTER_CONFIG = "adapter_config.json"
CHECKED_FILES = (ADAPTER_CONFIG, "adapter_model.safetensors", "adapter_model.bin")
# the names transformers and safetensors read weights from (and their indices), in every format it
# knows: the link rule holds for each (no size cap: weights are what the other bounds are measured by)
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json", "*.h5", "*.msgpack")

# Every name transformers' own loaders open in a model directory (tokenizers, processors, chat
# templates, generation config), from the installed transformers: its file-name constants and every
# tokenizer class's ``vocab_files_names``. tests/test_side_files.py derives the same set from the
# installed transformers and fails when a name appears that this list (or SIDE_PATTERNS) misses.
SIDE_FILES = (
    # tokenization_utils_base: the files every tokenizer looks for
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    # tokenizer classes' vocabularies (vocab_files_names)
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "spm.model",
    "spm_char.model",
    "sentencepiece.model",
    "sentencepiece.bpe.model",
    "source.spm",
    "target.spm",
    "bpe.codes",
    "dict.txt",
    "emoji.json",
    "entity_vocab.json",
    "normalizer.json",
    "prophetnet.tokenizer",
    "target_vocab.json",
    "vocab-src.json",
    "vocab-tgt.json",
    "word_pronunciation.json",
    "word_shape.json",
    "byte_maps.json",
    "qwen.tiktoken",
    "tekken.json",
    "tiktoken.model",
    "generation_config.json",
    # processors, so that pipeline() and AutoProcessor find them beside the weights
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "audio_tokenizer_config.json",
    # sentence-transformers: what SentenceTransformer(OUT) loads; its module folders: st_module_dirs
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
)
# names transformers finds by pattern rather than by name: versioned tokenizer files
# (``fast_tokenizer_files``), any SentencePiece model (find_sentencepiece_model_file), tiktoken files
SIDE_PATTERNS = ("tokenizer.*.json", "*.model", "*.tiktoken", "*.spm")
# folders transformers lists and reads every entry of: the extra chat templates (``*.jinja``)
SIDE_DIRS = ("additional_chat_templates",)
SIDE_DIR_SUFFIX = ".jinja"  # what transformers reads from them (it globs ``*.jinja``)
# sub-tokenizers a processor loads from a folder named after them (``decoder_tokenizer/``):
# a top-level folder holding one of these is read by the same name rules
_SUBFOLDER_MARKERS = ("tokenizer_config.json", "processor_config.json", "preprocessor_config.json")


def is_side_name(name: str) -> bool:
    """Whether transformers may open the top-level file ``name`` of a model directory on its own."""
    return name in SIDE_FILES + OWN_FILES + CHECKED_FILES or any(
        fnmatch.fnmatchcase(name, pat) for pat in SIDE_PATTERNS
    )


def st_module_dirs(directory: Path) -> list[str]:
    """The folders sentence-transformers' ``modules.json`` names (``1_Pooling``, ``2_Normalize``, ...):
    relative paths only (the root module, path "", is the model itself). ``modules.json`` is read by
    the rule (:func:`read_json_inside`: a regular file inside the directory, of bounded size), so a
    link to ``/dev/zero`` or a FIFO in its place is refused in one line instead of read."""
    modules = read_json_inside(directory, "modules.json")
    out = []
    for module in modules if isinstance(modules, list) else []:
        path = str(module.get("path", "")) if isinstance(module, dict) else ""
        if path and not Path(path).is_absolute() and ".." not in Path(path).parts:
            out.append(path)
    return out


def _listed(directory: Path, folder: str = "") -> list[str]:
    """Names (relative to ``directory``) of the entries of ``folder`` transformers reads by pattern or
    by listing: every entry of a :data:`SIDE_DIRS` folder, top-level names matching SIDE_PATTERNS."""
    base = directory / folder if folder else directory
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return []
    prefix = f"{folder}/" if folder else ""
    return [prefix + n for n in entries if is_side_name(n) and n not in SIDE_FILES + OWN_FILES + CHECKED_FILES]


def _fast_tokenizer_files(directory: Path) -> list[str]:
    """The versioned tokenizer files ``tokenizer_config.json`` names (``fast_tokenizer_files``), which
    transformers opens by the name written there: a name that is not a plain file name is refused."""
    config = read_json_inside(directory, "tokenizer_config.json")
    names = config.get("fast_tokenizer_files") if isinstance(config, dict) else None
    out = []
    for name in names if isinstance(names, list) else []:
        if not isinstance(name, str) or os.sep in name or "/" in name or name in ("", ".", ".."):
            raise NormswapError(
                f"{Path(directory) / 'tokenizer_config.json'} names the tokenizer file {str(name)[:100]!r} in "
                "fast_tokenizer_files; only a file name in the model directory is accepted"
            )
        out.append(name)
    return out


def _candidates(directory: Path) -> list[str]:
    """Every name transformers or sentence-transformers may open in ``directory``: SIDE_FILES, the
    names matching SIDE_PATTERNS, every entry of the SIDE_DIRS folders, the versioned tokenizer files
    tokenizer_config.json names, the same names in a sub-tokenizer's folder, and every file (or link)
    inside the sentence-transformers module folders."""
    names = list(SIDE_FILES) + _listed(directory) + _fast_tokenizer_files(directory)
    root = model_root(directory).resolve()
    for folder in SIDE_DIRS:
        base = directory / folder
        if base.is_symlink() and not base.resolve().is_relative_to(root):
            names.append(folder)  # checked below like a file: the link out is refused by name
        elif base.is_dir():
            names += [f"{folder}/{n}" for n in sorted(os.listdir(base)) if n.endswith(SIDE_DIR_SUFFIX)]
    for sub in _subfolders(directory):
        names += [f"{sub}/{n}" for n in SIDE_FILES] + _listed(directory, sub)
    for folder in st_module_dirs(directory):
        base = directory / folder
        if base.is_symlink() or not base.is_dir():
            names.append(folder)
            continue
        for p in sorted(base.rglob("*")):
            if p.is_symlink() or not p.is_dir():
                names.append(str(p.relative_to(directory)))
    return list(dict.fromkeys(names))


def _subfolders(directory: Path) -> list[str]:
    """Top-level folders holding a tokenizer or processor config (a processor's sub-tokenizer)."""
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError:
        return []
    return [
        e.name
        for e in entries
        if e.is_dir(follow_symlinks=False)
        and e.name not in SIDE_DIRS
        and any(os.path.lexists(os.path.join(e.path, m)) for m in _SUBFOLDER_MARKERS)
    ]


def model_root(directory: Path) -> Path:
    """What "inside the model directory" means for ``directory``: itself, or for a hub-cache
    snapshot the repository folder whose ``blobs/`` its links point into."""
    directory = Path(directory)
    if directory.parent.name == "snapshots" and directory.parent.parent.name.startswith(("models--", "datasets--")):
        return directory.parent.parent
    return directory


MAX_OWN_FILE_BYTES = 64 << 20  # a config, manifest or template holds settings: kilobytes
# A vocabulary file holds a few short strings per id: 1 KiB for each of 262,144 ids (the largest
# vocabularies in use) is 256 MiB.
MAX_VOCABULARY_FILE_BYTES = 256 << 20
# A sentence-transformers module folder may hold a head's weights (a Dense layer: width x width floats,
# tens of MB for the widest models); 1 GiB is a 16,384-wide square in float32.
MAX_MODULE_FILE_BYTES = 1 << 30
# the names that hold a vocabulary (the tokenizer classes' vocab_files_names, tokenizer.json and the
# names found by pattern); every other side file is a config or template
_VOCABULARY_NAMES = (
    "tokenizer.json",
    "tokenizer.*.json",
    "vocab*",
    "*vocab.json",
    "merges.txt",
    "*.model",
    "*.spm",
    "*.tiktoken",
    "bpe.codes",
    "dict.txt",
    "emoji.json",
    "normalizer.json",
    "prophetnet.tokenizer",
    "word_pronunciation.json",
    "word_shape.json",
    "byte_maps.json",
    "tekken.json",
    "added_tokens.json",
)


def size_cap(name: str) -> int:
    """The most bytes the side file ``name`` (relative to the model directory) may hold (module doc)."""
    base = Path(name).name
    if any(fnmatch.fnmatchcase(base, pat) for pat in _VOCABULARY_NAMES):
        return MAX_VOCABULARY_FILE_BYTES
    if "/" in name and Path(name).parts[0] not in SIDE_DIRS and base not in SIDE_FILES:
        return MAX_MODULE_FILE_BYTES  # a file in a sentence-transformers module folder
    return MAX_OWN_FILE_BYTES


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f} MiB" if n >= 1 << 20 else f"{n:,} bytes"


def _too_large(path: Path, name: str, size: int, cap: int) -> NormswapError:
    return NormswapError(
        f"{path} holds {_mib(size)}; a model's {name} is at most {_mib(cap)} (normswap reads and copies no "
        "larger one, and neither does a library it calls)"
    )


def refuse_adapter(directory) -> None:
    """Refuse, in one line, a model directory holding a PEFT adapter (module doc)."""
    directory = Path(directory)
    if os.path.lexists(directory / ADAPTER_CONFIG):
        raise NormswapError(
            f"{directory} holds a PEFT adapter ({ADAPTER_CONFIG}); normswap loads no adapter (transformers would "
            "build the layers it describes before reading any weight): merge it into its base model first "
            "(peft: PeftModel.from_pretrained(base, DIR).merge_and_unload().save_pretrained(MERGED)) and give "
            "normswap the merged directory"
        )


def _inside(directory: Path, root: Path, name: str, cap: int | None = None) -> Path | None:
    """The real file ``directory/name`` is, checked by the rule (module doc); None when absent.
    ``cap``: the most bytes it may hold (None: no cap, for weights)."""
    p = directory / name
    if not (p.is_symlink() or p.exists()):
        return None
    real = p.resolve()
    if not real.is_relative_to(root):
        raise NormswapError(
            f"{p} is a symbolic link to {real}, outside the model directory {directory}: normswap reads and "
            "carries no file from elsewhere with a model; copy the file into the model directory instead of "
            "linking it (or remove the link); nothing was written"
        )
    if not real.exists():
        return None  # a dangling link inside the directory: nothing to read or carry
    st = os.stat(real)
    if not stat.S_ISREG(st.st_mode):
        from normswap.bounded_load import file_kind

        kind = file_kind(st.st_mode)
        raise NormswapError(f"{p} is {kind}, not a regular file; a model's {name} must be a plain file")
    if cap is not None and st.st_size > cap:
        raise _too_large(p, name, st.st_size, cap)
    return real


def check_weight_links(directory) -> None:
    """Every top-level weight file of ``directory`` (:data:`WEIGHT_PATTERNS`) by the link rule: a link
    that leaves the model directory (for a hub snapshot: its repository folder) is refused by name."""
    directory = Path(directory)
    root = model_root(directory).resolve()
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return
    for name in names:
        if any(fnmatch.fnmatchcase(name, pat) for pat in WEIGHT_PATTERNS):
            _inside(directory, root, name)


def side_files(directory) -> list[tuple[str, Path]]:
    """(name, the file it is) for every side file present in ``directory``; refuses, in one line
    naming it, one that leaves the directory through a symlink or is not a regular file. The
    model's own files (:data:`OWN_FILES`) are checked by the same rule, so a command that resolves
    its model refuses a linked config or manifest before any work."""
    directory = Path(directory)
    refuse_adapter(directory)
    root = model_root(directory).resolve()
    for name in OWN_FILES + CHECKED_FILES:
        _inside(directory, root, name, MAX_OWN_FILE_BYTES if name in OWN_FILES else None)
    check_weight_links(directory)
    found = []
    for name in _candidates(directory):
        real = _inside(directory, root, name, size_cap(name))
        if real is not None:
            found.append((name, real))
    return found


def open_inside(directory, name: str, cap: int | None = None):
    """``directory/name`` opened for reading (a binary file object) when it is a regular file inside
    the model directory, of at most ``cap`` bytes (default: :func:`size_cap`), None when it is absent;
    refused in one line otherwise. The file is checked again once open (a regular file, really
    inside, within the cap), so a link swapped in after the check is not followed either."""
    directory = Path(directory)
    root = model_root(directory).resolve()
    cap = size_cap(name) if cap is None else cap
    real = _inside(directory, root, name, cap)
    if real is None:
        return None
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(real, flags)  # O_NONBLOCK: a FIFO swapped in is refused below instead of blocking here
    except OSError as e:
        raise NormswapError(
            f"cannot read {directory / name}: {e.strerror}; it changed while it was being read"
        ) from None
    f = os.fdopen(fd, "rb")
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NormswapError(f"{directory / name} is not a regular file; a model's {name} must be a plain file")
        opened = Path(os.path.realpath(f"/proc/self/fd/{fd}")) if os.path.isdir("/proc/self/fd") else real
        if not opened.is_relative_to(root):
            raise NormswapError(
                f"{directory / name} changed while it was being read (it now lies at {opened}, outside the model "
                f"directory {directory}); nothing was read from it"
            )
        size = os.fstat(fd).st_size
        if size > cap:
            raise _too_large(directory / name, name, size, cap)
        os.set_blocking(fd, True)
    except BaseException:
        f.close()
        raise
    return f


def read_json_inside(directory, name: str):
    """The JSON value of ``directory/name`` read by the rule (:func:`open_inside`), or None when the
    file is absent or is not JSON; refused in one line when it is linked from outside, not a regular
    file, or larger than :data:`MAX_OWN_FILE_BYTES`."""
    import json

    f = open_inside(directory, name)
    if f is None:
        return None
    with f:
        data = f.read(MAX_OWN_FILE_BYTES + 1)
    if len(data) > MAX_OWN_FILE_BYTES:
        raise NormswapError(
            f"{Path(directory) / name} is larger than {MAX_OWN_FILE_BYTES >> 20} MiB; a model's {name} is not"
        )
    try:
        return json.loads(data)
    except ValueError:
        return None


def copy_side_files(src_dir, directory: Path) -> None:
    """Copy the side files of ``src_dir`` (checked by :func:`side_files`) into ``directory``,
    keeping any already there. Each is opened without following a link and checked again once
    open, so a link swapped in after the check is not followed either."""
    if not src_dir or not Path(src_dir).is_dir():
        return
    for folder in st_module_dirs(src_dir):  # a module with no files (Normalize) still needs its folder
        if (Path(src_dir) / folder).is_dir() and not (Path(src_dir) / folder).is_symlink():
            (Path(directory) / folder).mkdir(parents=True, exist_ok=True)
    for name, _ in side_files(src_dir):
        dest = Path(directory) / name
        if dest.exists():
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        f = open_inside(src_dir, name)
        if f is None:
            continue  # gone since it was listed
        with f, open(dest, "xb") as g:
            _copy_bounded(f, g, src_dir, name)
            st = os.fstat(f.fileno())  # the times and mode of the file that was read, not of a path again
            os.utime(g.fileno(), ns=(st.st_atime_ns, st.st_mtime_ns))
            os.fchmod(g.fileno(), stat.S_IMODE(st.st_mode))


def _copy_bounded(f, g, src_dir, name: str) -> None:
    """Copy ``f`` to ``g``, at most :func:`size_cap` bytes: a file that grew after it was checked is
    refused instead of copied whole."""
    cap, copied = size_cap(name), 0
    while chunk := f.read(min(1 << 20, cap + 1 - copied)):
        copied += len(chunk)
        if copied > cap:
            raise _too_large(Path(src_dir) / name, name, copied, cap)
        g.write(chunk)
