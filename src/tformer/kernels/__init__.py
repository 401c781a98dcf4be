"""CPU fast paths for decoding: a hand-written kernel for products of a few rows
(matvec.py, matvec.c), linear layers with prepacked weights (prepack.py) and weight-only
int8 (quantize.py). Each is optional and checked against the plain torch path."""
