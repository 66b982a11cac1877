"""Write discovery's findings as a family description (the family-file schema of schema.py),
templating per-layer paths over ``${i}`` when every layer has the same structure."""

from __future__ import annotations

import re

from torch import nn

from normswap.model_facts import declared_eps, output_embeddings


def describe(
    model,
    stacks,
    g,
    converted,
    writers,
    centered_inputs,
    left,
    placement,
    post_evidence,
    name,
    stream_biases=(),
    stream_scales=(),
) -> dict:
    """Write the findings in the family-file schema, templating per-layer paths over ``${i}``."""
    config = model.config
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = prefix + "." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""

    def rel(path):
        return path[len(base) :] if base and path.startswith(base) else ("^" + path if base else path)

    main = stacks[0]
    main_len = len(model.get_submodule(main))
    pattern = re.compile(re.escape(rel(main)) + r"\.(\d+)\.")

    def template(path):
        m = pattern.match(path)
        return (pattern.sub(f"{rel(main)}.${{i}}.", path, count=1), int(m.group(1))) if m else (path, None)

    def collapse(items):
        """items: [(path, payload)], payload hashable: one templated entry when all layers agree."""
        groups: dict = {}
        order = []
        for path, payload in items:
            t, idx = template(path)
            key = (t, (tuple(template(p)[0] for p in payload[0]), payload[1]))
            if key not in groups:
                order.append(key)
                groups[key] = set()
            groups[key].add(idx)
        out = []
        for key in order:
            idxs = groups[key]
            if None not in idxs and idxs == set(range(main_len)):
                out.append(key)
            else:  # not uniform across layers: spell out each one
                for path, payload in items:
                    t, _ = template(path)
                    if (t, (tuple(template(p)[0] for p in payload[0]), payload[1])) == key:
                        out.append((path, (tuple(payload[0]), payload[1])))
        return out

    def spec_extras(n):
        s = g.norms[n]
        extra = {}
        if s.gamma_offset:
            extra["gamma_offset"] = s.gamma_offset
        declared = declared_eps(g.modules[n])
        if declared is None or abs(declared - s.eps) > 1e-3 * s.eps:
            extra["eps"] = s.eps
        return extra

    final = None
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
        e.update(spec_extras(source))
        return e

    norms_out = []
    sources = {rel(n): n for n in converted}
    for path, payload in collapse([(p, pl) for p, pl, _ in layer_items]):
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

    embeddings = [
        rel(m)
        for m, kind in writers.items()
        if kind in ("table",) or (kind == "module" and not any(m.startswith(s + ".") for s in stacks))
    ]
    writer_paths = [rel(m) for m, kind in writers.items() if rel(m) not in embeddings]
    writer_out = []
    for path, _ in collapse([(w, ((), False)) for w in writer_paths]):
        writer_out.append(path)
    head = output_embeddings(model)
    head_name = next((n for n, m in g.modules.items() if m is head), None) if head is not None else None

    leave = [{"pattern": re.escape(n), "reason": reason} for n, reason in left.items()]
    raw = {
        "name": name or getattr(config, "model_type", type(model).__name__).replace("-", "_"),
        "display": f"{type(model).__name__} (discovered)",
        "model_types": [getattr(config, "model_type", "unknown")],
        "placement": placement,
        "layers": rel(main),
        "embeddings": embeddings,
        "writers": writer_out,
        "norms": norms_out,
        "final_norm": final,
        "head": rel(head_name) if head_name else None,
        "leave_alone": leave,
        "centered_inputs": [rel(c) for c in centered_inputs],
        "stream_biases": [path for path, _ in collapse([(rel(p), ((), False)) for p in stream_biases])],
        "stream_scales": [
            {"scale": path, "writer": payload[0][0]}
            for path, payload in collapse([(rel(p), ((rel(w),), False)) for p, w in stream_scales])
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
