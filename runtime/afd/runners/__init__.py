"""Role runners: the attention-side forward with remote FFNs, the FFN worker loop and its step executor."""
