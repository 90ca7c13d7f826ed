"""SuperNeurons: a Caffe-compatible training framework that trains networks larger than the GPU's memory."""

__version__ = "0.1.0"
