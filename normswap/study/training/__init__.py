"""The study's training: arms built, fed and stepped.

arms.py (each arm built from one initialisation), norm_impl.py (which kernel record and dtype each
arm's norms compute with, detected from the graph), bytes_model.py (the default model, over bytes),
sampler.py (the training batches), heldout_blocks.py (the held-out blocks), interleaved.py (one
group's arms stepped in turn), units.py (groups in this process or spread over workers), seeds.py
(one more seed while a verdict is open), migration.py (the migration rule), stability.py
(``--stability``: rates rising until each arm diverges).
"""
