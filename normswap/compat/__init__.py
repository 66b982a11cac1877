"""Does a converted checkpoint work wherever its original works?

``rows.py`` builds a tiny randomised original (with a tokenizer trained on the embedded corpus, an
image or audio processor, and sentence-transformers files) for every curated family and every
architecture discovery converts exactly, and converts it with `normswap convert`. ``checks.py``
runs one entry point (every Auto class, ``pipeline()``, ``Trainer``, PEFT LoRA,
sentence-transformers, ``generate`` with a KV cache, ``torch.compile``, a save/load round trip)
on the original and on the converted model and compares their outputs. ``matrix.py`` runs every
check on every row and writes the table `normswap families matrix` prints.
"""
