"""Write discovery's findings as a family description (the family-file schema of schema.py),
templating per-layer paths over ``${i}`` when every layer has the same structure."""

from __future__ import annotations

import re

from torch import nn

from normswap.model_facts import declared_eps, output_embeddings


class LayerPaths:
    """Module paths as a family file writes them: relative to the base model (``^`` marks one outside
    it), and per-layer paths of the main stack templated over ``${i}``."""

    def __init__(self, model, stacks):
        prefix = getattr(model, "base_model_prefix", "") or ""
        self.base = prefix + "." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
        self.main = stacks[0]
        self.main_len = len(model.get_submodule(self.main))
        self.pattern = re.compile(re.escape(self.rel(self.main)) + r"\.(\d+)\.")

    def rel(self, path):
        base = self.base
        return path[len(base) :] if base and path.startswith(base) else ("^" + path if base else path)

    def template(self, path):
        m = self.pattern.match(path)
        return (
            (self.pattern.sub(f"{self.rel(self.main)}.${{i}}.", path, count=1), int(m.group(1))) if m else (path, None)
        )

    def _key(self, path, payload):
        return self.template(path)[0], (tuple(self.template(p)[0] for p in payload[0]), payload[1])

    def collapse(self, items):
        """items: [(path, payload)], payload hashable: one templated entry when all layers agree."""
        groups: dict = {}
        order = []
        for path, payload in items:
            key = self._key(path, payload)
            if key not in groups:
                order.append(key)
                groups[key] = set()
            groups[key].add(self.template(path)[1])
        out = []
        for key in order:
            idxs = groups[key]
            if None not in idxs and idxs == set(range(self.main_len)):
                out.append(key)
            else:  # not uniform across layers: spell out each one
                out += [
                    (path, (tuple(payload[0]), payload[1]))
                    for path, payload in items
                    if self._key(path, payload) == key
                ]
        return out


def spec_extras(g, n) -> dict:
    """What a norm's entry must say beyond its path: a (1+γ) offset, an ε its module does not declare."""
    s = g.norms[n]
    extra = {}
    if s.gamma_offset:
        extra["gamma_offset"] = s.gamma_offset
    declared = declared_eps(g.modules[n])
    if declared is None or abs(declared - s.eps) > 1e-3 * s.eps:
        extra["eps"] = s.eps
    return extra


def norm_entries(paths: LayerPaths, g, converted, stacks, placement) -> tuple[list[dict], dict | None]:
    """The ``norms`` entries (per-layer ones templated) and the final norm: the last norm after the
    stacks that reads the stream, in a pre-LN model."""
    rel = paths.rel
    stack_output_norms = []
    layer_items, other_items = [], []
    for n in sorted(converted, key=lambda n: list(g.modules).index(n)):
        rec = converted[n]
        payload = (tuple(rel(r) for r in rec["readers"]), rec["starts_stream"])
        in_layers = any(n.startswith(s + ".") for s in stacks)
        (layer_items if in_layers else other_items).append((rel(n), payload, n))
        if not in_layers and not rec["starts_stream"]:
            stack_output_norms.append(n)

    def norm_entry(path, payload, source):
        e = {"norm": path, "readers": list(payload[0])}
        if payload[1]:
            e["starts_stream"] = True
        e.update(spec_extras(g, source))
        return e

    final = None
    norms_out = []
    sources = {rel(n): n for n in converted}
    for path, payload in paths.collapse([(p, pl) for p, pl, _ in layer_items]):
        src = sources.get(path) or sources[path.replace("${i}", "0")]
        norms_out.append(norm_entry(path, payload, src))
    for path, payload, src in other_items:
        entry = norm_entry(path, payload, src)
        if final is None and src in stack_output_norms and src == stack_output_norms[-1] and placement == "pre":
            final = entry
        else:
            norms_out.append(entry)
    if not norms_out and final is not None:
        norms_out, final = [final], None
    return norms_out, final


def writer_entries(paths: LayerPaths, writers, stacks) -> tuple[list[str], list[str]]:
    """``embeddings`` (tables, and modules writing the stream from outside the stacks) and ``writers``."""
    rel = paths.rel
    embeddings = [
        rel(m)
        for m, kind in writers.items()
        if kind in ("table",) or (kind == "module" and not any(m.startswith(s + ".") for s in stacks))
    ]
    writer_paths = [rel(m) for m, kind in writers.items() if rel(m) not in embeddings]
    return embeddings, [path for path, _ in paths.collapse([(w, ((), False)) for w in writer_paths])]


def describe(model, stacks, g, found, left, placement, name) -> dict:
    """Write discovery's findings (discover.StreamFindings) in the family-file schema, templating
    per-layer paths over ``${i}``."""
    config = model.config
    paths = LayerPaths(model, stacks)
    rel = paths.rel
    norms_out, final = norm_entries(paths, g, found.converted, stacks, placement)
    embeddings, writer_out = writer_entries(paths, found.writers, stacks)
    head = output_embeddings(model)
    head_name = next((n for n, m in g.modules.items() if m is head), None) if head is not None else None
    post_evidence = found.post_evidence
    raw = {
        "name": name or getattr(config, "model_type", type(model).__name__).replace("-", "_"),
        "display": f"{type(model).__name__} (discovered)",
        "model_types": [getattr(config, "model_type", "unknown")],
        "placement": placement,
        "layers": rel(paths.main),
        "embeddings": embeddings,
        "writers": writer_out,
        "norms": norms_out,
        "final_norm": final,
        "head": rel(head_name) if head_name else None,
        "leave_alone": [{"pattern": re.escape(n), "reason": reason} for n, reason in left.items()],
        "centered_inputs": [rel(c) for c in found.centered_inputs],
        "stream_biases": [path for path, _ in paths.collapse([(rel(p), ((), False)) for p in found.stream_biases])],
        "stream_scales": [
            {"scale": path, "writer": payload[0][0]}
            for path, payload in paths.collapse([(rel(p), ((rel(w),), False)) for p, w in found.stream_scales])
        ],
        "notes": ("post-LN: " + "; ".join(dict.fromkeys(post_evidence))[:300]) if post_evidence else "",
        "discovered": True,
    }
    if raw["final_norm"] is None:
        raw.pop("final_norm")
    for key in ("stream_biases", "stream_scales"):
        if not raw[key]:
            raw.pop(key)
    return raw
