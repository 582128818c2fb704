"""AFD runtime: attention and FFN roles of an Attention-FFN Disaggregated MoE model."""

__version__ = "0.1.0"
