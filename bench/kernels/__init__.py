"""One kernel or MoE layer on one GPU against its floor or a reference, and the tuners that write the kernels' tables."""
