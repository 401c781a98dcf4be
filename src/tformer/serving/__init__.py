"""The HTTP server: `tformer serve` (see command.py), its routes (app.py) and the decoding
engines that let requests share batches: engine.py (the queue and the thread), scheduler.py
(continuous batching over a paged KV pool: each step planned by plan.py, its tokens handed
over by apply.py) and stream.py (Transformer-XL, one sequence per slot)."""
