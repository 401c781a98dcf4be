"""CPU fast paths: for inference, a hand-written kernel for products of a few rows
(matvec.py, matvec.c), linear layers with prepacked weights (prepack.py), int8 linear layers
(quantize.py) and beam search's candidates (search.py); for training, dropout (dropout.py)
and the label-smoothed cross-entropy (xent.py). Each is optional and checked against the
plain torch path."""
