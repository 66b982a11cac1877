"""Greedy parity of `normswap export --format onnx` graphs (with the key/value cache) against PyTorch.

For each EXPORT=SOURCE pair: PyTorch's generate on SOURCE (float32, greedy, exactly N new tokens) against
(a) normswap's OnnxGenerator loop on onnxruntime and (b) onnxruntime-genai reading genai_config.json, on the
same prompts (the KJV probe text and a second KJV line, two rows, 16 tokens each); optimum's
ORTModelForCausalLM is tried and its import error recorded. Prints one line per model and a JSON document.
"""

import json
import sys
import time

import numpy as np
import onnxruntime
import torch
import transformers

from normswap.checkpoint.load import load_model, load_tokenizer
from normswap.export.onnx_generate import OnnxGenerator, torch_greedy

NEW = 64
PROMPTS = ["In the beginning God created the heaven and the earth.", "And God said, Let there be light: and there was"]


def genai_tokens(directory, prompt, new):
    import onnxruntime_genai as og

    model = og.Model(str(directory))
    params = og.GeneratorParams(model)
    total = prompt.shape[1] + new
    params.set_search_options(max_length=total, min_length=total, do_sample=False, batch_size=prompt.shape[0])
    gen = og.Generator(model, params)
    gen.append_tokens(prompt.astype(np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    return np.stack([np.asarray(gen.get_sequence(i), dtype=np.int64) for i in range(prompt.shape[0])]), og


def optimum_status():
    try:
        from optimum.onnxruntime import ORTModelForCausalLM  # noqa: F401

        return "imports"
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"


rows = []
for pair in sys.argv[1:]:
    export, source = pair.split("=")
    tok = load_tokenizer(source)
    ids = [tok(p, add_special_tokens=False)["input_ids"][:16] for p in PROMPTS]
    prompt = torch.tensor([i + [i[-1]] * (16 - len(i)) for i in ids])
    model = load_model(source, dtype=torch.float32)
    ref = torch_greedy(model, prompt, NEW).numpy()
    t = time.perf_counter()
    ours = OnnxGenerator(export).generate(prompt.numpy(), NEW)
    genai, og = genai_tokens(export, prompt.numpy(), NEW)
    row = {
        "export": export,
        "source": source,
        "new_tokens": NEW,
        "rows": int(prompt.shape[0]),
        "onnxruntime_loop_identical": bool(np.array_equal(ours, ref)),
        "onnxruntime_genai_identical": bool(np.array_equal(genai, ref)),
        "distinct_new_tokens": int(len(np.unique(ref[:, 16:]))),
        "text_row0": tok.decode(ref[0, 16:].tolist()),
    }
    rows.append(row)
    print(
        f"{export}: 64 greedy tokens x 2 rows vs PyTorch: onnxruntime loop "
        f"{'identical' if row['onnxruntime_loop_identical'] else 'DIFFERENT'}, onnxruntime-genai "
        f"{'identical' if row['onnxruntime_genai_identical'] else 'DIFFERENT'} "
        f"({row['distinct_new_tokens']} distinct tokens)"
    )
doc = {
    "models": rows,
    "optimum.onnxruntime.ORTModelForCausalLM": optimum_status(),
    "versions": {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnxruntime": onnxruntime.__version__,
        "onnxruntime_genai": og.__version__,
    },
}
print(json.dumps(doc, indent=1))
