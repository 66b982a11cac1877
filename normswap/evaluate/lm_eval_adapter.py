"""Run lm-evaluation-harness tasks on an in-memory model.

The project's own tasks (``normswap/assets/lm_eval_tasks``) are always on the include path, so
``normswap_kjv`` works offline; hub tasks (``wikitext``, ``hellaswag``, ...) work for users
who are online, exactly as with ``lm_eval`` itself.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from normswap.errors import NormswapError

TASK_DIR = Path(__file__).resolve().parent.parent / "assets" / "lm_eval_tasks"


def tasks_path() -> str:
    """Directory to pass to ``lm_eval --include_path`` for normswap's tasks."""
    return str(TASK_DIR)


def own_task_names() -> set[str]:
    """Task names defined by normswap's YAML files (read without importing lm-eval)."""
    names = set()
    for path in TASK_DIR.glob("*.yaml"):
        for line in path.read_text().splitlines():
            if line.startswith("task:"):
                names.add(line.split(":", 1)[1].strip().strip("'\""))
    return names


def parse_tasks(tasks) -> list[str]:
    if tasks is None:
        return []
    if isinstance(tasks, str):
        tasks = tasks.split(",")
    return [t.strip() for t in tasks if t and t.strip()]


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


def run_tasks(model, tokenizer, tasks, *, batch_size: int = 8, max_length: int | None = None, limit=None, device=None) -> dict:
    """Scores per task: ``{task: {metric: value}}``.

    ``max_length`` is lm-eval's window for rolling log-likelihood (default: the model's
    context). BOS is not added by the tokenizer: for rolling log-likelihood lm-eval puts its
    own prefix token in front, as normswap's perplexity does.
    """
    names = parse_tasks(tasks)
    if not names:
        return {}
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as e:  # pragma: no cover - lm-eval is a dependency
        raise NormswapError(f"--tasks needs lm-evaluation-harness: pip install lm-eval ({e})") from None

    # lm-eval logs every request batch at INFO; keep normswap's output readable.
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    # Indexing lm-eval's ~15k built-in task files takes most of a minute on a small CPU; skip it
    # when only normswap's own tasks are asked for.
    manager = TaskManager(include_path=tasks_path(), include_defaults=not set(names) <= own_task_names())
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise NormswapError(
            f"unknown lm-eval task(s): {', '.join(unknown)} (normswap ships normswap_kjv, normswap_kjv_validation; "
            "see `lm_eval --tasks list`)"
        )
    was_training = model.training
    kwargs = {"batch_size": batch_size, "add_bos_token": False}
    if max_length is not None:
        kwargs["max_length"] = int(max_length)
    if device is not None:
        kwargs["device"] = str(device)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, **kwargs)
    try:
        results = lm_eval.simple_evaluate(
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
    except Exception as e:  # lm-eval raises many types for unreachable hub datasets
        if os.environ.get("NORMSWAP_DEBUG") == "1":
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise NormswapError(f"lm-eval failed on {','.join(names)}: {msg}") from None
    finally:
        model.train(was_training)
    return {task: _clean_scores(scores) for task, scores in results["results"].items()}
