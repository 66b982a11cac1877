import time, torch
from transformers import AutoModelForCausalLM
t = time.time()
m = AutoModelForCausalLM.from_pretrained("/work/big/neox-1.4b-sliced", trust_remote_code=True, dtype=torch.bfloat16).eval()
print("loaded", type(m).__name__, "hidden", m.config.hidden_size, "use_cache", m.config.use_cache, f"{time.time()-t:.1f}s")
ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
with torch.no_grad():
    out = m.generate(ids, max_new_tokens=8, do_sample=False)
print("generated", out[0, 8:].tolist(), f"{time.time()-t:.1f}s")
