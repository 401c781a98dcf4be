"""The HTTP server: `tformer serve` (see command.py), its routes (app.py) and the decoding
scheduler that lets requests share batches (scheduler.py)."""
