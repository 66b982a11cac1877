"""Load the 1.4B slice with stock transformers and generate 8 greedy tokens (generate.txt is its output)."""

import sys
import time

import torch
from transformers import AutoModelForCausalLM

t = time.time()
path = sys.argv[1] if len(sys.argv) > 1 else "neox-1.4b-sliced"
m = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.bfloat16).eval()
print("loaded", type(m).__name__, "hidden", m.config.hidden_size, "use_cache", m.config.use_cache)
ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
with torch.no_grad():
    out = m.generate(ids, max_new_tokens=8, do_sample=False)
print("generated", out[0, 8:].tolist(), f"{time.time() - t:.1f}s")
