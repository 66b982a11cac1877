"""Which runtime generates faster from the same graph: onnxruntime-genai's generator or normswap's
OnnxGenerator loop on onnxruntime (both CPU, 1 thread, greedy, a 16-token prompt + 64 new tokens, batch 1).
Timed by normswap/timing.py: interleaved pairs, the baseline's second copy as the null control.
Usage: python speed.py EXPORT_DIR [budget_s]"""

import json
import os
import shutil
import sys
import tempfile

import numpy as np
import onnxruntime_genai as og

from normswap import timing
from normswap.export.onnx_generate import OnnxGenerator

out, budget = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 90
prompt = np.arange(100, 116, dtype=np.int64)[None, :]
NEW = 64
# genai: one intra-op thread, as the loop's session (a copy of the directory with that genai_config.json)
cfg = json.loads(open(f"{out}/genai_config.json").read())
cfg["model"]["decoder"]["session_options"]["intra_op_num_threads"] = 1
cfg["model"]["decoder"]["session_options"]["inter_op_num_threads"] = 1


def genai_fn(model):
    def run():
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=16 + NEW, min_length=16 + NEW, do_sample=False, batch_size=1)
        gen = og.Generator(model, params)
        gen.append_tokens(prompt.astype(np.int32))
        while not gen.is_done():
            gen.generate_next_token()
        return np.asarray(gen.get_sequence(0))

    return run


tmp = tempfile.mkdtemp()
for name in os.listdir(out):
    src = os.path.join(out, name)
    if os.path.isfile(src) and name != "genai_config.json":
        os.symlink(os.path.abspath(src), os.path.join(tmp, name))
with open(os.path.join(tmp, "genai_config.json"), "w") as f:
    json.dump(cfg, f)
genai_model = og.Model(tmp)
loops = [OnnxGenerator(out, threads=1), OnnxGenerator(out, threads=1)]
a = genai_fn(genai_model)()
b = loops[0].generate(prompt, NEW)[0]
assert np.array_equal(a, b), "the two runtimes disagree"
fns = {
    "onnxruntime loop": lambda: loops[0].generate(prompt, NEW),
    "null control": lambda: loops[1].generate(prompt, NEW),
    "onnxruntime-genai": genai_fn(genai_model),
}
cmp = timing.compare(fns, "onnxruntime loop", "null control", calls_per_sample=1, budget_s=budget, min_pairs=20)
res = {
    "export": out,
    "tokens": "16-token prompt + 64 new, batch 1, greedy, 1 thread",
    "seconds_per_generate": cmp.seconds_per_call,
    "new_tokens_per_second": {k: NEW / s for k, s in cmp.seconds_per_call.items()},
    "over_loop": {k: r.to_json() for k, r in cmp.candidates.items()},
    "null_control": cmp.null.to_json(),
    "rounds": cmp.to_json()["rounds"],
    "stop_reason": cmp.to_json()["stop_reason"],
}
print(json.dumps(res, indent=1))
shutil.rmtree(tmp)
