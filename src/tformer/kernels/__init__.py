"""CPU fast paths: for inference, the weight formats (formats.py: fp32's products of a few
rows in fp32.py, int8 layers in quantize.py over int8.py and int8_packed.py), linear layers
with prepacked weights (prepack.py), beam search's candidates (search.py) and whole
decoding steps (step.py, attend.py); for training, dropout (dropout.py), the label-smoothed
cross-entropy with or without the output layer (xent.py), SwiGLU's gate (glu.py) and
RMSNorm (rmsnorm.py). The C kernels are one library (tformer.h, library.py). Each is
optional and checked against the plain torch path."""
