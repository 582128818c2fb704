"""Role runners: the FFN daemon loop and the attention-side forward with remote FFNs."""
