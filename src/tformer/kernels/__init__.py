"""CPU fast paths: for inference, a hand-written kernel for products of a few rows
(matvec.py, matvec.c), linear layers with prepacked weights (prepack.py), int8 linear layers
(quantize.py), beam search's candidates (search.py) and whole decoding steps (step.py,
attend.py); for training, dropout (dropout.py), the label-smoothed cross-entropy with or
without the output layer (xent.py), SwiGLU's gate (glu.py) and RMSNorm (rmsnorm.py). Each
is optional and checked against the plain torch path."""
