"""One model step (decode, mixed, attention only, with metrics or logits controls) against its floor, on one GPU or process."""
