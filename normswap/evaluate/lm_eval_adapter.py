"""Run lm-evaluation-harness tasks on an in-memory model.

The project's own tasks (``normswap/assets/lm_eval_tasks``) are always on the include path, so
``normswap_kjv`` works offline; hub tasks (``wikitext``, ``hellaswag``, ...) work for users
who are online, exactly as with ``lm_eval`` itself.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import warnings
from pathlib import Path

from normswap.errors import NormswapError, first_line

TASK_DIR = Path(__file__).resolve().parent.parent / "assets" / "lm_eval_tasks"


# lm-eval and the package it reads every task's documents with; neither is needed by anything else,
# and some machines (the project's GPU machine) have neither
NEEDS = ("lm_eval", "datasets")


def unavailable() -> str | None:
    """Why lm-eval tasks cannot run in this environment (one line), or None when they can. Found
    without importing lm-eval (its import of ``datasets`` takes seconds), so a command can skip its
    optional tasks with a note before any work instead of failing after it."""
    for name in NEEDS:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package that fails, or an import blocked on purpose
            found = False
        if not found:
            return f"lm-eval cannot run here: the {name!r} package is not installed (pip install lm-eval)"
    return None


def tasks_path() -> str:
    """Directory to pass to ``lm_eval --include_path`` for normswap's tasks."""
    return str(TASK_DIR)


def own_task_splits() -> dict[str, str]:
    """normswap's tasks and the embedded split each scores (read without importing lm-eval)."""
    tasks = {}
    for path in sorted(TASK_DIR.glob("*.yaml")):
        fields = {}
        for line in path.read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key in ("task", "test_split"):
                fields[key] = value.strip().strip("'\"")
        if "task" in fields:
            tasks[fields["task"]] = fields.get("test_split", "test")
    return tasks


def own_task_names() -> set[str]:
    """Task names defined by normswap's YAML files (read without importing lm-eval)."""
    return set(own_task_splits())


def hub_tasks(tasks) -> list[str]:
    """The asked-for tasks that are not normswap's own: lm-eval downloads their datasets."""
    own = own_task_names()
    return [t for t in parse_tasks(tasks) if t not in own]


def crosscheck(model, tokenizer, task: str, *, window: int, limit=None, batch_size: int = 8) -> dict | None:
    """normswap's own perplexity on exactly what lm-eval scores for one of normswap's tasks: the
    same documents, each from a fresh context, in ``window``-token windows without overlap."""
    split = own_task_splits().get(task)
    if split is None:
        return None
    from normswap.data import load_documents
    from normswap.evaluate.perplexity import document_perplexity

    docs = [d.strip() for d in load_documents("embedded", split) if d.strip()]
    if limit:
        docs = docs[: int(limit)]
    r = document_perplexity(model, tokenizer, docs, seq_len=window, stride=window, batch_size=batch_size)
    return {
        "bits_per_byte": r.bits_per_byte,
        "word_perplexity": r.word_perplexity,
        "documents": len(docs),
        "window": window,
    }


@contextlib.contextmanager
def routed_to(log_path: Path):
    """Send everything written to this process's stdout/stderr (file descriptors 1 and 2: tqdm
    bars, warnings, `git` run as a subprocess) and the lm_eval logger into ``log_path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    from normswap.private_dirs import open_private

    log_path.parent.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger("lm_eval")
    # never through a symlink: the default log sits in a shared temporary directory
    with os.fdopen(open_private(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), "a") as log:
        saved_fds = [os.dup(1), os.dup(2)]
        saved_streams = sys.stdout, sys.stderr  # may be wrappers that bypass fds 1 and 2 (pytest, IDEs)
        handler, propagate = logging.StreamHandler(log), logger.propagate
        try:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            sys.stdout = sys.stderr = log
            logger.addHandler(handler)
            logger.propagate = False
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield
        finally:
            log.flush()
            sys.stdout, sys.stderr = saved_streams
            logger.removeHandler(handler)
            logger.propagate = propagate
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
            for fd in saved_fds:
                os.close(fd)


def parse_tasks(tasks) -> list[str]:
    """``a,b`` or a list -> the task names."""
    from normswap.declared import as_list

    return as_list(tasks)


def _clean_scores(task_results: dict) -> dict:
    """lm-eval's ``{"metric,filter": value}`` -> ``{"metric": value}`` (filter "none" dropped)."""
    out = {}
    for key, value in task_results.items():
        if key == "alias" or not isinstance(value, (int, float)):
            continue
        metric, _, filt = key.partition(",")
        name = metric if filt in ("", "none") else f"{metric},{filt}"
        out[name] = float(value)
    return out


def default_log() -> Path:
    """Where lm-eval's own output goes when the caller names no log file: normswap's private
    temporary directory (normswap.private_dirs), not a predictable name in the shared one."""
    from normswap.private_dirs import temp_dir

    return temp_dir() / f"lm_eval-{os.getpid()}.log"


def run_tasks(
    model,
    tokenizer,
    tasks,
    *,
    batch_size: int = 8,
    max_length: int | None = None,
    limit=None,
    device=None,
    log_path: Path | None = None,
    mixed_precision=None,
) -> dict:
    """Scores per task: ``{task: {metric: value}}``.

    ``mixed_precision`` (a torch dtype): run the forward passes under autocast to it, as a model
    trained that way ran (a study's bf16/fp16 arms, whose norms compute in that dtype).

    lm-eval's progress bars, warnings and logging go to ``log_path`` (default: a file in the
    temporary directory), never to the terminal.

    ``max_length`` is lm-eval's window for rolling log-likelihood (default: the model's
    context). BOS is not added by the tokenizer: for rolling log-likelihood lm-eval puts its
    own prefix token in front, as normswap's perplexity does.
    """
    names = parse_tasks(tasks)
    if not names:
        return {}
    log_path = Path(log_path) if log_path is not None else default_log()
    was_training = model.training
    try:
        with routed_to(log_path):
            results = _evaluate(
                model,
                tokenizer,
                names,
                batch_size=batch_size,
                max_length=max_length,
                limit=limit,
                device=device,
                mixed_precision=mixed_precision,
            )
    except NormswapError:
        raise
    except Exception as e:  # lm-eval raises many types for unreachable hub datasets
        if os.environ.get("NORMSWAP_DEBUG") == "1":
            raise
        raise NormswapError(f"lm-eval failed on {','.join(names)}: {first_line(e)} (its output: {log_path})") from None
    finally:
        model.train(was_training)
    return {task: _clean_scores(scores) for task, scores in results["results"].items()}


def _evaluate(model, tokenizer, names, *, batch_size, max_length, limit, device, mixed_precision=None) -> dict:
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.INFO)  # all of it, into the log file
    # Indexing lm-eval's ~15k built-in task files takes most of a minute on a small CPU; skip it
    # when only normswap's own tasks are asked for.
    manager = TaskManager(include_path=tasks_path(), include_defaults=not set(names) <= own_task_names())
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise NormswapError(
            f"unknown lm-eval task(s): {', '.join(unknown)} (normswap ships {', '.join(sorted(own_task_names()))}; "
            "see `lm_eval --tasks list`)"
        )
    kwargs = {"batch_size": batch_size, "add_bos_token": False}
    if max_length is not None:
        kwargs["max_length"] = int(max_length)
    if device is not None:
        kwargs["device"] = str(device)
    if mixed_precision is not None:  # HFLM runs every forward in its own autocast, off unless told a dtype
        kwargs["mixed_precision_dtype"] = mixed_precision
    lm = HFLM(pretrained=model, tokenizer=tokenizer, **kwargs)
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=names,
        task_manager=manager,
        limit=limit,
        log_samples=False,
        bootstrap_iters=0,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
